"""The TPU grouped-matmul kernel and the MoE experts (``backends/tpu/moe.py``) and the ``xla`` kernel
of ``customop::fused_experts`` (``xla_moe.py``).

Main tier (jax only): ``gmm`` in Pallas interpret mode against float64 (row tiles straddling
groups, empty groups, rows in no group, padded K and N), the visit bookkeeping, ``fused_experts``
against the float64 reference of the MoE table (``tests/cases/moe.py``: activations, biases, odd
sizes, an expert map with an id of -1, the router weight on the input), TPU lowering, bad
arguments. tpu tier (``@pytest.mark.xla``): the op on XLA tensors, ``FusedMoE.forward_tpu`` end to
end (routing by the reference body on XLA), fp64 on the spec, ``opcheck``, openxla compile.
Emulation only: nothing here has run on a TPU (``tpu_hw`` tests skip without one).
"""

from __future__ import annotations

import functools
import inspect
import zlib

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import export as jax_export  # noqa: E402

import customop  # noqa: E402
from customop.backends import tpu  # noqa: E402
from customop.backends.tpu import moe as tpu_moe  # noqa: E402
from customop.samples.moe import LAYERS_BY_LABEL, routed_inputs  # noqa: E402
from customop.testing import assert_close, forced_platform, randn  # noqa: E402
from tests.cases import moe as ref  # noqa: E402

JAX_DTYPES = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16}


def gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def to_jax(t: torch.Tensor | None):
    if t is None:
        return None
    t = t.detach()
    if t.is_floating_point():
        return jnp.asarray(t.float().numpy(), dtype=JAX_DTYPES[t.dtype])
    return jnp.asarray(t.numpy().astype(np.int32))


def to_torch(a, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.array(a.astype(jnp.float32))).to(dtype)


def build(label: str, dtype: torch.dtype, **kwargs):
    """The table's layer with random weights (enabled; the caller's platform decides its path)."""
    case = LAYERS_BY_LABEL[label]
    with customop.use_config(customop.Config(custom_ops=["all"])):
        layer = case.build(dtype, **kwargs)
    with torch.no_grad():
        for name, value in case.weights(layer, generator=gen(label, str(dtype))).items():
            getattr(layer, name).copy_(value)
    return case, layer


# ---- gmm ---------------------------------------------------------------------------------------------


def test_group_metadata():
    """Visits: one per (row tile, group) pair a group touches, in order; empty groups get none;
    surplus visits repeat the last real one."""
    starts, ends, group_of, tile_of, total = tpu_moe.group_metadata(jnp.array([0, 130, 1, 100, 50]), 384, 128)
    assert starts.tolist() == [0, 0, 130, 131, 231] and ends.tolist() == [0, 130, 131, 231, 281]
    # group 1: tiles 0-1; group 2: tile 1; group 3: tiles 1-1; group 4: tiles 1-2
    assert int(total[0]) == 6
    assert group_of.tolist() == [1, 1, 2, 3, 4, 4, 4]
    assert tile_of.tolist() == [0, 1, 1, 1, 1, 2, 2]
    _, _, _, tile_of, total = tpu_moe.group_metadata(jnp.zeros((3,), jnp.int32), 128, 128)
    assert int(total[0]) == 0 and tile_of.tolist() == [0, 0, 0]


@pytest.mark.parametrize("rows,depth,cols,sizes,dtype", [
    (300, 200, 136, (0, 130, 1, 100, 50), torch.float32),  # 3 row tiles, padded K and N, rows in no group
    (14, 40, 48, (2, 0, 3, 4, 0, 1, 2, 1), torch.bfloat16),  # one tile shared by six groups
], ids=["fp32-3-tiles", "bf16-one-tile"])
def test_gmm_vs_float64(rows, depth, cols, sizes, dtype):
    g = gen("gmm", rows, depth)
    lhs, rhs = randn(rows, depth, dtype=dtype, generator=g), randn(len(sizes), cols, depth, dtype=dtype, generator=g)
    out = tpu.gmm(to_jax(lhs), to_jax(rhs), jnp.array(sizes, jnp.int32), jnp.float32, interpret=True)
    assert out.shape == (rows, cols) and out.dtype == jnp.float32
    expected = torch.zeros(rows, cols, dtype=torch.float64)
    start = 0
    for group, size in enumerate(sizes):
        expected[start:start + size] = lhs[start:start + size].double() @ rhs[group].double().T
        start += size
    assert_close(to_torch(out, torch.float32)[:start], expected[:start], torch.float32, atol=1e-5, rtol=1e-5)


# ---- fused_experts vs float64 ----------------------------------------------------------------------

# (table label, dtype, tokens): each compiles two gmm calls in interpret mode (seconds)
EXPERT_CASES = [
    pytest.param("gelu_tanh E5 k2 H48 I33", torch.bfloat16, 7, id="odd-I-gelu_tanh-bf16-T7"),
    pytest.param("swigluoai E4 k2 H64 I48 bias", torch.float32, 33, id="swigluoai-bias-fp32-T33",  # interleaved
                 marks=pytest.mark.slow),
    pytest.param("ep3 rank0 round_robin E7 k3", torch.float16, 7, id="expert-map-fp16-T7",  # + an id of -1
                 marks=pytest.mark.slow),
    pytest.param("on-input E5 k1 H64 I32", torch.float32, 1, id="on-input-fp32-T1", marks=pytest.mark.slow),
]


def run_experts(layer, x, w, ids, interpret=True):
    return tpu.fused_experts(to_jax(x), to_jax(layer.w13_weight), to_jax(layer.w2_weight), to_jax(w), to_jax(ids),
                             to_jax(layer.expert_map), to_jax(layer.w13_bias), to_jax(layer.w2_bias),
                             activation=layer.activation, alpha=layer.alpha, limit=layer.limit, beta=layer.beta,
                             apply_router_weight_on_input=layer.apply_router_weight_on_input, interpret=interpret)


@pytest.mark.parametrize("label,dtype,tokens", EXPERT_CASES)
def test_fused_experts_vs_float64(label, dtype, tokens):
    case, layer = build(label, dtype)
    x, w, ids = routed_inputs(layer, case, tokens, dtype, generator=gen(label, tokens))
    if tokens > 1:
        ids[1, 0] = -1  # "no expert": adds nothing
    out = run_experts(layer, x, w, ids)
    assert out.dtype == JAX_DTYPES[dtype] and out.shape == (tokens, case.hidden)
    ref.assert_layer(label, to_torch(out, dtype), ref.experts(layer, x, w, ids), dtype)


def test_no_tokens():
    _, layer = build("silu E6 k3 H40 I24", torch.float32)
    out = run_experts(layer, torch.zeros(0, 40), torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.int32))
    assert out.shape == (0, 40)


def test_bad_arguments_name_the_kernel():
    with pytest.raises(ValueError, match="gmm: lhs"):
        tpu.gmm(jnp.zeros((4, 8)), jnp.zeros((2, 16, 9)), jnp.array([2, 2]))
    with pytest.raises(TypeError, match="gmm: lhs is"):
        tpu.gmm(jnp.zeros((4, 8)), jnp.zeros((2, 16, 8), jnp.bfloat16), jnp.array([2, 2]))
    with pytest.raises(ValueError, match="activation must be one of"):
        tpu.fused_experts(jnp.zeros((1, 8)), jnp.zeros((2, 8, 8)), jnp.zeros((2, 8, 4)), jnp.ones((1, 1)),
                          jnp.zeros((1, 1), jnp.int32), activation="relu")


# ---- lowering for TPU (Mosaic) ---------------------------------------------------------------------


def S(shape, dtype=jnp.float32):  # noqa: N802
    return jax.ShapeDtypeStruct(shape, dtype)


def test_gmm_lowers_to_mosaic():
    fn = functools.partial(tpu.gmm, out_dtype=jnp.float32, interpret=False)
    text = jax_export.export(jax.jit(fn), platforms=["tpu"])(S((300, 200)), S((5, 136, 200)),
                                                             S((5,), jnp.int32)).mlir_module()
    assert "tpu_custom_call" in text


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter,bias", [
    (64, 8, 2, 4096, 1024, False),  # Mixtral-like rows (narrower I), bf16
    (7, 128, 8, 2048, 768, True),   # Qwen3-30B-A3B decode, with biases
], ids=["mixtral-like", "qwen3-decode-bias"])
def test_fused_experts_lowers_to_mosaic(tokens, experts, top_k, hidden, inter, bias):
    bf16 = jnp.bfloat16
    fn = functools.partial(tpu.fused_experts, interpret=False)
    args = [S((tokens, hidden), bf16), S((experts, 2 * inter, hidden), bf16), S((experts, hidden, inter), bf16),
            S((tokens, top_k)), S((tokens, top_k), jnp.int32), None]
    if bias:
        args += [S((experts, 2 * inter), bf16), S((experts, hidden), bf16)]
    text = jax_export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()
    assert text.count("tpu_custom_call") >= 2  # both GEMMs are Mosaic calls


@pytest.mark.tpu_hw
def test_runs_on_a_real_tpu():
    """Compiled by Mosaic and run (never run so far: no TPU was available)."""
    if jax.default_backend() != "tpu":
        pytest.skip("needs a real TPU")
    label = "gelu_tanh E5 k2 H48 I33"
    case, layer = build(label, torch.bfloat16)
    x, w, ids = routed_inputs(layer, case, 33, torch.bfloat16, generator=gen(label, "hw"))
    out = run_experts(layer, x, w, ids, interpret=False)
    ref.assert_layer(label, to_torch(out, torch.bfloat16), ref.experts(layer, x, w, ids), torch.bfloat16)


# ---- the xla kernel and forward_tpu (tpu tier) -----------------------------------------------------


def test_xla_kernel_takes_the_schema_arguments():
    from customop.backends.tpu import xla_moe

    schema = torch.ops.customop.fused_experts.default._schema
    assert list(inspect.signature(xla_moe.fused_experts).parameters) == [a.name for a in schema.arguments]


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


def op_args(layer, x, w, ids, device):
    """The library op's arguments, as FusedMoE passes them, on ``device``."""
    extra = tuple(t.detach().to(device) if isinstance(t, torch.Tensor) else t for t in layer.experts_args())
    return (x.to(device), layer.w13_weight.detach().to(device), layer.w2_weight.detach().to(device),
            w.float().to(device), ids.to(torch.int32).to(device), *extra)


@pytest.mark.xla
@pytest.mark.parametrize("label,dtype", [("silu E6 k3 H40 I24", torch.bfloat16), ("ep2 rank1 E8 k2", torch.float32)],
                         ids=["silu-bf16", "expert-map-fp32"])
def test_op_on_xla_vs_float64(label, dtype, dev, pallas_calls):
    case, layer = build(label, dtype)
    x, w, ids = routed_inputs(layer, case, 7, dtype, generator=gen(label, "xla"))
    out = torch.ops.customop.fused_experts(*op_args(layer, x, w, ids, dev))
    assert pallas_calls == ["fused_experts"] and out.device.type == "xla"
    ref.assert_layer(label, out.cpu(), ref.experts(layer, x, w, ids), dtype)


@pytest.mark.xla
def test_fp64_runs_the_spec_on_xla(dev, pallas_calls):
    case, layer = build("silu E6 k3 H40 I24", torch.float64)
    x, w, ids = routed_inputs(layer, case, 5, torch.float64, generator=gen("fp64"))
    out = torch.ops.customop.fused_experts(*op_args(layer, x, w, ids, dev))
    assert pallas_calls == []
    assert_close(out.cpu(), ref.experts(layer, x, w, ids), torch.float32)


@pytest.mark.xla
@pytest.mark.parametrize("label,dtype", [("grouped E8 k2 g4 tg2 bias x2.5", torch.float32),
                                         ("silu E8 k2 H96 I64", torch.bfloat16)], ids=["grouped-fp32", "silu-bf16"])
def test_fused_moe_forward_tpu_end_to_end(label, dtype, dev, pallas_calls):
    """FusedMoE built on the TPU platform: routing (the routing ops' reference bodies on XLA) and
    the experts' xla kernel, against the float64 layer output."""
    with forced_platform("tpu"):
        case, layer = build(label, dtype)
    assert layer.forward_method_name == "forward_tpu"
    x, logits = case.inputs(7, dtype, generator=gen(label, "e2e"))
    expected = ref.layer_output(layer, x, logits)
    layer.to(dev)
    with torch.no_grad():
        out = layer(x.to(dev), logits.to(dev))
    assert "fused_experts" in pallas_calls
    ref.assert_layer(label, out.cpu(), expected, dtype)


@pytest.mark.xla
@pytest.mark.slow
def test_opcheck_and_openxla_compile(dev, pallas_calls):
    label = "swigluoai E4 k2 H64 I48 bias"
    case, layer = build(label, torch.float32)
    x, w, ids = routed_inputs(layer, case, 5, torch.float32, generator=gen(label, "opcheck"))
    args = op_args(layer, x, w, ids, dev)
    torch.library.opcheck(torch.ops.customop.fused_experts.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    compiled = torch.compile(lambda *a: torch.ops.customop.fused_experts(*a) + 1, backend="openxla", fullgraph=True)
    ref.assert_layer(label, compiled(*args).cpu() - 1, ref.experts(layer, x, w, ids), torch.float32)
    assert "fused_experts" in pallas_calls
