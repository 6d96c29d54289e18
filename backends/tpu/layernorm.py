"""Norms as Pallas kernels: RMSNorm (+ fused residual add), GemmaRMSNorm, RMSNormGated, the layer
norms (vLLM's LayerNorm; Nemotron's ``1 + w`` LayerNorm1P, + fused residual add) and
FusedRMSNormGated (+ fused residual add).

Pure JAX (no torch). Each kernel keeps whole rows in VMEM, so a row is read once, reduced and
rescaled, and written once; XLA's own lowering of the same math needs a reduction fusion and a
second pass over the row (see docs/tpu.md). The rounding order is the spec's
(``customop/math/layernorm.py``): plain RMSNorm casts the normalised fp32 value to the weight
dtype before multiplying, Gemma multiplies by ``1 + w`` in fp32, the gated norm is fp32
throughout.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from customop.backends.tpu import tiling

_WEIGHT_MODES = ("none", "llama", "gemma")


def _rms_norm_kernel(*refs, eps: float, weight_mode: str, has_residual: bool,
                     variance_size: int | None):
    refs = list(refs)
    x_ref = refs.pop(0)
    res_ref = refs.pop(0) if has_residual else None
    w_ref = refs.pop(0) if weight_mode != "none" else None
    out_ref = refs.pop(0)
    res_out_ref = refs.pop(0) if has_residual else None

    h = x_ref[...].astype(jnp.float32)
    if has_residual:
        h = h + res_ref[...].astype(jnp.float32)
        res_out_ref[...] = h.astype(res_out_ref.dtype)
    squares = h * h
    count = h.shape[-1]
    if variance_size is not None:
        # A lane mask instead of a slice: slicing at a lane offset that is not a multiple of 128
        # would need a relayout on the TPU.
        lanes = lax.broadcasted_iota(jnp.int32, squares.shape, squares.ndim - 1)
        squares = jnp.where(lanes < variance_size, squares, 0.0)
        count = variance_size
    y = h * lax.rsqrt(jnp.sum(squares, axis=-1, keepdims=True) / count + eps)
    if weight_mode == "llama":
        w = w_ref[...]
        y = y.astype(w.dtype) * w
    elif weight_mode == "gemma":
        y = y * (1.0 + w_ref[...].astype(jnp.float32))
    out_ref[...] = y.astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("op", "eps", "weight_mode", "variance_size", "block_rows", "interpret"))
def _rms_norm_jit(x, weight, residual, *, op, eps, weight_mode, variance_size, block_rows, interpret):
    assert weight_mode in _WEIGHT_MODES
    hidden = x.shape[-1] if x.ndim else 0
    if weight is not None:
        tiling.check_last_dim(op, "weight", weight, hidden)
        if weight.ndim != 1:
            raise ValueError(f"customop.backends.tpu.{op}: weight must be 1-D [{hidden}], got {tuple(weight.shape)}")
    if residual is not None:
        tiling.check_same_shape(op, "residual", residual, x)
    if variance_size is not None and not 0 < variance_size <= hidden:
        raise ValueError(f"customop.backends.tpu.{op}: variance_size={variance_size} must be in (0, {hidden}]")
    if variance_size == hidden:
        variance_size = None
    rows = x.size // hidden if hidden else 0
    x2 = x.reshape(rows, hidden)
    arrays = [x2]
    if residual is not None:
        arrays.append(residual.reshape(rows, hidden))
    if weight is not None:
        arrays.append(weight.reshape(1, hidden))  # TPU blocks need 2-D; (1, H) is the full array
    n_out = 2 if residual is not None else 1
    if rows == 0:
        outs = tuple(jnp.zeros(x.shape, x.dtype) for _ in range(n_out))
        return outs if residual is not None else outs[0]

    row_arrays = 1 + (residual is not None)
    row_bytes = [hidden * x.dtype.itemsize] * (row_arrays + n_out)
    block = tiling.row_block(op, rows, tiling.bytes_per_row(*row_bytes, f32_temps=3, width=hidden), block_rows)
    row_spec = pl.BlockSpec((block, hidden), lambda i: (i, 0))
    in_specs = [row_spec] * row_arrays
    if weight is not None:
        in_specs.append(pl.BlockSpec((1, hidden), lambda i: (0, 0)))
    kernel = functools.partial(_rms_norm_kernel, eps=eps, weight_mode=weight_mode,
                               has_residual=residual is not None, variance_size=variance_size)
    outs = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((rows, hidden), x.dtype)] * n_out,
        grid=tiling.grid_for(rows, block),
        in_specs=in_specs,
        out_specs=[row_spec] * n_out,
        compiler_params=tiling.row_parallel(),
        interpret=interpret,
        name=f"customop_{op}",
    )(*arrays)
    outs = tuple(o.reshape(x.shape) for o in outs)
    return outs if residual is not None else outs[0]


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float = 1e-6,
             residual: jax.Array | None = None, *, variance_size: int | None = None,
             block_rows: int | None = None, interpret: bool | None = None):
    """Llama RMSNorm over the last dim: ``y = x * rsqrt(mean(x^2) + eps)``, computed in fp32;
    with a weight ``y = y.astype(weight.dtype) * weight``; returned in ``x.dtype``.

    With ``residual`` (same shape and dtype as ``x``) it first forms ``h = fp32(x) + fp32(residual)``
    and returns ``(rms_norm(h), h.astype(x.dtype))``. ``variance_size`` takes the mean over the
    first that many lanes only. ``block_rows`` overrides the rows per block (a multiple of 8 or
    all rows); ``interpret=None`` picks interpret mode unless running on a TPU.
    """
    mode = "none" if weight is None else "llama"
    return _rms_norm_jit(x, weight, residual, op="rms_norm", eps=float(eps), weight_mode=mode,
                         variance_size=variance_size, block_rows=block_rows,
                         interpret=tiling.resolve_interpret(interpret))


def gemma_rms_norm(x: jax.Array, weight: jax.Array, eps: float = 1e-6,
                   residual: jax.Array | None = None, *, block_rows: int | None = None,
                   interpret: bool | None = None):
    """Gemma's RMSNorm: ``y = x * rsqrt(mean(x^2) + eps) * (1 + weight)``, all in fp32, returned
    in ``x.dtype``. With ``residual`` returns ``(gemma_rms_norm(h), h.astype(x.dtype))`` for
    ``h = fp32(x) + fp32(residual)``."""
    return _rms_norm_jit(x, weight, residual, op="gemma_rms_norm", eps=float(eps), weight_mode="gemma",
                         variance_size=None, block_rows=block_rows,
                         interpret=tiling.resolve_interpret(interpret))


def _rms_norm_gated_kernel(*refs, eps: float, has_gate: bool, norm_before_gate: bool, sigmoid: bool):
    refs = list(refs)
    x_ref, w_ref = refs.pop(0), refs.pop(0)
    z_ref = refs.pop(0) if has_gate else None
    out_ref = refs.pop(0)

    x = x_ref[...].astype(jnp.float32)
    gate = None
    if has_gate:
        z = z_ref[...].astype(jnp.float32)
        gate = jax.nn.sigmoid(z) if sigmoid else z * jax.nn.sigmoid(z)
        if not norm_before_gate:
            x = x * gate
    y = x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    y = y * w_ref[...].astype(jnp.float32)
    if has_gate and norm_before_gate:
        y = y * gate
    out_ref[...] = y.astype(out_ref.dtype)


def rms_norm_gated(x: jax.Array, weight: jax.Array, z: jax.Array | None = None, eps: float = 1e-5,
                   *, group_size: int | None = None, norm_before_gate: bool = False,
                   activation: str = "swish", block_rows: int | None = None,
                   interpret: bool | None = None) -> jax.Array:
    """Gated RMSNorm (Mamba2, gated delta-net), all in fp32, returned in ``x.dtype``.

    ``act`` is silu (``"swish"``/``"silu"``) or ``"sigmoid"``. ``norm_before_gate=False``:
    ``rms(x * act(z)) * w``; ``True``: ``rms(x) * w * act(z)``; no gate without ``z``. ``rms``
    normalises each run of ``group_size`` lanes separately (``None``: the whole row).
    """
    return _rms_norm_gated_jit(x, weight, z, eps=float(eps), group_size=group_size,
                               norm_before_gate=bool(norm_before_gate), activation=activation,
                               block_rows=block_rows, interpret=tiling.resolve_interpret(interpret))


@functools.partial(jax.jit, static_argnames=("eps", "group_size", "norm_before_gate", "activation",
                                             "block_rows", "interpret"))
def _rms_norm_gated_jit(x, weight, z, *, eps, group_size, norm_before_gate, activation, block_rows, interpret):
    op = "rms_norm_gated"
    if activation not in ("swish", "silu", "sigmoid"):
        raise ValueError(f"customop.backends.tpu.{op}: activation={activation!r} is not swish, silu or sigmoid")
    hidden = x.shape[-1] if x.ndim else 0
    tiling.check_last_dim(op, "weight", weight, hidden)
    if z is not None:
        tiling.check_same_shape(op, "z", z, x)
    group = hidden if group_size is None else group_size
    if group <= 0 or hidden % group:
        raise ValueError(f"customop.backends.tpu.{op}: group_size={group_size} must divide hidden={hidden}")
    rows = x.size // hidden if hidden else 0
    if rows == 0:
        return jnp.zeros(x.shape, x.dtype)
    groups = hidden // group
    # Groups become a sublane dim: [rows, groups, group] blocks reduce over lanes with no lane
    # slicing. One group stays 2-D, which avoids padding a size-1 sublane dim to 8 in VMEM.
    inner = (group,) if groups == 1 else (groups, group)
    view = (rows, *inner)
    arrays = [x.reshape(view), weight.reshape((1, group) if groups == 1 else inner)]
    if z is not None:
        arrays.append(z.reshape(view))
    row_bytes = [hidden * x.dtype.itemsize] * (2 + (z is not None))
    block = tiling.row_block(op, rows, tiling.bytes_per_row(*row_bytes, f32_temps=3, width=hidden), block_rows)
    zeros = (0,) * len(inner)
    row_spec = pl.BlockSpec((block, *inner), lambda i: (i, *zeros))
    w_shape = arrays[1].shape
    in_specs = [row_spec, pl.BlockSpec(w_shape, lambda i: (0,) * len(w_shape))]
    if z is not None:
        in_specs.append(row_spec)
    kernel = functools.partial(_rms_norm_gated_kernel, eps=eps, has_gate=z is not None,
                               norm_before_gate=norm_before_gate, sigmoid=activation == "sigmoid")
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(view, x.dtype),
        grid=tiling.grid_for(rows, block),
        in_specs=in_specs,
        out_specs=row_spec,
        compiler_params=tiling.row_parallel(),
        interpret=interpret,
        name=f"customop_{op}",
    )(*arrays)
    return out.reshape(x.shape)


# ---- layer norms ------------------------------------------------------------------------------------


def _layer_norm_kernel(*refs, eps: float, has_weight: bool, has_bias: bool, has_residual: bool, one_plus: bool):
    refs = list(refs)
    x_ref = refs.pop(0)
    res_ref = refs.pop(0) if has_residual else None
    w_ref = refs.pop(0) if has_weight else None
    b_ref = refs.pop(0) if has_bias else None
    out_ref = refs.pop(0)
    res_out_ref = refs.pop(0) if has_residual else None

    h = x_ref[...].astype(jnp.float32)
    if has_residual:
        # Nemotron adds in x's dtype: the sum is rounded there before it is normalised.
        h = (h + res_ref[...].astype(jnp.float32)).astype(x_ref.dtype).astype(jnp.float32)
        res_out_ref[...] = h.astype(res_out_ref.dtype)
    centred = h - jnp.mean(h, axis=-1, keepdims=True)
    y = centred * lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + eps)
    if has_weight:
        w = w_ref[...]
        if one_plus:
            w = w + jnp.asarray(1, w.dtype)  # 1 + w in w's dtype, as Nemotron forms it
        y = y * w.astype(jnp.float32)
    if has_bias:
        y = y + b_ref[...].astype(jnp.float32)
    out_ref[...] = y.astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("op", "eps", "one_plus", "block_rows", "interpret"))
def _layer_norm_jit(x, weight, bias, residual, *, op, eps, one_plus, block_rows, interpret):
    hidden = x.shape[-1] if x.ndim else 0
    for arg, p in (("weight", weight), ("bias", bias)):
        if p is not None:
            tiling.check_last_dim(op, arg, p, hidden)
            if p.ndim != 1:
                raise ValueError(f"customop.backends.tpu.{op}: {arg} must be 1-D [{hidden}], got {tuple(p.shape)}")
    if residual is not None:
        tiling.check_same_shape(op, "residual", residual, x)
    rows = x.size // hidden if hidden else 0
    n_out = 2 if residual is not None else 1
    if rows == 0:
        outs = tuple(jnp.zeros(x.shape, x.dtype) for _ in range(n_out))
        return outs if residual is not None else outs[0]
    arrays = [x.reshape(rows, hidden)] + ([residual.reshape(rows, hidden)] if residual is not None else [])
    row_arrays = len(arrays)
    params = [p.reshape(1, hidden) for p in (weight, bias) if p is not None]
    row_bytes = [hidden * x.dtype.itemsize] * (row_arrays + n_out)
    block = tiling.row_block(op, rows, tiling.bytes_per_row(*row_bytes, f32_temps=3, width=hidden), block_rows)
    row_spec = pl.BlockSpec((block, hidden), lambda i: (i, 0))
    kernel = functools.partial(_layer_norm_kernel, eps=eps, has_weight=weight is not None, has_bias=bias is not None,
                               has_residual=residual is not None, one_plus=one_plus)
    outs = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((rows, hidden), x.dtype)] * n_out,
        grid=tiling.grid_for(rows, block),
        in_specs=[row_spec] * row_arrays + [pl.BlockSpec((1, hidden), lambda i: (0, 0))] * len(params),
        out_specs=[row_spec] * n_out,
        compiler_params=tiling.row_parallel(),
        interpret=interpret,
        name=f"customop_{op}",
    )(*arrays, *params)
    outs = tuple(o.reshape(x.shape) for o in outs)
    return outs if residual is not None else outs[0]


def layer_norm(x: jax.Array, weight: jax.Array | None, bias: jax.Array | None = None, eps: float = 1e-5,
               *, block_rows: int | None = None, interpret: bool | None = None) -> jax.Array:
    """vLLM's LayerNorm over the last dim: ``(x - mean) / sqrt(var + eps) * w + b`` (biased
    variance), computed in fp32 and returned in ``x.dtype``; weight and bias are optional."""
    return _layer_norm_jit(x, weight, bias, None, op="layer_norm", eps=float(eps), one_plus=False,
                           block_rows=block_rows, interpret=tiling.resolve_interpret(interpret))


def nemotron_layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None, eps: float = 1e-5,
                        residual: jax.Array | None = None, *, block_rows: int | None = None,
                        interpret: bool | None = None):
    """Nemotron's LayerNorm1P: the layer norm with the weight ``1 + w`` (formed in w's dtype).
    With ``residual`` returns ``(norm(h), h)`` for ``h = x + residual`` added in x's dtype."""
    return _layer_norm_jit(x, weight, bias, residual, op="nemotron_layer_norm", eps=float(eps), one_plus=True,
                           block_rows=block_rows, interpret=tiling.resolve_interpret(interpret))


# ---- FusedRMSNormGated (the KDA output norm) ---------------------------------------------------------


def _fused_gated_kernel(*refs, eps: float, has_weight: bool, has_residual: bool, sigmoid: bool):
    refs = list(refs)
    x_ref, g_ref = refs.pop(0), refs.pop(0)
    res_ref = refs.pop(0) if has_residual else None
    w_ref = refs.pop(0) if has_weight else None
    out_ref = refs.pop(0)
    res_out_ref = refs.pop(0) if has_residual else None

    s = x_ref[...].astype(jnp.float32)
    if has_residual:
        s = s + res_ref[...].astype(jnp.float32)
        res_out_ref[...] = s.astype(res_out_ref.dtype)
    y = s * lax.rsqrt(jnp.mean(s * s, axis=-1, keepdims=True) + eps)
    if has_weight:
        y = y * w_ref[...].astype(jnp.float32)
    g = g_ref[...].astype(jnp.float32)
    y = y * jax.nn.sigmoid(g) if sigmoid else y * g * jax.nn.sigmoid(g)
    out_ref[...] = y.astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "sigmoid", "block_rows", "interpret"))
def _fused_gated_jit(x, g, weight, residual, *, eps, sigmoid, block_rows, interpret):
    op = "fused_rms_norm_gated"
    hidden = x.shape[-1] if x.ndim else 0
    tiling.check_same_shape(op, "g", g, x)
    if weight is not None:
        tiling.check_last_dim(op, "weight", weight, hidden)
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"customop.backends.tpu.{op}: residual has shape {residual.shape}, expected {x.shape}")
    rows = x.size // hidden if hidden else 0
    if rows == 0:
        y = jnp.zeros(x.shape, x.dtype)
        return y if residual is None else (y, jnp.zeros(residual.shape, residual.dtype))
    arrays = [x.reshape(rows, hidden), g.reshape(rows, hidden)]
    if residual is not None:
        arrays.append(residual.reshape(rows, hidden))
    row_arrays = len(arrays)
    if weight is not None:
        arrays.append(weight.reshape(1, hidden))
    out_shape = [jax.ShapeDtypeStruct((rows, hidden), x.dtype)]
    if residual is not None:
        out_shape.append(jax.ShapeDtypeStruct((rows, hidden), residual.dtype))
    row_bytes = [hidden * a.dtype.itemsize for a in arrays[:row_arrays]] + [hidden * o.dtype.itemsize for o in out_shape]
    block = tiling.row_block(op, rows, tiling.bytes_per_row(*row_bytes, f32_temps=3, width=hidden), block_rows)
    row_spec = pl.BlockSpec((block, hidden), lambda i: (i, 0))
    kernel = functools.partial(_fused_gated_kernel, eps=eps, has_weight=weight is not None,
                               has_residual=residual is not None, sigmoid=sigmoid)
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=tiling.grid_for(rows, block),
        in_specs=[row_spec] * row_arrays + ([pl.BlockSpec((1, hidden), lambda i: (0, 0))] if weight is not None else []),
        out_specs=[row_spec] * len(out_shape),
        compiler_params=tiling.row_parallel(),
        interpret=interpret,
        name=f"customop_{op}",
    )(*arrays)
    outs = tuple(o.reshape(x.shape) for o in outs)
    return outs if residual is not None else outs[0]


def fused_rms_norm_gated(x: jax.Array, g: jax.Array, weight: jax.Array | None = None, eps: float = 1e-5,
                         residual: jax.Array | None = None, *, activation: str = "swish",
                         block_rows: int | None = None, interpret: bool | None = None):
    """vLLM's FusedRMSNormGated, all in fp32: ``rms(s) * w`` then ``* g * sigmoid(g)``
    (``"swish"``/``"silu"``) or ``* sigmoid(g)``, returned in ``x.dtype``; ``s = x``, or with
    ``residual`` the fp32 ``x + residual``, when it returns ``(y, s in residual's dtype)``."""
    if activation not in ("swish", "silu", "sigmoid"):
        raise ValueError(f"customop.backends.tpu.fused_rms_norm_gated: activation={activation!r} is not swish, "
                         "silu or sigmoid")
    return _fused_gated_jit(x, g, weight, residual, eps=float(eps), sigmoid=activation == "sigmoid",
                            block_rows=block_rows, interpret=tiling.resolve_interpret(interpret))
