"""The Pallas kernels in interpret mode on the CPU. Needs only jax: runs in the main tier (and in
the tpu tier).

1. The case tables (``customop/samples/<family>.py``, their ``"tpu"`` sizes): every row whose
   ``customop::`` op has an ``xla`` kernel (``xla_kernels.KERNELS``) runs through that kernel, as
   ``forward_kernel`` calls it, on CPU tensors: ``call_jax`` (torch_xla's bridge) is replaced by
   a CPU one that hands the tensors to the same JAX functions as arrays. Judged by the float64
   references of ``tests/cases``. A new row, or a new op given an ``xla`` kernel, is tested here
   with no edit of this file.
2. What only the JAX API reaches: multi-step grids with a partial last block (``block_rows=8``
   on 20 rows; the tables' sizes fit one block), the variance over the first lanes, the inverse
   rotation, the gated activation kernel for JAX users, the quant bounds as arguments and ue8m0's
   exact rounding, empty inputs and the interpret decision. Also judged by ``tests/cases``.

Shapes are small: interpret mode runs one grid step at a time, ~0.3 s of compile per new shape.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from customop.backends import tpu  # noqa: E402
from customop.backends.tpu import xla_kernels  # noqa: E402
from customop.math import quant as qm  # noqa: E402
from customop.math.fp8 import fp8_max  # noqa: E402
from customop.samples import activation as act_table  # noqa: E402
from customop.samples import quant as quant_table  # noqa: E402
from customop.samples import rotary as rope_table  # noqa: E402
from customop.testing import assert_close  # noqa: E402
from tests.backends import kernel_cases  # noqa: E402
from tests.cases import activation as act_ref  # noqa: E402
from tests.cases import layernorm as norm_ref  # noqa: E402
from tests.cases import quant as quant_ref  # noqa: E402
from tests.cases import rotary as rope_ref  # noqa: E402

#: the xla kernels that are Pallas or JAX code (fp32 inside, one rounding); the others are the
#: op's spec, functionalized, and round where it does
COMPUTED = set(xla_kernels.KERNELS) - set(getattr(xla_kernels, "GATED_ACTIVATIONS", ()))
FP8 = torch.float8_e4m3fn
_FP8_TORCH = {jnp.dtype(jnp.float8_e4m3fn): torch.float8_e4m3fn, jnp.dtype(jnp.float8_e5m2): torch.float8_e5m2}


def to_jax(t):
    """A CPU tensor as a jax array of the same dtype and values (None and Python values pass)."""
    if not isinstance(t, torch.Tensor):
        return t
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return jnp.asarray(t.float().numpy()).astype(jnp.bfloat16)  # exact: bf16 widens to fp32
    return jnp.asarray(t.numpy())


def to_torch(a):
    if a is None:
        return None
    if a.dtype == jnp.bfloat16:
        return torch.from_numpy(np.array(a.astype(jnp.float32))).to(torch.bfloat16)
    if a.dtype in _FP8_TORCH:
        return torch.from_numpy(np.asarray(a).view(np.uint8).copy()).view(_FP8_TORCH[a.dtype])
    return torch.from_numpy(np.array(a))


def _static(v):
    """A torch dtype among the static arguments as JAX's (``call_jax`` converts them too)."""
    return jnp.dtype(str(v).removeprefix("torch.")) if isinstance(v, torch.dtype) else v


def call_jax_on_cpu(fn, args, statics, override_hash=None):
    """``torch_xla``'s ``call_jax`` for CPU tensors: the JAX function on arrays, the results back."""
    statics = {k: _static(v) for k, v in statics.items()}
    return jax.tree_util.tree_map(to_torch, fn(*map(to_jax, args), **statics))


@pytest.fixture
def jax_bridge_on_cpu(monkeypatch):
    monkeypatch.setattr(xla_kernels, "_call_jax", lambda: call_jax_on_cpu)


# ---- 1. the case tables through the xla kernels ----------------------------------------------------

TABLE = kernel_cases.params("tpu", lambda row: row.library_op in xla_kernels.KERNELS and row.distinct_kernel_call,
                            dtypes=(torch.float32, torch.bfloat16, torch.float16))


@pytest.mark.parametrize("row,dtype", TABLE)
def test_table_row_through_xla_kernel(row, dtype, jax_bridge_on_cpu, poison_empty):
    op, args, kwargs = kernel_cases.make(row, dtype)
    ref_op, before = kernel_cases.snapshot(op, args)
    with kernel_cases.as_cpu_kernel(row.library_op, xla_kernels.KERNELS[row.library_op]) as calls, torch.no_grad():
        out = op.forward_kernel(*args, **kwargs)
    assert calls, "forward_kernel did not reach the xla kernel"
    kernel_cases.judge(row, ref_op, before, out, dtype, spec_rounding=row.library_op not in COMPUTED,
                       exact_fp8=False)


# ---- 2. the JAX API: row blocks and what the torch ops do not pass ---------------------------------

ROWS, BLOCK = 20, 8  # three grid steps, the last one partial


def _x(shape, dtype, seed, scale=1.0, offset=0.0):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale + offset).to(dtype)


def _run(fn, *args, **kwargs):
    """``fn`` on the tensors as arrays, in interpret mode; the results as tensors."""
    kwargs = {k: to_jax(v) for k, v in kwargs.items()}
    return jax.tree_util.tree_map(to_torch, fn(*map(to_jax, args), **kwargs, interpret=True))


@pytest.mark.parametrize("residual,weight,dtype", [(False, "x", torch.bfloat16), (True, "fp32", torch.float32),
                                                   (True, None, torch.bfloat16)], ids=str)
def test_rms_norm_row_blocks(residual, weight, dtype):
    x, r = _x((ROWS, 256), dtype, 0, 2.0), _x((ROWS, 256), dtype, 1, 2.0)
    w = None if weight is None else _x((256,), dtype if weight == "x" else torch.float32, 2, 0.5, 1.0)
    if residual:
        y, h = _run(tpu.rms_norm, x, w, 1e-6, residual=r, block_rows=BLOCK)
        norm_ref.assert_matches((y, h), norm_ref.ref_fused_add(x, r, w, 1e-6), dtype, what="fused add")
    else:
        y = _run(tpu.rms_norm, x, w, 1e-6, block_rows=BLOCK)
        norm_ref.assert_matches(y, (norm_ref.ref_rms_norm(x, w, 1e-6), None), dtype, what="rms_norm")


def test_rms_norm_variance_over_first_lanes_and_3d():
    """``variance_size`` (the torch op runs the spec for it) and leading dims."""
    x, w = _x((3, 5, 256), torch.float32, 3), _x((256,), torch.float32, 4)
    y = _run(tpu.rms_norm, x, w, 1e-5, variance_size=100)
    assert_close(y, norm_ref.ref_rms_norm(x, w, 1e-5, var_size=100), torch.float32)


@pytest.mark.parametrize("residual,dtype", [(True, torch.bfloat16)], ids=str)
def test_gemma_rms_norm_row_blocks(residual, dtype):
    x, r, w = _x((ROWS, 512), dtype, 0, 2.0), _x((ROWS, 512), dtype, 1, 2.0), _x((512,), torch.float32, 2, 0.1)
    if residual:
        got = _run(tpu.gemma_rms_norm, x, w, 1e-6, residual=r, block_rows=BLOCK)
        norm_ref.assert_matches(tuple(got), norm_ref.ref_fused_add(x, r, w, 1e-6, gemma=True), dtype, what="gemma")
    else:
        got = _run(tpu.gemma_rms_norm, x, w, 1e-6, block_rows=BLOCK)
        norm_ref.assert_matches(got, (norm_ref.ref_gemma(x, w, 1e-6), None), dtype, what="gemma")


@pytest.mark.parametrize("group,norm_before_gate,activation,gated,dtype",
                         [(None, False, "swish", True, torch.float32), (128, True, "sigmoid", True, torch.bfloat16),
                          (256, False, "silu", False, torch.float32)], ids=str)
def test_rms_norm_gated_row_blocks(group, norm_before_gate, activation, gated, dtype):
    x, w = _x((ROWS, 512), dtype, 0), _x((512,), torch.float32, 1)
    z = _x((ROWS, 512), dtype, 2) if gated else None
    y = _run(tpu.rms_norm_gated, x, w, z, 1e-5, group_size=group, norm_before_gate=norm_before_gate,
             activation=activation, block_rows=BLOCK)
    expected = norm_ref.ref_gated(x, w, z, 1e-5, group or 512, norm_before_gate, activation == "sigmoid")
    assert_close(y, expected, dtype)


@pytest.mark.parametrize("is_neox,dtype", [(True, torch.float32), (False, torch.bfloat16)], ids=str)
def test_rotary_row_blocks_and_inverse(is_neox, dtype):
    """20 tokens in blocks of 8, heads of 64 rotating 32 lanes; then the inverse rotation (the
    backward) undoes it."""
    case = rope_table.RopeCase("blocks", ROWS, 2, 1, 64, 32)
    op = case.build(is_neox, dtype, max_pos=128)
    positions, q, k = case.inputs(dtype, generator=torch.Generator().manual_seed(5), max_pos=128)
    cache = op.cos_sin_cache.to(dtype)
    out_q, out_k = _run(tpu.rotary_embedding, positions.to(torch.int32), q, k, 64, cache, is_neox, block_rows=BLOCK)
    rope_ref.check_rope_outputs(op, positions, q, k, out_q, out_k, products_rounded=False)
    if dtype != torch.float32:
        return
    back, none = _run(tpu.rotary_embedding, positions.to(torch.int32), out_q, None, 64, cache, is_neox, inverse=True)
    assert none is None
    assert_close(back, q, torch.float32, what="inverse")


#: the gated kernel for JAX users (the torch ops run the spec, which XLA fuses): table op ->
#: (x, the op's math_args) -> the JAX call. Every table row of these ops is run below.
JAX_GATED = {
    "silu_and_mul": lambda x, **kw: tpu.silu_and_mul(x, **kw),
    "mul_and_silu": lambda x, **kw: tpu.act_and_mul(x, "mul_silu", **kw),
    "gelu_and_mul": lambda x, approximate, **kw: tpu.gelu_and_mul(x, approximate, **kw),
    "fatrelu_and_mul": lambda x, threshold, **kw: tpu.act_and_mul(x, "fatrelu", threshold=threshold, **kw),
    "swiglustep_and_mul": lambda x, limit, **kw: tpu.act_and_mul(x, "swiglustep", limit=limit, **kw),
    "silu_and_mul_with_clamp": lambda x, *args, **kw: tpu.silu_and_mul_with_clamp(x, *args, **kw),
    "situ_and_mul": lambda x, *args, **kw: tpu.situ_and_mul(x, *args, **kw),
}


#: the two layouts of the kernel: d a multiple of 128 reads the halves as column blocks (7 rows
#: of d = 1024 in bf16); d = 96 splits rows in the kernel (20 rows in blocks of 8, fp32). The
#: rows take them in turn.
LAYOUTS = (((7, 1024), None, torch.bfloat16), ((ROWS, 96), BLOCK, torch.float32))
GATED_ROWS = [pytest.param(c, *LAYOUTS[i % 2], id=c.label)
              for i, c in enumerate(c for c in act_table.CASES if c.op in JAX_GATED)]


@pytest.mark.parametrize("case,shape,block,dtype", GATED_ROWS)
def test_gated_activation_kernel(case, shape, block, dtype):
    op = case.build()
    x = case.input((shape[0], 2 * shape[1]), dtype, generator=torch.Generator().manual_seed(0))
    y = _run(JAX_GATED[case.op], x, *op.math_args(), block_rows=block)
    assert y.shape == (shape[0], shape[1]) and y.dtype == dtype
    act_ref.assert_matches(case, op, x, y)


@pytest.mark.parametrize("label,dtype", [("dynamic per-token", torch.bfloat16),
                                         ("dynamic per-token scale_ub", torch.float32),
                                         ("per-group 64", torch.float32), ("per-group 128 ue8m0", torch.bfloat16)],
                         ids=str)
def test_quant_row_blocks(label, dtype):
    """20 rows in blocks of 8, against the float64 reference (``kernel_cases.judge_quant``)."""
    case = quant_table.BY_LABEL[label]
    x = case.input((ROWS, 384), dtype, generator=torch.Generator().manual_seed(3))
    kwargs = case.call_kwargs(x, 448.0)
    if case.group_size is None:
        out = _run(tpu.per_token_quant_fp8, x, kwargs.get("scale_ub"), block_rows=BLOCK)
    else:
        out = _run(tpu.per_group_quant_fp8, x, case.group_size, use_ue8m0=bool(case.init.get("use_ue8m0")),
                   block_rows=BLOCK)
    kernel_cases.judge_quant(case, x, tuple(out), kwargs, exact=False)


def test_ue8m0_rounds_up_exactly():
    """A scale just above a power of two rounds up to the next one. A float32 ``exp2(ceil(log2
    s))`` keeps ``2^-8 (1 + 2^-23)`` at 2^-8 (the log rounds to -8: what the kernel did before);
    the spec (frexp) and the kernel (a mantissa carry) give 2^-7. ``fp8_max=1`` makes the scale
    the amax itself."""
    just_above = np.float32(2.0 ** -8) * (np.float32(1) + np.float32(2.0 ** -23))
    x = jnp.zeros((8, 128), jnp.float32).at[:, 0].set(just_above).at[1, 0].set(2.0 ** -8).at[2, 0].set(3.0)
    _, scale = tpu.per_group_quant_fp8(x, 128, use_ue8m0=True, fp8_max=1.0, min_scale=2.0 ** -40, interpret=True)
    expected = qm.ue8m0_round_up(torch.tensor(np.asarray(x[:, :1])))
    assert torch.equal(torch.tensor(np.asarray(scale)), expected)
    assert [float(s) for s in scale[:3, 0]] == [2.0 ** -7, 2.0 ** -8, 4.0]


def test_quant_bounds_are_arguments():
    """``fp8_max`` and ``min_scale`` are taken as given (the torch schemas pass them in); the
    defaults are customop.math.fp8's for the dtype."""
    x = _x((7, 256), torch.float32, 0, 3.0)
    x[0] = 0
    q, scale = _run(tpu.per_token_quant_fp8, x, fp8_max=224.0, min_scale=1e-3)
    expected = torch.maximum((x.double().abs().amax(-1, keepdim=True) / 224.0).float(), torch.tensor(1e-3))
    assert_close(scale, expected, torch.float32, what="scale")
    assert float(q.float().abs().max()) <= 224.0
    assert tpu.fp8_max(jnp.float8_e4m3fn) == fp8_max(torch.float8_e4m3fn) == 448.0
    assert tpu.fp8_max(jnp.float8_e4m3fnuz) == fp8_max(torch.float8_e4m3fnuz)


def test_empty_and_leading_dims():
    x = jnp.zeros((0, 128), jnp.float32)
    assert tpu.rms_norm(x, None, 1e-6, interpret=True).shape == (0, 128)
    x3 = to_jax(_x((2, 3, 256), torch.float32, 0))
    assert tpu.silu_and_mul(x3, interpret=True).shape == (2, 3, 128)
    q, s = tpu.per_group_quant_fp8(x3, 128, interpret=True)
    assert q.shape == (2, 3, 256) and s.shape == (2, 3, 2)


def test_interpret_decision(monkeypatch):
    monkeypatch.setenv("CUSTOMOP_PALLAS_INTERPRET", "0")
    assert tpu.use_interpret() is False
    monkeypatch.setenv("CUSTOMOP_PALLAS_INTERPRET", "1")
    assert tpu.use_interpret() is True
    monkeypatch.setenv("CUSTOMOP_PALLAS_INTERPRET", "yes")
    with pytest.raises(ValueError, match="CUSTOMOP_PALLAS_INTERPRET"):
        tpu.use_interpret()
    monkeypatch.delenv("CUSTOMOP_PALLAS_INTERPRET")
    assert tpu.use_interpret() is True  # no TPU here: the XLA device (torch_xla's or JAX's) is a CPU
