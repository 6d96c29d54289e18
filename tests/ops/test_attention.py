"""Attention family (``mm_encoder_attn``): every case of the table (``customop/samples/attention.py``)
on forward_native and forward_cpu against the float64 references (``tests/cases/attention.py``),
forward_kernel's wiring (the library op's reference on CPU tensors), dispatch, bad inputs on every
path, opcheck, torch.compile(fullgraph=True), the conformance suite and the out-of-tree example
(``examples/oot_mm_encoder_attn.py``, run in a subprocess).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch._dynamo.testing

from customop.config import Config, use_config
from customop.ops.attention import MMEncoderAttention
from customop.samples.attention import BY_LABEL, CASES, DTYPES, SIZES, Packing
from customop.testing import assert_close, assert_conforms, assert_same_error, forced_platform, randn
from tests.cases.attention import reference

#: the 64-segment packing on the first case only: 64 SDPA calls per path are 64 OpenMP regions, each
#: stalled by a scheduler tick on a loaded 2-core machine (~2 s a test); the others take the rest
PARAMS = [pytest.param(c, p, id=f"{c.label}-{p.label}") for c in CASES for p in SIZES["small"]
          if c is CASES[0] or len(p.lengths or ()) < 64]


def make(case, packing, dtype, seed=1):
    """(op, (q, k, v), call kwargs, float64 expected)."""
    op = case.build()
    q, k, v = case.inputs(packing, dtype, generator=torch.Generator().manual_seed(seed))
    kwargs = {"cu_seqlens": packing.cu_seqlens()} if packing.lengths is not None else {}
    return op, (q, k, v), kwargs, reference(case, op, packing, q, k, v)


# ---- the table: every case, packing and dtype -------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", ["forward_native", "forward_cpu"])
@pytest.mark.parametrize("case,packing", PARAMS)
def test_matches_float64_reference(case, packing, path, dtype):
    check_path(case, packing, path, dtype)


@pytest.mark.parametrize("case,packing", PARAMS)
def test_forward_kernel_wiring(case, packing):
    """forward_kernel (what forward_cuda/_xpu/_tpu run) on CPU tensors reaches the library op's
    reference: the packed views, batch offsets and max_seqlen it builds give the right result."""
    check_path(case, packing, "forward_kernel", torch.bfloat16)


def check_path(case, packing, path, dtype):
    op, args, kwargs, expected = make(case, packing, dtype)
    before = [a.clone() for a in args]
    got = getattr(op, path)(*args, **kwargs)
    assert got.dtype == dtype and got.shape == args[0].shape
    assert_close(got, expected, dtype, what=f"{case.label} {path}")
    for a, b in zip(args, before):
        assert torch.equal(a, b), "an input was written"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("packing", SIZES["small"], ids=lambda p: p.label)
def test_cpu_path_is_bitwise_the_spec(packing, dtype):
    """forward_cpu batches runs of equal segments into one SDPA call; each segment's arithmetic is
    the spec's, so the results must be identical, not just close."""
    case = BY_LABEL["gqa d72"]
    op, args, kwargs, _ = make(case, packing, dtype)
    assert torch.equal(op.forward_cpu(*args, **kwargs), op.forward_native(*args, **kwargs))


def test_packed_equals_each_segment_alone():
    """The notes' property: a packed call equals calling the op on each segment separately."""
    case, lengths = BY_LABEL["gqa d72"], (1, 7, 33, 20)
    op, (q, k, v), kwargs, _ = make(case, Packing(1, lengths), torch.float32)
    got = op.forward_cpu(q, k, v, **kwargs)
    start = 0
    for length in lengths:
        piece = slice(start, start + length)
        alone = op.forward_native(q[:, piece], k[:, piece], v[:, piece])
        assert_close(got[:, piece], alone, torch.float32)
        start += length


def test_gqa_equals_explicit_repeat():
    """GQA with Hkv heads equals MHA with every key/value head repeated for its query group."""
    q, k, v = randn(1, 20, 8, 64), randn(1, 20, 2, 64), randn(1, 20, 2, 64)
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    gqa = MMEncoderAttention(8, 64, num_kv_heads=2)(q, k, v, cu)
    mha = MMEncoderAttention(8, 64)(q, k.repeat_interleave(4, 2), v.repeat_interleave(4, 2), cu)
    assert_close(gqa, mha, torch.float32)


@pytest.mark.parametrize("max_seqlen", [None, 33, torch.tensor(33), torch.tensor([40], dtype=torch.int32)],
                         ids=["none", "int", "0-d tensor", "1-element tensor"])
@pytest.mark.parametrize("path", ["forward_native", "forward_cpu", "forward_kernel"])
def test_max_seqlen_forms(path, max_seqlen):
    op, args, kwargs, expected = make(CASES[0], Packing(1, (1, 7, 33)), torch.float32)
    assert_close(getattr(op, path)(*args, **kwargs, max_seqlen=max_seqlen), expected, torch.float32)


@pytest.mark.parametrize("path", ["forward_native", "forward_cpu", "forward_kernel"])
def test_int64_cu_seqlens(path):
    """vLLM passes int32; an int64 cu_seqlens works too (the kernel path converts it)."""
    op, args, kwargs, expected = make(CASES[2], Packing(2, (3, 1, 9)), torch.float32)
    assert_close(getattr(op, path)(*args, cu_seqlens=kwargs["cu_seqlens"].long()), expected, torch.float32)


@pytest.mark.parametrize("path", ["forward_native", "forward_cpu", "forward_kernel"])
def test_empty_sequence(path):
    op = MMEncoderAttention(2, 64)
    q = randn(1, 0, 128)
    out = getattr(op, path)(q, q, q, torch.zeros(2, dtype=torch.int32))
    assert out.shape == (1, 0, 128)


def test_autograd_records_through_the_spec():
    """The library op has no backward: while autograd records, forward_kernel runs the spec, and
    the gradients are the spec's."""
    op, (q, k, v), kwargs, _ = make(CASES[1], Packing(1, (3, 9)), torch.float32)
    grads = []
    for fn in (op.forward_kernel, op.forward_native):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        fn(*leaves, **kwargs).square().sum().backward()
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):
        assert a is not None and torch.equal(a, b)


# ---- construction and dispatch ----------------------------------------------------------------


def test_constructor_matches_vllm():
    op = MMEncoderAttention(16, 80, prefix="visual.blocks.0.attn.attn")
    assert (op.num_heads, op.num_kv_heads, op.num_queries_per_kv, op.layer_name) == (16, 16, 1, "visual.blocks.0.attn.attn")
    assert op.scale == 80 ** -0.5 and MMEncoderAttention(16, 80, scale=0.1).scale == 0.1
    assert MMEncoderAttention(16, 80, num_kv_heads=4).num_queries_per_kv == 4
    assert MMEncoderAttention.name == "mm_encoder_attn"


@pytest.mark.parametrize("platform", ["cpu", "xpu"])
def test_on_by_default_even_under_none_but_minus_turns_it_off(platform):
    """vLLM's op is always enabled (Inductor does not fuse attention); here -mm_encoder_attn
    still turns it off, as for every op."""
    with forced_platform(platform):
        with use_config(Config(custom_ops=["none"])):
            assert MMEncoderAttention(2, 64).forward_method_name == f"forward_{platform}"
        with use_config(Config(custom_ops=["all", "-mm_encoder_attn"])):
            assert MMEncoderAttention(2, 64).forward_method_name == "forward_native"


@pytest.mark.parametrize("platform", ["cuda", "xpu"])
def test_accelerator_forward_reaches_the_library_op(platform):
    """forward_cuda/forward_xpu on CPU tensors run the library op's reference (no device kernel
    for CPU tensors): the packing and the batch offsets it builds give the right result."""
    case, packing = BY_LABEL["mqa d80 4d"], Packing(2, (3, 1, 9))
    _, args, kwargs, expected = make(case, packing, torch.float32)
    with forced_platform(platform), use_config(Config(custom_ops=["+mm_encoder_attn"])):
        op = case.build()
        assert op.forward_method_name == f"forward_{platform}"
        assert_close(op(*args, **kwargs), expected, torch.float32)


# ---- bad inputs ---------------------------------------------------------------------------------


def _bad_calls():
    q, k = randn(1, 12, 4 * 64), randn(1, 12, 2 * 64)
    cu = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    yield "decreasing", ValueError, "must not decrease", (q, k, k), {"cu_seqlens": cu(0, 7, 5, 12)}
    yield "short", ValueError, "ends at 10, but the sequence has 12", (q, k, k), {"cu_seqlens": cu(0, 4, 10)}
    yield "long", ValueError, "ends at 13", (q, k, k), {"cu_seqlens": cu(0, 13)}
    yield "not from 0", ValueError, "must start at 0", (q, k, k), {"cu_seqlens": cu(2, 12)}
    yield "one entry", ValueError, "at least 2 entries", (q, k, k), {"cu_seqlens": cu(12)}
    yield "float cu", TypeError, "cu_seqlens must be an integer", (q, k, k), {"cu_seqlens": torch.tensor([0.0, 12.0])}
    yield "2-D cu", ValueError, "cu_seqlens must be 1-D", (q, k, k), {"cu_seqlens": cu(0, 12)[None]}
    yield "max too small", ValueError, "max_seqlen=5 but a segment has 7", (q, k, k), {"cu_seqlens": cu(0, 7, 12), "max_seqlen": 5}
    yield "max negative", ValueError, "max_seqlen must be a non-negative int", (q, k, k), {"cu_seqlens": cu(0, 12), "max_seqlen": -1}
    yield "key dtype", TypeError, "key has dtype torch.bfloat16, expected query's torch.float32", (q, k.bfloat16(), k), {}
    yield "value dtype", TypeError, "value has dtype torch.float16", (q, k, k.half()), {}
    yield "int query", TypeError, "query has dtype torch.int64", (q.long(), k.long(), k.long()), {}
    yield "query heads", ValueError, r"query has shape \(1, 12, 192\), expected \[batch, seq_len, 256\]", (randn(1, 12, 192), k, k), {}
    yield "kv heads", ValueError, "key has shape", (q, q, q), {}
    yield "4-D head size", ValueError, r"expected \[batch, seq_len, 4, 64\]", (randn(1, 12, 4, 32), k.view(1, 12, 2, 64), k.view(1, 12, 2, 64)), {}
    yield "mixed ranks", ValueError, "key has shape", (q.view(1, 12, 4, 64), k, k), {}
    yield "kv length", ValueError, r"key has \[batch, seq_len\] \(1, 11\)", (q, k[:, :11], k[:, :11]), {}
    yield "device", ValueError, "key is on meta", (q, k.to("meta"), k), {}
    yield "not a tensor", TypeError, "value must be a torch.Tensor", (q, k, None), {}


BAD = list(_bad_calls())


@pytest.mark.parametrize("what,error,match,args,kwargs", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_raise_the_same_clear_error_on_every_path(what, error, match, args, kwargs):
    op = MMEncoderAttention(4, 64, num_kv_heads=2)
    assert assert_same_error(op, args, error, f"customop.mm_encoder_attn: .*{match}", kwargs) == \
        ["forward_native", "forward_cpu", "forward_kernel"]


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match=r"num_heads \(6\) is not divisible by num_kv_heads \(4\)"):
        MMEncoderAttention(6, 64, num_kv_heads=4)
    with pytest.raises(ValueError, match="head_size must be a positive int"):
        MMEncoderAttention(4, 0)
    with pytest.raises(ValueError, match="num_kv_heads must be a positive int"):
        MMEncoderAttention(4, 64, num_kv_heads=0)


def test_library_op_checks_cu_seqlens_itself():
    q = randn(12, 2, 64)
    with pytest.raises(ValueError, match="must not decrease"):
        torch.ops.customop.mm_encoder_attn(q, q, q, torch.tensor([0, 9, 4, 12], dtype=torch.int32), 0, 0.125)
    with pytest.raises(ValueError, match="max_seqlen=4 but a segment has 8"):
        torch.ops.customop.mm_encoder_attn(q, q, q, torch.tensor([0, 4, 12], dtype=torch.int32), 4, 0.125)


# ---- torch.library: schema, opcheck, compile -----------------------------------------------------

SCHEMA = ("customop::mm_encoder_attn(Tensor query, Tensor key, Tensor value, Tensor cu_seqlens, "
          "int max_seqlen, float scale) -> Tensor")


def test_schema_is_the_backend_contract():
    assert str(torch.ops.customop.mm_encoder_attn.default._schema) == SCHEMA


def _opcheck_samples():
    cu = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    yield "mha fp32", (randn(20, 2, 64), randn(20, 2, 64), randn(20, 2, 64), cu(0, 1, 8, 20), 12, 0.125)
    yield "gqa bf16 unknown max", tuple(randn(9, h, 80, dtype=torch.bfloat16) for h in (4, 1, 1)) + (cu(0, 0, 9), 0, 0.1)
    yield "strided q", (randn(20, 6, 64)[:, ::2], randn(20, 3, 64), randn(20, 3, 64), cu(0, 20), 20, 0.125)


@pytest.mark.parametrize("name,args", list(_opcheck_samples()), ids=lambda v: v if isinstance(v, str) else None)
def test_opcheck(name, args):
    torch.library.opcheck(torch.ops.customop.mm_encoder_attn.default, args)


@pytest.mark.parametrize("max_seqlen", [20, None, torch.tensor(20)], ids=["int", "none", "tensor"])
@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_compiles_fullgraph_without_graph_break(platform, max_seqlen):
    """One graph per path whatever form max_seqlen takes: the CPU path and the kernel path hand the
    segment lengths to the opaque library op instead of reading them in the graph."""
    counter = torch._dynamo.testing.CompileCounter()
    with forced_platform(platform), use_config(Config(custom_ops=["+mm_encoder_attn"])):
        op = MMEncoderAttention(4, 64, num_kv_heads=2)
    assert op.forward_method_name == f"forward_{platform}"
    q, k, v = randn(1, 27, 256), randn(1, 27, 128), randn(1, 27, 128)
    cu = torch.tensor([0, 7, 27], dtype=torch.int32)
    expected = op.forward_native(q, k, v, cu)
    with torch._dynamo.config.patch(recompile_limit=64):
        got = torch.compile(lambda *a: op(*a, cu_seqlens=cu, max_seqlen=max_seqlen) * 2, backend=counter,
                            fullgraph=True)(q, k, v)
    assert_close(got, expected * 2, torch.float32)
    assert counter.frame_count == 1 and counter.op_count > 0


def test_library_op_under_inductor():
    q, k = randn(1, 15, 128), randn(1, 15, 64)
    op = MMEncoderAttention(2, 64, num_kv_heads=1)
    cu = torch.tensor([0, 1, 15], dtype=torch.int32)
    got = torch.compile(lambda q, k: op.forward_kernel(q, k, k, cu, 14) + 1, fullgraph=True)(q, k)
    assert_close(got, op.forward_native(q, k, k, cu) + 1, torch.float32)


# ---- conformance ---------------------------------------------------------------------------------


def test_conforms():
    assert_conforms(MMEncoderAttention)


# ---- the out-of-tree example ---------------------------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "oot_mm_encoder_attn.py")

#: runs the example's main, then shows assert_conforms refuses the example's replacement with the
#: scale dropped (one subprocess: the example registers its replacement for the whole process)
_SCRIPT = textwrap.dedent("""
    import runpy, sys
    from customop import CustomOp
    from customop.testing import assert_conforms
    example = runpy.run_path(sys.argv[1])
    assert example["main"]() == 0
    Padded = example["PaddedMMEncoderAttention"]

    @CustomOp.register_oot("MMEncoderAttention", override=True)
    class Unscaled(Padded):
        def forward_oot(self, *args, **kwargs):
            self.scale, kept = 1.0, self.scale
            try:
                return super().forward_oot(*args, **kwargs)
            finally:
                self.scale = kept

    try:
        assert_conforms(Unscaled, platform=example["NpuPlatform"]())
    except AssertionError as err:
        print("REFUSED", str(err).count("\\n"))
""")


def test_out_of_tree_example_conforms_and_the_check_refuses_a_wrong_replacement():
    result = subprocess.run([sys.executable, "-c", _SCRIPT, EXAMPLE], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "built PaddedMMEncoderAttention, running forward_oot" in result.stdout
    assert "conforms to mm_encoder_attn on every sample and dtype" in result.stdout
    assert "REFUSED" in result.stdout and int(result.stdout.split("REFUSED")[1]) > 10
