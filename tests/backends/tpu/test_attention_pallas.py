"""The TPU flash-attention kernel with segment ids (``backends/tpu/attention.py``) and the ``xla``
kernel of ``customop::mm_encoder_attn`` (``xla_attention.py``).

Main tier (jax only): the kernel in Pallas interpret mode against the float64 reference
(``tests/cases/attention.py``) on small packings (every head size, GQA and MQA, empty and length-1
segments, 64 segments, several blocks with block skipping), its TPU lowering, bad arguments.
tpu tier (``@pytest.mark.xla``, torch_xla on the XLA CPU device): the op on XLA tensors, the op
class's ``forward_tpu`` end to end, ``opcheck``, openxla compile. Emulation only: nothing here has
run on a TPU (``tpu_hw`` tests skip without one).
"""

from __future__ import annotations

import functools
import inspect

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import export as jax_export  # noqa: E402

from customop.backends import tpu  # noqa: E402
from customop.backends.tpu import attention as tpu_attention  # noqa: E402
from customop.samples.attention import BY_LABEL, Packing  # noqa: E402
from customop.testing import assert_close, forced_platform, randn  # noqa: E402
from tests.cases.attention import ref_packed, reference  # noqa: E402

JAX_DTYPES = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16}
_MANY = tuple(1 + i % 3 for i in range(64))


def to_jax(t: torch.Tensor):
    return jnp.asarray(t.float().numpy(), dtype=JAX_DTYPES.get(t.dtype, jnp.int32) if t.is_floating_point()
                       else jnp.int32)


def to_torch(a, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.array(a.astype(jnp.float32))).to(dtype)


def packed_inputs(lengths, heads, kv_heads, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = randn(total, heads, head_dim, dtype=dtype, scale=2.0, generator=g)
    k = randn(total, kv_heads, head_dim, dtype=dtype, scale=2.0, generator=g)
    v = randn(total, kv_heads, head_dim, dtype=dtype, generator=g)
    cu = torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32)
    return q, k, v, cu


# ---- the kernel in interpret mode vs float64 ---------------------------------------------------------

# (lengths, Hq, Hkv, D, dtype, block): each compiles once in interpret mode (seconds), so one row
# per property rather than a product
KERNEL_CASES = {
    "mha d64 fp32 mixed with empty": ((1, 7, 0, 33, 20), 4, 4, 64, torch.float32, None),
    "gqa d72 bf16 one token": ((1,), 4, 2, 72, torch.bfloat16, None),
    "mqa d80 fp16 64 segments": (_MANY, 4, 1, 80, torch.float16, None),
    "gqa d96 fp32 blocks of 128": ((100, 3, 196, 1, 0), 6, 2, 96, torch.float32, 128),
    "mha d128 bf16 one segment 2 blocks": ((150,), 2, 2, 128, torch.bfloat16, 128),
}
_QUICK = ("mha d64 fp32 mixed with empty", "gqa d96 fp32 blocks of 128")


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c in _QUICK else pytest.mark.slow)
                                  for c in KERNEL_CASES])
def test_kernel_vs_float64(case):
    lengths, heads, kv_heads, head_dim, dtype, block = KERNEL_CASES[case]
    q, k, v, cu = packed_inputs(lengths, heads, kv_heads, head_dim, dtype)
    scale = 0.05 if head_dim == 96 else head_dim ** -0.5
    out = tpu.varlen_attention(to_jax(q), to_jax(k), to_jax(v), to_jax(cu), scale, block_q=block, block_k=block,
                               interpret=True)
    assert out.dtype == JAX_DTYPES[dtype] and out.shape == q.shape
    actual = to_torch(out, dtype)
    assert not actual.isnan().any()
    assert_close(actual, ref_packed(q, k, v, list(lengths), scale), dtype, what=case)


def test_block_skipping_ranges():
    """Each query block visits only the key blocks that hold keys of its segments."""
    cu = jnp.array([0, 100, 103, 299, 300], jnp.int32)
    ids, bounds = tpu_attention.segment_ids(cu, 300, 384)
    assert ids[0] == 0 and ids[100] == 1 and ids[103] == 2 and ids[299] == 3 and ids[300] == 4 and ids[383] == 4
    lo, hi = tpu_attention.key_block_ranges(ids, bounds, 128, 128)
    # query block 0 holds segments 0-2 (keys 0..298: blocks 0-2); block 1 and 2 hold segment 2 (and 3, 4)
    assert lo.tolist() == [0, 0, 0] and hi.tolist() == [2, 2, 2]
    cu = jnp.array([0, 128, 256, 384], jnp.int32)  # one segment per block: the diagonal only
    lo, hi = tpu_attention.key_block_ranges(*tpu_attention.segment_ids(cu, 384, 384), 128, 128)
    assert lo.tolist() == [0, 1, 2] and hi.tolist() == [0, 1, 2]


def test_malformed_cu_seqlens_stays_in_range():
    """A decreasing ``cu_seqlens`` (which only the host checks reject) gives wrong rows, never a
    NaN or a block index outside the arrays."""
    q, k, v, _ = packed_inputs((20,), 2, 2, 64, torch.float32)
    out = tpu.varlen_attention(to_jax(q), to_jax(k), to_jax(v), jnp.array([0, 15, 5, 40], jnp.int32), interpret=True)
    assert np.isfinite(np.asarray(out)).all()


def test_empty_sequence():
    q = jnp.zeros((0, 2, 64))
    assert tpu.varlen_attention(q, q, q, jnp.zeros((2,), jnp.int32), interpret=True).shape == (0, 2, 64)


def test_bad_arguments_name_the_kernel():
    q, k = jnp.zeros((8, 4, 64)), jnp.zeros((8, 3, 64))
    with pytest.raises(ValueError, match="varlen_attention: query"):
        tpu.varlen_attention(q, k, k, jnp.array([0, 8]))
    with pytest.raises(ValueError, match="varlen_attention: block_q=100"):
        tpu.varlen_attention(q, q, q, jnp.array([0, 8]), block_q=100, interpret=True)
    with pytest.raises(TypeError, match="one dtype"):
        tpu.varlen_attention(q, q.astype(jnp.bfloat16), q, jnp.array([0, 8]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        tpu.varlen_attention(q, q, q, jnp.array([0.0, 8.0]))


# ---- lowering for TPU (Mosaic) ---------------------------------------------------------------------


def S(shape, dtype=jnp.float32):  # noqa: N802
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("total,heads,kv_heads,head_dim,dtype,block", [
    (61, 4, 2, 72, jnp.float32, None),       # one block, padded head dim
    (1024, 16, 16, 80, jnp.bfloat16, None),  # ViT head, 8 x 8 blocks
    (700, 16, 4, 128, jnp.bfloat16, 256),    # GQA, wider blocks
], ids=["short-d72-fp32", "vit-16x80-bf16", "gqa-d128-block256"])
def test_lowers_to_mosaic(total, heads, kv_heads, head_dim, dtype, block):
    fn = functools.partial(tpu.varlen_attention, scale=0.1, block_q=block, block_k=block, interpret=False)
    exported = jax_export.export(jax.jit(fn), platforms=["tpu"])(
        S((total, heads, head_dim), dtype), S((total, kv_heads, head_dim), dtype),
        S((total, kv_heads, head_dim), dtype), S((9,), jnp.int32))
    assert "tpu_custom_call" in exported.mlir_module()


@pytest.mark.tpu_hw
def test_runs_on_a_real_tpu():
    """Compiled by Mosaic and run (never run so far: no TPU was available)."""
    if jax.default_backend() != "tpu":
        pytest.skip("needs a real TPU")
    q, k, v, cu = packed_inputs((100, 3, 196, 1), 16, 4, 80, torch.bfloat16)
    out = tpu.varlen_attention(to_jax(q), to_jax(k), to_jax(v), to_jax(cu), interpret=False)
    assert_close(to_torch(out, torch.bfloat16), ref_packed(q, k, v, [100, 3, 196, 1], 80 ** -0.5), torch.bfloat16)


# ---- the xla kernel and forward_tpu (tpu tier) -----------------------------------------------------


def test_xla_kernel_takes_the_schema_arguments():
    from customop.backends.tpu import xla_attention

    schema = torch.ops.customop.mm_encoder_attn.default._schema
    assert [p for p in inspect.signature(xla_attention.mm_encoder_attn).parameters] == \
        [a.name for a in schema.arguments]


@pytest.fixture(scope="module")
def dev():
    torch_xla = pytest.importorskip("torch_xla")
    pytest.importorskip("torchax")
    return torch_xla.device()


@pytest.fixture
def pallas_calls(monkeypatch):
    from customop.backends.tpu import xla_kernels

    seen = []
    real = xla_kernels._jax

    def counted(fn, *args, **statics):
        seen.append(fn.__qualname__)
        return real(fn, *args, **statics)

    monkeypatch.setattr(xla_kernels, "_jax", counted)
    return seen


@pytest.mark.xla
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("max_seqlen", [0, 33], ids=["unknown", "given"])
def test_op_on_xla_vs_float64(dtype, max_seqlen, dev, pallas_calls):
    lengths = (1, 7, 0, 33, 20)
    q, k, v, cu = packed_inputs(lengths, 4, 2, 72, dtype, seed=3)
    out = torch.ops.customop.mm_encoder_attn(q.to(dev), k.to(dev), v.to(dev), cu.to(dev), max_seqlen, 0.1)
    assert pallas_calls == ["varlen_attention"]
    assert out.device.type == "xla" and out.dtype == dtype
    assert_close(out.cpu(), ref_packed(q, k, v, list(lengths), 0.1), dtype)


@pytest.mark.xla
def test_bad_cu_seqlens_on_xla_raises_like_the_reference(dev):
    q, k, v, _ = packed_inputs((8,), 2, 2, 64, torch.float32)
    bad = torch.tensor([0, 5, 3, 8], dtype=torch.int32)
    for device in ("cpu", dev):
        with pytest.raises(ValueError, match=r"cu_seqlens must not decrease"):
            torch.ops.customop.mm_encoder_attn(q.to(device), k.to(device), v.to(device), bad.to(device), 0, 0.1)


@pytest.mark.xla
def test_fp64_runs_the_spec_on_xla(dev, pallas_calls):
    q, k, v, cu = packed_inputs((3, 5), 2, 1, 64, torch.float64)
    out = torch.ops.customop.mm_encoder_attn(q.to(dev), k.to(dev), v.to(dev), cu.to(dev), 5, 0.125)
    assert pallas_calls == []
    assert_close(out.cpu(), ref_packed(q, k, v, [3, 5], 0.125), torch.float32)


@pytest.mark.xla
@pytest.mark.parametrize("label,packing", [("mqa d80 4d", Packing(1, (1, 7, 0, 33, 20))),
                                           ("mha d64", Packing(2, None, 9))], ids=["mqa-d80-segments", "mha-rows"])
def test_forward_tpu_end_to_end(label, packing, dev, pallas_calls):
    """The op class built on the TPU platform runs forward_tpu -> the xla kernel (cu_seqlens on
    the device, max_seqlen a 0-d CPU tensor as vLLM passes it)."""
    import customop

    case = BY_LABEL[label]
    with forced_platform("tpu"), customop.use_config(customop.Config(custom_ops=["all"])):
        op = case.build()
    assert op.forward_method_name == "forward_tpu"
    q, k, v = case.inputs(packing, torch.bfloat16, generator=torch.Generator().manual_seed(5))
    kwargs = {}
    if packing.lengths is not None:
        kwargs = {"cu_seqlens": packing.cu_seqlens(dev), "max_seqlen": torch.tensor(packing.max_seqlen)}
    with torch.no_grad():
        out = op(q.to(dev), k.to(dev), v.to(dev), **kwargs)
    assert pallas_calls == ["varlen_attention"]
    assert_close(out.cpu(), reference(case, op, packing, q, k, v), torch.bfloat16)


@pytest.mark.xla
@pytest.mark.slow
def test_opcheck_and_openxla_compile(dev, pallas_calls):
    q, k, v, cu = packed_inputs((3, 9, 4), 4, 2, 64, torch.float32, seed=7)
    args = (q.to(dev), k.to(dev), v.to(dev), cu.to(dev), 9, 0.125)
    torch.library.opcheck(torch.ops.customop.mm_encoder_attn.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    compiled = torch.compile(lambda *a: torch.ops.customop.mm_encoder_attn(*a) * 2, backend="openxla",
                             fullgraph=True)
    assert_close(compiled(*args).cpu(), ref_packed(q, k, v, [3, 9, 4], 0.125) * 2, torch.float32)
    assert "varlen_attention" in pallas_calls
