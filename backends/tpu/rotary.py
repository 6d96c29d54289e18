"""Rotary position embedding (neox and gptj layouts) as one Pallas kernel.

Pure JAX (no torch). The rotation of one head is written lane-wise so the kernel needs no lane
slicing (which costs relayouts on the TPU when ``rotary_dim / 2`` is not a multiple of 128):

    out = x * cos_lanes + swap(x) * sin_lanes

``swap`` brings each lane its rotation partner (neox: the other half of the rotary part; gptj: the
neighbouring lane), built from two ``pltpu.roll``s and a select; ``cos_lanes``/``sin_lanes`` hold
per-lane cos and signed sin (1 and 0 past ``rotary_dim``, so those lanes pass through). The
tables are gathered from the cache once per token outside the kernel and broadcast over heads.

The backward is the same kernel with ``sin`` negated (the rotation is orthogonal and ``swap`` is
its own transpose), see ``rotary_embedding(..., inverse=True)``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from customop.backends.tpu import tiling


def _rotary_kernel(x_ref, cos_ref, sin_ref, out_ref, *, is_neox_style: bool, rotary_dim: int):
    x = x_ref[...].astype(jnp.float32)  # [rows, heads, head_size]
    lanes_axis = x.ndim - 1
    head_size = x.shape[-1]
    lane = lax.broadcasted_iota(jnp.int32, x.shape, lanes_axis)
    shift = rotary_dim // 2 if is_neox_style else 1
    # pltpu.roll(v, s) == jnp.roll(v, s): lane i receives lane i - s; head_size - s gives i + s.
    from_right = pltpu.roll(x, head_size - shift, lanes_axis)
    from_left = pltpu.roll(x, shift, lanes_axis)
    takes_right = lane < shift if is_neox_style else (lane & 1) == 0
    partner = jnp.where(takes_right, from_right, from_left)
    out_ref[...] = (x * cos_ref[...] + partner * sin_ref[...]).astype(out_ref.dtype)


def _lane_tables(positions, cos_sin_cache, head_size: int, is_neox_style: bool, inverse: bool):
    """Per-token [T, 1, head_size] fp32 cos and signed-sin lanes from the [max_pos, rotary_dim]
    cache (cos in the first half, sin in the second)."""
    rotary_dim = cos_sin_cache.shape[-1]
    cos, sin = jnp.split(cos_sin_cache[positions].astype(jnp.float32), 2, axis=-1)
    if inverse:
        sin = -sin
    if is_neox_style:
        cos_l, sin_l = jnp.concatenate([cos, cos], -1), jnp.concatenate([-sin, sin], -1)
    else:  # interleaved pairs: (even, odd) lanes = (x1, x2)
        cos_l = jnp.repeat(cos, 2, axis=-1)
        sin_l = jnp.stack([-sin, sin], axis=-1).reshape(sin.shape[0], rotary_dim)
    pad = head_size - rotary_dim
    if pad:
        cos_l = jnp.pad(cos_l, ((0, 0), (0, pad)), constant_values=1.0)
        sin_l = jnp.pad(sin_l, ((0, 0), (0, pad)))
    return cos_l[:, None, :], sin_l[:, None, :]


@functools.partial(jax.jit, static_argnames=("head_size", "is_neox_style", "inverse", "block_rows", "interpret"))
def _rotate_jit(positions, x, cos_sin_cache, *, head_size, is_neox_style, inverse, block_rows, interpret):
    op = "rotary_embedding"
    tokens = positions.size
    if tokens == 0:
        return jnp.zeros(x.shape, x.dtype)
    if x.size % (tokens * head_size):
        raise ValueError(f"customop.backends.tpu.{op}: an input of shape {tuple(x.shape)} does not view as "
                         f"[{tokens} tokens, heads, {head_size}]")
    heads = x.size // (tokens * head_size)
    view = (tokens, heads, head_size)
    cos_l, sin_l = _lane_tables(positions.reshape(-1), cos_sin_cache, head_size, is_neox_style, inverse)
    row_bytes = heads * head_size * x.dtype.itemsize
    block = tiling.row_block(op, tokens, tiling.bytes_per_row(
        row_bytes, row_bytes, 8 * head_size * 4 * 2, f32_temps=4, width=heads * head_size), block_rows)
    x_spec = pl.BlockSpec((block, heads, head_size), lambda i: (i, 0, 0))
    table_spec = pl.BlockSpec((block, 1, head_size), lambda i: (i, 0, 0))
    kernel = functools.partial(_rotary_kernel, is_neox_style=is_neox_style, rotary_dim=cos_sin_cache.shape[-1])
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(view, x.dtype),
        grid=tiling.grid_for(tokens, block),
        in_specs=[x_spec, table_spec, table_spec],
        out_specs=x_spec,
        compiler_params=tiling.row_parallel(),
        interpret=interpret,
        name=f"customop_{op}",
    )(x.reshape(view), cos_l, sin_l)
    return out.reshape(x.shape)


def rotary_embedding(positions: jax.Array, query: jax.Array, key: jax.Array | None, head_size: int,
                     cos_sin_cache: jax.Array, is_neox_style: bool = True, *,
                     inverse: bool = False, block_rows: int | None = None,
                     interpret: bool | None = None) -> tuple[jax.Array, jax.Array | None]:
    """Rotates the first ``rotary_dim = cos_sin_cache.shape[-1]`` lanes of every head of
    ``query`` and ``key`` by the angle of each token's position; returns new arrays
    ``(query, key)`` of the input shapes (``key`` may be None).

    ``positions``: ``[T]`` (or anything of T elements); ``query``/``key``: anything that views as
    ``[T, heads, head_size]``; ``cos_sin_cache``: ``[max_position, rotary_dim]``, cos in the first
    half, sin in the second. neox style rotates ``(x[:r/2], x[r/2:r])`` pairs, gptj style
    ``(x[0::2], x[1::2])``: ``o1 = x1 cos - x2 sin``, ``o2 = x2 cos + x1 sin``, computed in fp32.
    ``inverse=True`` rotates by the negative angle (the vector-Jacobian product).
    """
    op = "rotary_embedding"
    rotary_dim = cos_sin_cache.shape[-1] if cos_sin_cache.ndim == 2 else -1
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_size:
        raise ValueError(f"customop.backends.tpu.{op}: cos_sin_cache has shape {tuple(cos_sin_cache.shape)}; "
                         f"expected [max_position, rotary_dim] with an even rotary_dim <= head_size={head_size}")
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise TypeError(f"customop.backends.tpu.{op}: positions must be integers, got {positions.dtype}")
    statics = dict(head_size=int(head_size), is_neox_style=bool(is_neox_style), inverse=bool(inverse),
                   block_rows=block_rows, interpret=tiling.resolve_interpret(interpret))
    q = _rotate_jit(positions, query, cos_sin_cache, **statics)
    k = None if key is None else _rotate_jit(positions, key, cos_sin_cache, **statics)
    return q, k
