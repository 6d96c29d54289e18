"""The Pallas kernels in pure JAX (interpret mode on the CPU) against float64 references written
here, independent of the kernels and of the torch specs. Needs only jax: runs in the main tier.

Shapes are small (interpret mode runs one grid step at a time, ~0.3 s compile per new shape):
1, 7 and 64 rows of 128-1024 lanes, fp32 and bf16, ``block_rows=8`` for multi-step grids with a
partial last block, and the default (one full-dim block) for odd row counts.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from customop.backends import tpu  # noqa: E402
from customop.math import quant as qm  # noqa: E402
from customop.math.fp8 import fp8_max  # noqa: E402
from customop.testing import assert_close  # noqa: E402

DTYPES = {"fp32": (jnp.float32, torch.float32), "bf16": (jnp.bfloat16, torch.bfloat16)}
# (rows, hidden, block_rows): one row; odd rows in one full-dim block; a multi-step grid whose
# last block is partial (20 = 8 + 8 + 4); 64 rows in 8 steps.
SHAPES = [(1, 128, None), (7, 384, None), (20, 256, 8), (64, 1024, 8)]


def _rand(shape, dtype, seed, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, dtype=dtype)


def _f64(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def _check(actual, expected: np.ndarray, tdtype: torch.dtype, what: str = "output") -> None:
    assert_close(torch.from_numpy(_f64(actual)), torch.from_numpy(expected), dtype=tdtype, what=what)


def _rms64(h: np.ndarray, eps: float, count: int | None = None) -> np.ndarray:
    count = h.shape[-1] if count is None else count
    return h / np.sqrt((h[..., :count] ** 2).mean(-1, keepdims=True) + eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden,block", SHAPES)
def test_rms_norm(rows, hidden, block, dtype):
    jd, td = DTYPES[dtype]
    x, w = _rand((rows, hidden), jd, 0), _rand((hidden,), jd, 1)
    y = tpu.rms_norm(x, w, 1e-6, block_rows=block, interpret=True)
    assert y.shape == x.shape and y.dtype == x.dtype
    _check(y, _rms64(_f64(x), 1e-6) * _f64(w), td)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden,block", SHAPES[1:3])
def test_fused_add_rms_norm(rows, hidden, block, dtype):
    jd, td = DTYPES[dtype]
    x, r, w = _rand((rows, hidden), jd, 0), _rand((rows, hidden), jd, 2), _rand((hidden,), jd, 1)
    y, h = tpu.rms_norm(x, w, 1e-6, residual=r, block_rows=block, interpret=True)
    h64 = _f64(x) + _f64(r)
    _check(h, h64, td, "residual")
    _check(y, _rms64(h64, 1e-6) * _f64(w), td)


def test_rms_norm_variants():
    """No weight, variance over the first lanes only, a 3-D input, an fp32 weight on bf16 x."""
    x = _rand((3, 5, 256), jnp.float32, 3)
    _check(tpu.rms_norm(x, None, 1e-5, interpret=True), _rms64(_f64(x), 1e-5), torch.float32)
    w = _rand((256,), jnp.float32, 4)
    _check(tpu.rms_norm(x, w, 1e-5, variance_size=100, interpret=True), _rms64(_f64(x), 1e-5, 100) * _f64(w),
           torch.float32)
    xb = x.astype(jnp.bfloat16)
    y = tpu.rms_norm(xb, w, 1e-5, interpret=True)
    assert y.dtype == jnp.bfloat16
    _check(y, _rms64(_f64(xb), 1e-5) * _f64(w), torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_gemma_rms_norm(residual, dtype):
    jd, td = DTYPES[dtype]
    x, w = _rand((7, 512), jd, 0), _rand((512,), jnp.float32, 1, 0.1)
    r = _rand((7, 512), jd, 2) if residual else None
    out = tpu.gemma_rms_norm(x, w, 1e-6, residual=r, block_rows=8, interpret=True)
    h64 = _f64(x) + (_f64(r) if residual else 0.0)
    expected = _rms64(h64, 1e-6) * (1.0 + _f64(w))
    if residual:
        _check(out[1], h64, td, "residual")
        out = out[0]
    _check(out, expected, td)


def _gated64(x, w, z, eps, group, norm_before_gate, sigmoid):
    gate = None
    if z is not None:
        gate = 1 / (1 + np.exp(-z)) if sigmoid else z / (1 + np.exp(-z))
        if not norm_before_gate:
            x = x * gate
    g = x.reshape(*x.shape[:-1], -1, group)
    y = (g / np.sqrt((g**2).mean(-1, keepdims=True) + eps)).reshape(x.shape) * w
    return y * gate if gate is not None and norm_before_gate else y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group,norm_before_gate,activation,gated",
                         [(None, False, "swish", True), (128, True, "sigmoid", True), (256, False, "silu", False)])
def test_rms_norm_gated(group, norm_before_gate, activation, gated, dtype):
    jd, td = DTYPES[dtype]
    x, w = _rand((20, 512), jd, 0), _rand((512,), jnp.float32, 1)
    z = _rand((20, 512), jd, 2) if gated else None
    y = tpu.rms_norm_gated(x, w, z, 1e-5, group_size=group, norm_before_gate=norm_before_gate,
                           activation=activation, block_rows=8, interpret=True)
    expected = _gated64(_f64(x), _f64(w), None if z is None else _f64(z), 1e-5, group or 512,
                        norm_before_gate, activation == "sigmoid")
    _check(y, expected, td)


def _rotary64(positions, x, cache, head_size, neox):
    tokens = positions.size
    x = x.reshape(tokens, -1, head_size).copy()
    r = cache.shape[-1]
    cos, sin = np.split(cache[positions], 2, axis=-1)
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = (x[..., : r // 2], x[..., r // 2: r]) if neox else (x[..., 0:r:2], x[..., 1:r:2])
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    x[..., :r] = np.concatenate([o1, o2], -1) if neox else np.stack([o1, o2], -1).reshape(*x.shape[:-1], r)
    return x


def _cache(max_pos, rotary_dim, base=10000.0):
    inv = 1.0 / base ** (np.arange(0, rotary_dim, 2) / rotary_dim)
    freqs = np.outer(np.arange(max_pos), inv)
    return np.concatenate([np.cos(freqs), np.sin(freqs)], -1)


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("tokens,heads,kv_heads,head_size,rotary_dim,block,dtype",
                         [(1, 2, 1, 128, 128, None, "fp32"), (7, 4, 2, 128, 64, None, "fp32"),
                          (7, 4, 2, 128, 64, None, "bf16"), (20, 2, 1, 64, 32, 8, "fp32")])
def test_rotary_embedding(tokens, heads, kv_heads, head_size, rotary_dim, block, neox, dtype):
    jd, td = DTYPES[dtype]
    cache64 = _cache(128, rotary_dim)
    positions = np.random.default_rng(5).integers(0, 128, tokens)
    q, k = _rand((tokens, heads * head_size), jd, 0), _rand((tokens, kv_heads * head_size), jd, 1)
    q_out, k_out = tpu.rotary_embedding(jnp.asarray(positions, jnp.int32), q, k, head_size,
                                        jnp.asarray(cache64, jnp.float32), neox, block_rows=block, interpret=True)
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.dtype == jd
    _check(q_out.reshape(tokens, -1, head_size), _rotary64(positions, _f64(q), cache64, head_size, neox), td, "query")
    _check(k_out.reshape(tokens, -1, head_size), _rotary64(positions, _f64(k), cache64, head_size, neox), td, "key")
    if dtype == "bf16":
        return
    # The inverse rotation (the backward) undoes the forward.
    back, none = tpu.rotary_embedding(jnp.asarray(positions, jnp.int32), q_out, None, head_size,
                                      jnp.asarray(cache64, jnp.float32), neox, inverse=True, interpret=True)
    assert none is None
    _check(back, _f64(q), td, "inverse")


def _gelu64(v, tanh):
    if tanh:
        return 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3)))
    return 0.5 * v * (1 + np.vectorize(math.erf)(v / math.sqrt(2)))


def _silu64(v):
    return v / (1 + np.exp(-v))


ACT64 = {
    "silu": lambda a, b: _silu64(a) * b,
    "mul_silu": lambda a, b: a * _silu64(b),
    "gelu": lambda a, b: _gelu64(a, False) * b,
    "gelu_tanh": lambda a, b: _gelu64(a, True) * b,
    "fatrelu": lambda a, b: np.where(a > 0.25, a, 0.0) * b,
    "swiglustep": lambda a, b: np.minimum(_silu64(a), 1.5) * np.clip(b, -1.5, 1.5),
}


@pytest.mark.parametrize("activation", tpu.ACTIVATIONS)
@pytest.mark.parametrize("rows,d,block,dtype", [(7, 1024, None, "fp32"), (7, 1024, None, "bf16"), (20, 96, 8, "fp32")],
                         ids=["column-blocks", "column-blocks-bf16", "row-split"])
def test_act_and_mul(rows, d, block, dtype, activation):
    jd, td = DTYPES[dtype]
    x = _rand((rows, 2 * d), jd, 0, 2.0)
    y = tpu.act_and_mul(x, activation, threshold=0.25, limit=1.5, block_rows=block, interpret=True)
    assert y.shape == (rows, d) and y.dtype == jd
    a, b = np.split(_f64(x), 2, axis=-1)
    _check(y, ACT64[activation](a, b), td)


FP8_MAX = 448.0
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def _dequant_check(q, scale, expected_scale, x64, what):
    """Scales must match the reference; q is compared dequantized (one e4m3 ulp, the testing rule)."""
    assert q.dtype == jnp.float8_e4m3fn and scale.dtype == jnp.float32
    _check(scale, expected_scale, torch.float32, f"{what} scale")
    groups = expected_scale.shape[-1]
    dq = (_f64(q).reshape(x64.shape[0], groups, -1) * _f64(scale)[..., None]).reshape(x64.shape)
    assert_close(torch.from_numpy(dq), torch.from_numpy(x64), dtype=torch.float8_e4m3fn, what=f"{what} dequantized")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden,block", [(1, 256, None), (7, 1024, None), (20, 384, 8)])
def test_per_token_quant_fp8(rows, hidden, block, dtype):
    jd, _ = DTYPES[dtype]
    x = _rand((rows, hidden), jd, 0, 3.0)
    x = x.at[0].set(0)  # an all-zero row takes MIN_SCALE
    q, scale = tpu.per_token_quant_fp8(x, block_rows=block, interpret=True)
    x64 = _f64(x)
    expected = np.maximum(np.abs(x64).max(-1, keepdims=True) / FP8_MAX, MIN_SCALE)
    _dequant_check(q, scale, expected, x64, "per-token")
    if rows != 7:
        return
    # scale_ub caps the amax (not the scale)
    ub = jnp.asarray([1.0], jnp.float32)
    q, scale = tpu.per_token_quant_fp8(x, ub, block_rows=block, interpret=True)
    expected = np.maximum(np.minimum(np.abs(x64).max(-1, keepdims=True), 1.0) / FP8_MAX, MIN_SCALE)
    _check(scale, expected, torch.float32, "capped scale")
    assert np.abs(_f64(q)).max() <= FP8_MAX


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("rows,hidden,group,block", [(7, 512, 128, None), (20, 256, 64, 8)])
def test_per_group_quant_fp8(rows, hidden, group, block, ue8m0, dtype):
    jd, _ = DTYPES[dtype]
    x = _rand((rows, hidden), jd, 0, 3.0)
    q, scale = tpu.per_group_quant_fp8(x, group, use_ue8m0=ue8m0, block_rows=block, interpret=True)
    assert scale.shape == (rows, hidden // group)
    x64 = _f64(x)
    expected = np.maximum(np.abs(x64.reshape(rows, -1, group)).max(-1) / FP8_MAX, MIN_SCALE)
    if ue8m0:
        expected = 2.0 ** np.ceil(np.log2(expected))
        assert np.all(np.log2(_f64(scale)) == np.round(np.log2(_f64(scale))))
    _dequant_check(q, scale, expected, x64, "per-group")


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
    x = _rand((7, 256), jnp.float32, 0, 3.0).at[0].set(0)
    q, scale = tpu.per_token_quant_fp8(x, fp8_max=224.0, min_scale=1e-3, interpret=True)
    x64 = _f64(x)
    _check(scale, np.maximum(np.abs(x64).max(-1, keepdims=True) / 224.0, 1e-3), torch.float32, "scale")
    assert np.abs(_f64(q)).max() <= 224.0
    assert tpu.fp8_max(jnp.float8_e4m3fn) == fp8_max(torch.float8_e4m3fn) == FP8_MAX
    assert tpu.fp8_max(jnp.float8_e4m3fnuz) == fp8_max(torch.float8_e4m3fnuz)


def test_empty_and_leading_dims():
    x = jnp.zeros((0, 128), jnp.float32)
    assert tpu.rms_norm(x, None, 1e-6, interpret=True).shape == (0, 128)
    x3 = _rand((2, 3, 256), jnp.float32, 0)
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
