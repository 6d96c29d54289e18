"""Dynamic fp8 quantization as Pallas kernels: per token and per group of ``G`` lanes.

JAX kernels (the fp8 facts come from ``customop.math.fp8``, which is torch; nothing here touches a
torch tensor). Each row (or group) stays in VMEM from its amax to its quantized store, so ``x`` is
read once; XLA's own lowering reads it twice (a reduction fusion, then the quantize fusion;
docs/tpu.md). Rounding order is the spec's (``customop/math/quant.py``):

- amax in the input dtype (exact), then fp32; ``scale = max(amax / MAX, MIN_SCALE)``;
- per token: ``q = clip(fp32(x) * (1 / scale), -MAX, MAX)`` (a reciprocal, then a multiply);
- per group: ``q = clip(fp32(x) / scale, -MAX, MAX)`` (a true division), with ``use_ue8m0``
  rounding the clamped scale up to a power of two, exactly.

``MAX`` (``fp8_max``) and ``MIN_SCALE`` (``min_scale``) are arguments, as in the
``torch.ops.customop`` quant schemas; left as None they are ``customop.math.fp8``'s values for
``fp8_dtype`` (448 for e4m3fn, vLLM's 224 for e4m3fnuz; ``1 / (MAX * 512)``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import torch
from jax import lax
from jax.experimental import pallas as pl

from customop.backends.tpu import tiling
from customop.math import fp8 as fp8_facts


def _torch_dtype(fp8_dtype) -> torch.dtype:
    """The torch dtype of the same name (jnp and torch spell the fp8 types alike)."""
    name = jnp.dtype(fp8_dtype).name
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"customop.backends.tpu: {name} has no torch counterpart")
    return dtype


def fp8_max(fp8_dtype) -> float:
    """The clamp bound of ``fp8_dtype``, from ``customop.math.fp8`` (448 for e4m3fn, 224 for
    e4m3fnuz)."""
    return fp8_facts.fp8_max(_torch_dtype(fp8_dtype))


def _bounds(fp8_dtype, limit: float | None, min_scale: float | None) -> tuple[float, float]:
    """``(fp8_max, min_scale)``: the given values, else ``customop.math.fp8``'s for the dtype."""
    dtype = _torch_dtype(fp8_dtype)
    limit = fp8_facts.fp8_max(dtype) if limit is None else float(limit)
    min_scale = fp8_facts.fp8_min_scale(dtype) if min_scale is None else float(min_scale)
    return limit, min_scale


def _ue8m0_round_up(scale):
    """``2^ceil(log2 s)`` exactly, for positive normal float32 ``s``: a set mantissa bit carries
    into the exponent. (A float32 ``log2`` rounds ``log2(2^k (1 + 2^-23))`` to ``k`` and would
    round such scales down; the spec, ``customop.math.quant.ue8m0_round_up``, is exact.)"""
    bits = lax.bitcast_convert_type(scale, jnp.int32)
    return lax.bitcast_convert_type((bits + 0x7FFFFF) & jnp.int32(-0x800000), jnp.float32)


def _per_token_kernel(*refs, fp8_max: float, min_scale: float, has_ub: bool):
    x_ref, ub_ref, q_ref, s_ref = refs if has_ub else (refs[0], None, *refs[1:])
    x = x_ref[...]
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True).astype(jnp.float32)
    if has_ub:
        amax = jnp.minimum(amax, ub_ref[...].astype(jnp.float32))
    scale = jnp.maximum(amax / fp8_max, min_scale)
    q = jnp.clip(x.astype(jnp.float32) * (1.0 / scale), -fp8_max, fp8_max)
    q_ref[...] = q.astype(q_ref.dtype)
    s_ref[...] = scale


def _per_group_kernel(x_ref, q_ref, s_ref, *, fp8_max: float, min_scale: float, use_ue8m0: bool):
    x = x_ref[...]  # [rows, groups, G]
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True).astype(jnp.float32)
    scale = jnp.maximum(amax / fp8_max, min_scale)
    if use_ue8m0:
        scale = _ue8m0_round_up(scale)
    q = jnp.clip(x.astype(jnp.float32) / scale, -fp8_max, fp8_max)
    q_ref[...] = q.astype(q_ref.dtype)
    s_ref[...] = scale


def _check_x(op: str, x) -> None:
    if x.ndim == 0 or not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype.itemsize == 1:
        raise TypeError(f"customop.backends.tpu.{op}: x must be a float (not fp8) array with at least one dim, "
                        f"got {x.dtype} of shape {tuple(x.shape)}")


@functools.partial(jax.jit, static_argnames=("fp8_dtype", "fp8_max", "min_scale", "block_rows", "interpret"))
def _per_token_jit(x, scale_ub, *, fp8_dtype, fp8_max, min_scale, block_rows, interpret):
    op = "per_token_quant_fp8"
    hidden = x.shape[-1]
    rows = x.size // hidden if hidden else 0
    if rows == 0:
        return jnp.zeros(x.shape, fp8_dtype), jnp.zeros((*x.shape[:-1], 1), jnp.float32)
    arrays = [x.reshape(rows, hidden)]
    if scale_ub is not None:
        arrays.append(jnp.reshape(scale_ub, (1, 1)))
    block = tiling.row_block(op, rows, tiling.bytes_per_row(hidden * (x.dtype.itemsize + 1), 128 * 4,
                                                            f32_temps=2, width=hidden), block_rows)
    in_specs = [pl.BlockSpec((block, hidden), lambda i: (i, 0))]
    if scale_ub is not None:
        in_specs.append(pl.BlockSpec((1, 1), lambda i: (0, 0)))
    kernel = functools.partial(_per_token_kernel, fp8_max=fp8_max, min_scale=min_scale, has_ub=scale_ub is not None)
    q, scale = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((rows, hidden), fp8_dtype), jax.ShapeDtypeStruct((rows, 1), jnp.float32)],
        grid=tiling.grid_for(rows, block),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((block, hidden), lambda i: (i, 0)), pl.BlockSpec((block, 1), lambda i: (i, 0))],
        compiler_params=tiling.row_parallel(),
        interpret=interpret,
        name=f"customop_{op}",
    )(*arrays)
    return q.reshape(x.shape), scale.reshape(*x.shape[:-1], 1)


def per_token_quant_fp8(x: jax.Array, scale_ub: jax.Array | None = None, *, fp8_dtype=jnp.float8_e4m3fn,
                        fp8_max: float | None = None, min_scale: float | None = None, block_rows: int | None = None,
                        interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """Dynamic per-token fp8 quant: ``amax = max|x|`` over the last dim (capped at the one-element
    ``scale_ub`` when given), ``scale = max(amax / MAX, MIN_SCALE)``,
    ``q = clip(fp32(x) * (1/scale), -MAX, MAX).astype(fp8_dtype)``. Returns ``(q, scale)`` with
    ``scale`` fp32 of shape ``x.shape[:-1] + (1,)``."""
    _check_x("per_token_quant_fp8", x)
    if scale_ub is not None and scale_ub.size != 1:
        raise ValueError(f"customop.backends.tpu.per_token_quant_fp8: scale_ub must have one element, "
                         f"got shape {tuple(scale_ub.shape)}")
    limit, min_scale = _bounds(fp8_dtype, fp8_max, min_scale)
    return _per_token_jit(x, scale_ub, fp8_dtype=jnp.dtype(fp8_dtype), fp8_max=limit, min_scale=min_scale,
                          block_rows=block_rows, interpret=tiling.resolve_interpret(interpret))


@functools.partial(jax.jit, static_argnames=("group_size", "use_ue8m0", "fp8_dtype", "fp8_max", "min_scale",
                                             "block_rows", "interpret"))
def _per_group_jit(x, *, group_size, use_ue8m0, fp8_dtype, fp8_max, min_scale, block_rows, interpret):
    op = "per_group_quant_fp8"
    hidden = x.shape[-1]
    groups = hidden // group_size
    rows = x.size // hidden if hidden else 0
    if rows == 0:
        return jnp.zeros(x.shape, fp8_dtype), jnp.zeros((*x.shape[:-1], groups), jnp.float32)
    # Groups become a sublane dim: [rows, groups, G] blocks reduce over lanes, no lane slicing;
    # the scales come out as [rows, groups, 1] (last two dims full, a legal block).
    view = (rows, groups, group_size)
    block = tiling.row_block(op, rows, tiling.bytes_per_row(hidden * (x.dtype.itemsize + 1), groups * 128 * 4,
                                                            f32_temps=2, width=hidden), block_rows)
    kernel = functools.partial(_per_group_kernel, fp8_max=fp8_max, min_scale=min_scale, use_ue8m0=use_ue8m0)
    q, scale = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(view, fp8_dtype), jax.ShapeDtypeStruct((rows, groups, 1), jnp.float32)],
        grid=tiling.grid_for(rows, block),
        in_specs=[pl.BlockSpec((block, groups, group_size), lambda i: (i, 0, 0))],
        out_specs=[pl.BlockSpec((block, groups, group_size), lambda i: (i, 0, 0)),
                   pl.BlockSpec((block, groups, 1), lambda i: (i, 0, 0))],
        compiler_params=tiling.row_parallel(),
        interpret=interpret,
        name=f"customop_{op}",
    )(x.reshape(view))
    return q.reshape(x.shape), scale.reshape(*x.shape[:-1], groups)


def per_group_quant_fp8(x: jax.Array, group_size: int, *, use_ue8m0: bool = False, fp8_dtype=jnp.float8_e4m3fn,
                        fp8_max: float | None = None, min_scale: float | None = None, block_rows: int | None = None,
                        interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """Dynamic per-group fp8 quant: each run of ``group_size`` lanes gets
    ``s = max(max|x_g| / MAX, MIN_SCALE)`` (exactly ``2^ceil(log2 s)`` with ``use_ue8m0``) and
    ``q = clip(fp32(x_g) / s, -MAX, MAX).astype(fp8_dtype)``. ``x.shape[-1]`` must be a multiple
    of ``group_size``. Returns ``(q, scales)`` with fp32 scales ``x.shape[:-1] + (H / G,)``."""
    op = "per_group_quant_fp8"
    _check_x(op, x)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0 or x.shape[-1] % group_size:
        raise ValueError(f"customop.backends.tpu.{op}: group_size={group_size!r} must be a positive divisor of "
                         f"x.shape[-1]={x.shape[-1]}")
    limit, min_scale = _bounds(fp8_dtype, fp8_max, min_scale)
    return _per_group_jit(x, group_size=group_size, use_ue8m0=bool(use_ue8m0), fp8_dtype=jnp.dtype(fp8_dtype),
                          fp8_max=limit, min_scale=min_scale, block_rows=block_rows,
                          interpret=tiling.resolve_interpret(interpret))


@functools.partial(jax.jit, static_argnames=("fp8_dtype", "fp8_max", "min_scale"))
def _per_tensor_jit(x, *, fp8_dtype, fp8_max, min_scale):
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32).reshape(1)
    scale = jnp.maximum(amax / fp8_max, min_scale)
    return jnp.clip(x.astype(jnp.float32) * (1.0 / scale), -fp8_max, fp8_max).astype(fp8_dtype), scale


def per_tensor_quant_fp8(x: jax.Array, *, fp8_dtype=jnp.float8_e4m3fn, fp8_max: float | None = None,
                         min_scale: float | None = None, interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """Dynamic per-tensor fp8 quant: ``scale = max(max|x| / MAX, MIN_SCALE)`` (shape ``[1]``),
    ``q = clip(fp32(x) * (1/scale), -MAX, MAX)``. Plain XLA, no Pallas: a whole-tensor amax
    cannot keep the tensor in VMEM, so it is two passes either way, and XLA fuses each.
    ``interpret`` is accepted for a uniform signature and ignored."""
    _check_x("per_tensor_quant_fp8", x)
    limit, min_scale = _bounds(fp8_dtype, fp8_max, min_scale)
    return _per_tensor_jit(x, fp8_dtype=jnp.dtype(fp8_dtype), fp8_max=limit, min_scale=min_scale)
