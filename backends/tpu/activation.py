"""The gated activations ``act(gate) * up`` (the ``*_and_mul`` family) as ONE parametrized Pallas
kernel. Pure JAX (no torch).

Input ``x [..., 2d]`` holds ``gate = x[..., :d]`` and ``up = x[..., d:]`` (the spec:
``customop/math/activation.py``); the output is ``[..., d]`` in ``x.dtype``, computed in fp32. When ``d`` is a multiple of 128
the kernel reads the two halves as separate column blocks of the same array (no lane slicing);
otherwise each block is a whole row and is split inside the kernel.

Whether this kernel earns its place over XLA's own fusion is measured in docs/tpu.md (it does
not: XLA fuses ``act(gate) * up`` into one pass over ``x``). On torch_xla the activation ops
therefore have no ``xla`` kernel (their ``torch.ops.customop`` default body runs on the XLA
device and XLA fuses it); this kernel is kept for JAX users.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from customop.backends.tpu import tiling

#: The activations of the *_and_mul family (halves layout: gate first, then up).
ACTIVATIONS = ("silu", "mul_silu", "gelu", "gelu_tanh", "fatrelu", "swiglustep", "silu_clamp", "situ")
#: ``beta`` when the caller gives none: silu_clamp's offset of the up half, situ's tanh scale
_DEFAULT_BETA = {"silu_clamp": 0.0, "situ": 1.0}
_COLUMN_BLOCK = 512  # lanes per block when d splits evenly (a multiple of 128)


#: Abramowitz & Stegun 7.1.26: |error| <= 1.5e-7, about one fp32 ulp of erf's range.
_ERF_P = 0.3275911
_ERF_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def _erf(v):
    """erf from exp and a polynomial: jax 0.7.1 (the version torch_xla 2.9 pins) has no Mosaic
    lowering for ``lax.erf`` ("Unimplemented primitive in Pallas TPU lowering: erf"; caught by
    tests/backends/tpu/test_lowering.py)."""
    a = jnp.abs(v)
    t = 1.0 / (1.0 + _ERF_P * a)
    poly = t * (_ERF_A[0] + t * (_ERF_A[1] + t * (_ERF_A[2] + t * (_ERF_A[3] + t * _ERF_A[4]))))
    magnitude = 1.0 - poly * jnp.exp(-a * a)
    # A select, not jnp.sign: jax 0.10's Mosaic rule for sign asks the TPU generation, which
    # fails when lowering for TPU on a machine without one.
    return jnp.where(v < 0, -magnitude, magnitude)


def _gelu(v, approximate: bool):
    if approximate:
        inner = math.sqrt(2.0 / math.pi) * (v + 0.044715 * v * v * v)
        return 0.5 * v * (1.0 + jnp.tanh(inner))
    return 0.5 * v * (1.0 + _erf(v * (1.0 / math.sqrt(2.0))))


def _apply(activation: str, gate, up, threshold: float, limit: float, alpha: float, beta: float,
           linear_beta: float | None):
    if activation == "silu":
        return gate * jax.nn.sigmoid(gate) * up
    if activation == "mul_silu":  # the gate is the second half
        return gate * (up * jax.nn.sigmoid(up))
    if activation in ("gelu", "gelu_tanh"):
        return _gelu(gate, activation == "gelu_tanh") * up
    if activation == "fatrelu":
        return jnp.where(gate > threshold, gate, 0.0) * up
    if activation == "swiglustep":
        return jnp.minimum(gate * jax.nn.sigmoid(gate), limit) * jnp.clip(up, -limit, limit)
    if activation == "silu_clamp":  # the clamps come before the activation
        g = jnp.minimum(gate, limit)
        return g * jax.nn.sigmoid(alpha * g) * (jnp.clip(up, -limit, limit) + beta)
    if activation == "situ":
        g = beta * jnp.tanh(gate / beta) * jax.nn.sigmoid(gate)
        return g * (up if linear_beta is None else linear_beta * jnp.tanh(up / linear_beta))
    raise ValueError(f"customop.backends.tpu.act_and_mul: activation={activation!r} is not one of {ACTIVATIONS}")


def _split_kernel(gate_ref, up_ref, out_ref, **params):
    out_ref[...] = _apply(gate=gate_ref[...].astype(jnp.float32), up=up_ref[...].astype(jnp.float32),
                          **params).astype(out_ref.dtype)


def _row_kernel(x_ref, out_ref, *, d: int, **params):
    x = x_ref[...].astype(jnp.float32)
    out_ref[...] = _apply(gate=x[:, :d], up=x[:, d:], **params).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("activation", "threshold", "limit", "alpha", "beta", "linear_beta",
                                             "block_rows", "interpret"))
def _act_and_mul_jit(x, *, activation, threshold, limit, alpha, beta, linear_beta, block_rows, interpret):
    op = "act_and_mul"
    if activation not in ACTIVATIONS:
        raise ValueError(f"customop.backends.tpu.{op}: activation={activation!r} is not one of {ACTIVATIONS}")
    if x.ndim == 0 or x.shape[-1] % 2:
        raise ValueError(f"customop.backends.tpu.{op}: the last dim of x {tuple(x.shape)} must be even")
    d = x.shape[-1] // 2
    rows = x.size // (2 * d) if d else 0
    out_shape = (*x.shape[:-1], d)
    if rows == 0 or d == 0:
        return jnp.zeros(out_shape, x.dtype)
    params = dict(activation=activation, threshold=threshold, limit=limit, alpha=alpha, beta=beta,
                  linear_beta=linear_beta)
    x2 = x.reshape(rows, 2 * d)
    itemsize = x.dtype.itemsize
    common = dict(out_shape=jax.ShapeDtypeStruct((rows, d), x.dtype), interpret=interpret,
                  name=f"customop_{op}_{activation}")
    if d % 128 == 0:
        cols = math.gcd(d, _COLUMN_BLOCK)  # a multiple of 128 that divides d
        block = tiling.row_block(op, rows, tiling.bytes_per_row(3 * cols * itemsize, f32_temps=3, width=cols),
                                 block_rows)
        halves = d // cols
        spec = functools.partial(pl.BlockSpec, (block, cols))
        out = pl.pallas_call(
            functools.partial(_split_kernel, **params),
            grid=(pl.cdiv(rows, block), halves),
            in_specs=[spec(lambda i, j: (i, j)), spec(lambda i, j: (i, j + halves))],
            out_specs=spec(lambda i, j: (i, j)),
            compiler_params=tiling.row_parallel(grid_dims=2),
            **common,
        )(x2, x2)
    else:
        block = tiling.row_block(op, rows, tiling.bytes_per_row(3 * d * itemsize, f32_temps=3, width=2 * d),
                                 block_rows)
        out = pl.pallas_call(
            functools.partial(_row_kernel, d=d, **params),
            grid=tiling.grid_for(rows, block),
            in_specs=[pl.BlockSpec((block, 2 * d), lambda i: (i, 0))],
            out_specs=pl.BlockSpec((block, d), lambda i: (i, 0)),
            compiler_params=tiling.row_parallel(),
            **common,
        )(x2)
    return out.reshape(out_shape)


def act_and_mul(x: jax.Array, activation: str = "silu", *, threshold: float = 0.0, limit: float = 7.0,
                alpha: float = 1.0, beta: float | None = None, linear_beta: float | None = None,
                block_rows: int | None = None, interpret: bool | None = None) -> jax.Array:
    """``act(gate) * up`` for ``x = [gate | up]`` along the last dim; returns ``[..., d]``.

    ``activation``: ``"silu"`` (SiluAndMul), ``"mul_silu"`` (MulAndSilu: ``gate * silu(up)``),
    ``"gelu"`` / ``"gelu_tanh"`` (GeluAndMul none/tanh), ``"fatrelu"`` (``gate`` kept where
    ``> threshold``, else 0), ``"swiglustep"`` (``min(silu(gate), limit) * clip(up, -limit, limit)``),
    ``"silu_clamp"`` (SiluAndMulWithClamp: ``g = min(gate, limit)``,
    ``g * sigmoid(alpha * g) * (clip(up, -limit, limit) + beta)``, ``beta`` 0 by default),
    ``"situ"`` (SituAndMul: ``beta * tanh(gate / beta) * sigmoid(gate)`` times ``up``, or times
    ``linear_beta * tanh(up / linear_beta)``; ``beta`` 1 by default).
    """
    if beta is None:
        beta = _DEFAULT_BETA.get(activation, 0.0)
    return _act_and_mul_jit(x, activation=activation, threshold=float(threshold), limit=float(limit),
                            alpha=float(alpha), beta=float(beta),
                            linear_beta=None if linear_beta is None else float(linear_beta),
                            block_rows=block_rows, interpret=tiling.resolve_interpret(interpret))


def silu_and_mul(x: jax.Array, **kwargs) -> jax.Array:
    """``silu(x[..., :d]) * x[..., d:]`` (see ``act_and_mul``)."""
    return act_and_mul(x, "silu", **kwargs)


def gelu_and_mul(x: jax.Array, approximate: str = "none", **kwargs) -> jax.Array:
    """``gelu(x[..., :d], approximate) * x[..., d:]``, ``approximate`` ``"none"`` or ``"tanh"``."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"customop.backends.tpu.gelu_and_mul: approximate={approximate!r} is not 'none' or 'tanh'")
    return act_and_mul(x, "gelu" if approximate == "none" else "gelu_tanh", **kwargs)


def silu_and_mul_with_clamp(x: jax.Array, swiglu_limit: float, alpha: float = 1.0, beta: float = 0.0,
                            **kwargs) -> jax.Array:
    """``g = min(x[..., :d], swiglu_limit)``, ``g * sigmoid(alpha * g) * (clip(x[..., d:], -L, L) + beta)``."""
    return act_and_mul(x, "silu_clamp", limit=swiglu_limit, alpha=alpha, beta=beta, **kwargs)


def situ_and_mul(x: jax.Array, beta: float = 1.0, linear_beta: float | None = None, **kwargs) -> jax.Array:
    """``beta * tanh(a / beta) * sigmoid(a) * b`` (``b`` through ``linear_beta * tanh(b / linear_beta)``
    when ``linear_beta`` is given), ``a, b`` the halves of ``x``."""
    return act_and_mul(x, "situ", beta=beta, linear_beta=linear_beta, **kwargs)
