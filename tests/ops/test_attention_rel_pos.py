"""``rel_pos_attention`` (SAM/ViTDet attention with decomposed relative positions): every case of
its table (``customop/samples/attention.py``) on forward_native, forward_cpu and forward_cuda against
a float64 reference built on an explicit ``[H*W, H*W]`` bias (``tests/cases/attention.py``), the
blocked form of forward_kernel at every blocking level, the table interpolation, loading vLLM/SAM
parameter names, bad inputs, torch.compile and conformance (docs/attention.md)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

from customop.config import Config, use_config
from customop.math.attention import get_rel_pos
from customop.ops.attention import RelPosAttention
from customop.ops.linear import cpu_linear
from customop.samples.attention import DTYPES, REL_POS_CASES
from customop.testing import assert_close, assert_conforms, assert_same_error, randn
from tests.cases.attention import ref_rel_pos_attention, ref_resize

PARAMS = [pytest.param(c, s, id=f"{c.label}-{'x'.join(map(str, s))}") for c in REL_POS_CASES for s in c.shapes["small"]]
GEN = lambda seed=0: torch.Generator().manual_seed(seed)  # noqa: E731
CASE = {c.label: c for c in REL_POS_CASES}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", ["forward_native", "forward_cpu", "forward_cuda"])
@pytest.mark.parametrize("case,shape", PARAMS)
def test_matches_float64_reference(case, shape, path, dtype):
    with use_config(Config(custom_ops=["all"])):
        op = case.build(dtype, generator=GEN())
    x = randn(*shape, dtype=dtype, generator=GEN(1))
    got = getattr(op, path)(x)
    assert got.dtype == dtype and got.shape == x.shape
    assert_close(got, ref_rel_pos_attention(op, x), dtype, what=case.label)


def _blocks(shape, heads):
    """Block sizes (bias entries) that make forward_kernel split at each level, remainders included,
    for a ``[B, H, W, dim]`` input: one grid row per call, 3 rows, 3 heads, 2 images, one call."""
    batch, height, width, _ = shape
    row = width * height * width
    return {"row": 1, "3 rows": 3 * row, "3 heads": 3 * height * row, "2 images": 2 * heads * height * row,
            "one": batch * heads * height * row}


BLOCKED = [pytest.param(label, (3, 7, 5, 64), level, id=f"{label}-{level}")
           for label in ("rel_pos 7x5", "rel_pos interpolated") for level in _blocks((3, 7, 5, 64), 4)]
BLOCKED.append(pytest.param("plain", (3, 7, 5, 48), "one", id="plain-one"))  # no bias: nothing to block


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("label,shape,level", BLOCKED)
def test_blocked_kernel_matches_float64_reference(label, shape, level, dtype, monkeypatch):
    """forward_kernel (what forward_cpu and forward_cuda run) split into blocks of query rows at every
    level: grid rows, groups of heads, groups of images; 7 x 5 on its own tables and on 8 x 8 ones."""
    case = CASE[label]
    with use_config(Config(custom_ops=["all"])):
        op = case.build(dtype, generator=GEN())
    monkeypatch.setitem(RelPosAttention.bias_block, "cpu", _blocks(shape, op.num_heads)[level])
    x = randn(*shape, dtype=dtype, generator=GEN(1))
    for path in ("forward_cpu", "forward_cuda", "forward_kernel"):
        got = getattr(op, path)(x)
        assert got.dtype == dtype and got.shape == x.shape
        assert_close(got, ref_rel_pos_attention(op, x), dtype, what=f"{label} {path} {level}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("label,shape,level", BLOCKED)
def test_narrow_grid_bias_add_is_bitwise_the_plain_one(label, shape, level, dtype, monkeypatch):
    """forward_cpu builds a narrow grid's bf16/fp16 bias with the queries innermost
    (``narrow_add_below``): the same additions, so bitwise the plain blocked form at every level."""
    case = CASE[label]
    with use_config(Config(custom_ops=["all"])):
        op = case.build(dtype, generator=GEN())
    monkeypatch.setitem(RelPosAttention.bias_block, "cpu", _blocks(shape, op.num_heads)[level])
    assert shape[2] < RelPosAttention.narrow_add_below
    x = randn(*shape, dtype=dtype, generator=GEN(1))
    plain, narrow = op.forward_kernel(x), op.forward_kernel(x, narrow_add_below=shape[2] + 1)
    assert torch.equal(plain, narrow)
    # forward_cpu: the same form, its projections on cpu_linear
    half = dtype in (torch.bfloat16, torch.float16)
    want = op.forward_kernel(x, narrow_add_below=shape[2] + 1 if half else 0, linear=cpu_linear)
    assert torch.equal(op.forward_cpu(x), want)


def test_blocked_kernel_records_autograd(monkeypatch):
    case = CASE["rel_pos interpolated"]
    op = case.build(torch.float32, generator=GEN()).requires_grad_(True)
    monkeypatch.setitem(RelPosAttention.bias_block, "cpu", _blocks((2, 7, 5, 64), 4)["3 rows"])
    x = randn(2, 7, 5, 64, generator=GEN(1)).requires_grad_(True)
    wrt = (x, op.qkv.weight, op.rel_pos_h, op.rel_pos_w)
    got = torch.autograd.grad(op.forward_kernel(x).square().sum(), wrt)
    want = torch.autograd.grad(op.forward_native(x).square().sum(), wrt)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("length,target", [(15, 11), (15, 19), (7, 7), (3, 1)])
def test_table_interpolation_is_linear_with_half_pixel_centres(length, target):
    table = randn(length, 8, generator=GEN(3), dtype=torch.float64)
    size = (target + 1) // 2
    got = get_rel_pos(size, size, table)  # [size, size, 8]: row i - j + size - 1 of the resized table
    resized = ref_resize(table, target)
    i, j = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    assert_close(got, resized[i - j + size - 1], torch.float32)  # the spec resizes in fp32


def test_unequal_query_and_key_sizes_stretch_the_shorter_axis():
    """q_size 2, k_size 4: query coordinates scale by 2 (vLLM/SAM's rule), offsets 2i - j + 3."""
    table = torch.arange(7.0)[:, None]
    got = get_rel_pos(2, 4, table)[..., 0]
    assert torch.equal(got, torch.tensor([[3.0, 2, 1, 0], [5, 4, 3, 2]]))


def test_loads_vllm_parameter_names_and_defaults():
    op = RelPosAttention(64, 4, use_rel_pos=True, input_size=(14, 10))
    assert sorted(n for n, _ in op.named_parameters()) == \
        ["proj.bias", "proj.weight", "qkv.bias", "qkv.weight", "rel_pos_h", "rel_pos_w"]
    assert op.rel_pos_h.shape == (27, 16) and op.rel_pos_w.shape == (19, 16) and not op.rel_pos_h.any()
    assert op.scale == 16 ** -0.5 and RelPosAttention.name == "rel_pos_attention"
    assert RelPosAttention(64, qkv_bias=False).qkv.bias is None


def test_bad_arguments_and_inputs():
    with pytest.raises(ValueError, match="num_heads=5 must divide dim=64"):
        RelPosAttention(64, 5)
    with pytest.raises(ValueError, match="use_rel_pos needs input_size"):
        RelPosAttention(64, 4, use_rel_pos=True)
    op = RelPosAttention(64, 4)
    paths = ["forward_native", "forward_cpu", "forward_cuda", "forward_kernel"]
    for x, error, match in ((randn(2, 16, 64), ValueError, r"x has shape \(2, 16, 64\), expected \[batch, height, width, 64\]"),
                            (randn(1, 4, 4, 32), ValueError, "x has shape"),
                            (randn(1, 4, 4, 64, dtype=torch.bfloat16), TypeError, "x has dtype torch.bfloat16"),
                            (None, TypeError, "x must be a torch.Tensor")):
        for path in paths:
            with pytest.raises(error, match=f"customop.rel_pos_attention: {match}"):
                getattr(op, path)(x)


def test_compiles_fullgraph():
    case = REL_POS_CASES[1]
    op = case.build(torch.float32, generator=GEN())
    x = randn(*case.shapes["small"][0], generator=GEN(1))
    counter = torch._dynamo.testing.CompileCounter()
    got = torch.compile(op, backend=counter, fullgraph=True)(x)
    assert_close(got, ref_rel_pos_attention(op, x), torch.float32)
    assert counter.frame_count == 1


@pytest.mark.parametrize("dtype,level", [(torch.float32, "3 heads"), (torch.bfloat16, "one")], ids=str)
def test_blocked_kernel_compiles_fullgraph_under_inductor(dtype, level, monkeypatch):
    """The op dispatching to forward_cpu (the blocked form) in one Inductor graph, 7 x 5 on 8 x 8 tables:
    blocks of 3 of the 8 heads (a remainder included; blocks of 3 rows unrolled 19 blocks into the
    graph and took Inductor 190 s on a 2-core CI machine), and one block."""
    with use_config(Config(custom_ops=["all"])):
        op = CASE["rel_pos interpolated"].build(dtype, generator=GEN())
    assert op.forward_method_name == "forward_cpu"
    monkeypatch.setitem(RelPosAttention.bias_block, "cpu", _blocks((2, 7, 5, 64), 4)[level])
    x = randn(2, 7, 5, 64, dtype=dtype, generator=GEN(1))
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    got = torch.compile(op, backend=counter, fullgraph=True)(x)
    assert_close(got, ref_rel_pos_attention(op, x), dtype)
    assert counter.frame_count == 1


def test_conforms():
    assert_conforms(RelPosAttention)
