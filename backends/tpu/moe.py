"""The MoE experts (``fused_experts``) on TPUs: a grouped matmul Pallas kernel (megablox-style) for
the two expert GEMMs, the routing bookkeeping and the activation in XLA.

**Emulation only**: the kernel has run in Pallas interpret mode on a CPU and has been lowered for
TPU (``jax.export(..., platforms=["tpu"])``); libtpu has never compiled it and it has never run on a
TPU (docs/tpu.md).

``gmm(lhs [M, K], rhs [G, N, K], group_sizes [G])``: the rows of ``lhs`` are sorted by group, group
``g`` owning rows ``[offset_g, offset_g + group_sizes[g])``; row ``r`` of the result is
``lhs[r] @ rhs[g]^T`` for its group (rows past the last group are left undefined: the caller masks
them). ``rhs`` is the weight as stored (``w13 [E, 2I, H]``, ``w2 [E, H, I]``): no transpose in HBM.

The grid is ``(N tiles, visits, K tiles)``. A *visit* is one (row tile, group) pair: a row tile
that straddles a group boundary is visited once per group, each visit multiplying the whole tile by
that group's weights and storing only the group's rows (a masked store into the output tile, which
stays in VMEM while consecutive visits share it). The visits are computed in XLA from the group
sizes (``group_metadata``) and reach the kernel as scalar prefetch; their number is bounded by
``row tiles + G - 1``, the static grid size, and surplus grid steps compute nothing and point at the
last real visit's blocks (no extra fetch). Empty groups get no visit. K accumulates in an fp32 VMEM
scratch (``HIGHEST`` precision for fp32 inputs).

``fused_experts`` (the op's schema, ``customop/ops/_library/moe.py``; the math is
``customop/math/moe.py``): the ``T * top_k`` (token, k) slots are sorted by local expert (ids of -1,
out of range or of a remote expert sort last, into no group), gathered, sent through
``gmm(x, w13)``, the gated activation, ``gmm(·, w2)``, weighted, unsorted and summed over ``k`` in
fp32. Rounding follows the spec: the gate/up result and the activation in the input dtype, the
router weight on the fp32 down projection. K and N are zero-padded to multiples of 128 (a no-op at
model sizes).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from customop.backends.tpu import tiling

LANES = 128
#: the widest K and N tiles tried (the largest multiple of 128 up to this that divides the padded
#: dim is used). Not tuned on a TPU (none was available): 512 keeps the blocks about 2 MiB in bf16.
MAX_TILE_KN = 512
#: row tiles: 128 rows, or all rows (rounded to 16, a full bf16 sublane tile) when fewer
MAX_TILE_M = 128
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swigluoai", "swigluoai_uninterleave")


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _tile(dim: int) -> int:
    """The largest multiple of 128 up to ``MAX_TILE_KN`` dividing ``dim`` (a multiple of 128)."""
    return next(t for t in range(MAX_TILE_KN, 0, -LANES) if dim % t == 0)


@functools.partial(jax.jit, static_argnames=("rows", "tm"))
def group_metadata(group_sizes: jax.Array, rows: int, tm: int) -> tuple[jax.Array, ...]:
    """(group start rows ``[G]``, group end rows ``[G]``, group of each visit ``[V]``, row tile of each
    visit ``[V]``, number of real visits ``[1]``) for ``rows`` rows in tiles of ``tm``;
    ``V = rows / tm + G - 1``. Surplus visits repeat the last real one."""
    num_groups = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first_tile = lax.div(starts, tm)
    last_tile = lax.div(jnp.maximum(ends - 1, 0), tm)
    tiles = jnp.where(sizes > 0, last_tile - first_tile + 1, 0)
    visits = rows // tm + num_groups - 1
    total = jnp.sum(tiles)
    group_of = jnp.repeat(jnp.arange(num_groups, dtype=jnp.int32), tiles, total_repeat_length=visits)
    first_visit = jnp.cumsum(tiles) - tiles
    index = jnp.arange(visits, dtype=jnp.int32)
    last_real = jnp.maximum(total - 1, 0)
    index = jnp.minimum(index, last_real)
    group_of = jnp.where(jnp.arange(visits) < total, group_of, group_of[last_real])
    tile_of = first_tile[group_of] + index - first_visit[group_of]
    tile_of = jnp.clip(tile_of, 0, rows // tm - 1)
    return starts, ends, group_of.astype(jnp.int32), tile_of.astype(jnp.int32), total.reshape(1).astype(jnp.int32)


def _gmm_kernel(starts_ref, ends_ref, group_ref, tile_ref, total_ref, lhs_ref, rhs_ref, out_ref, acc_ref, *,
                tm: int, precision):
    visit, kk = pl.program_id(1), pl.program_id(2)
    real = visit < total_ref[0]

    @pl.when(kk == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(real)
    def _accumulate():
        acc_ref[...] += lax.dot_general(lhs_ref[...], rhs_ref[...], (((1,), (1,)), ((), ())),
                                        preferred_element_type=jnp.float32, precision=precision)

    @pl.when(real & (kk == pl.num_programs(2) - 1))
    def _store():
        group, tile = group_ref[visit], tile_ref[visit]
        rows = tile * tm + lax.broadcasted_iota(jnp.int32, out_ref.shape, 0)
        mine = (rows >= starts_ref[group]) & (rows < ends_ref[group])
        # the first visit of a tile starts from zeros; later ones keep the rows stored before them
        first = (visit == 0) | (tile_ref[jnp.maximum(visit - 1, 0)] != tile)
        before = jnp.where(first, jnp.zeros(out_ref.shape, out_ref.dtype), out_ref[...])
        out_ref[...] = jnp.where(mine, acc_ref[...].astype(out_ref.dtype), before)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret"))
def _gmm_jit(lhs, rhs, group_sizes, *, out_dtype, interpret):
    rows, depth = lhs.shape
    num_groups, cols, _ = rhs.shape
    tm = min(MAX_TILE_M, _round_up(rows, 16))
    rows_p, depth_p, cols_p = _round_up(rows, tm), _round_up(depth, LANES), _round_up(cols, LANES)
    tk, tn = _tile(depth_p), _tile(cols_p)
    lhs = jnp.pad(lhs, ((0, rows_p - rows), (0, depth_p - depth)))
    rhs = jnp.pad(rhs, ((0, 0), (0, cols_p - cols), (0, depth_p - depth)))
    starts, ends, group_of, tile_of, total = group_metadata(group_sizes, rows_p, tm)
    visits = group_of.shape[0]
    squeezed = pl.Squeezed()
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(cols_p // tn, visits, depth_p // tk),
        in_specs=[pl.BlockSpec((tm, tk), lambda n, v, k, s, e, g, t, c: (t[v], k)),
                  pl.BlockSpec((squeezed, tn, tk), lambda n, v, k, s, e, g, t, c: (g[v], n, k))],
        out_specs=pl.BlockSpec((tm, tn), lambda n, v, k, s, e, g, t, c: (t[v], n)),
        scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
    )
    precision = lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else lax.Precision.DEFAULT
    out = pl.pallas_call(
        functools.partial(_gmm_kernel, tm=tm, precision=precision),
        out_shape=jax.ShapeDtypeStruct((rows_p, cols_p), out_dtype),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
        name="customop_gmm",
    )(starts, ends, group_of, tile_of, total, lhs, rhs)
    return out[:rows, :cols]


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, out_dtype=None, *,
        interpret: bool | None = None) -> jax.Array:
    """Grouped matmul: ``lhs [M, K]`` (rows sorted by group), ``rhs [G, N, K]``, int ``group_sizes
    [G]`` summing to at most ``M`` -> ``[M, N]`` in ``out_dtype`` (default lhs's), row ``r`` of group
    ``g`` = ``lhs[r] @ rhs[g]^T`` accumulated in fp32. Rows past the last group are undefined."""
    op = "customop.backends.tpu.gmm"
    if lhs.ndim != 2 or rhs.ndim != 3 or rhs.shape[2] != lhs.shape[1] or group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"{op}: lhs [M, K], rhs [G, N, K] and group_sizes [G], got {tuple(lhs.shape)}, "
                         f"{tuple(rhs.shape)}, {tuple(group_sizes.shape)}")
    if lhs.dtype != rhs.dtype:
        raise TypeError(f"{op}: lhs is {lhs.dtype} but rhs is {rhs.dtype}")
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    if lhs.shape[0] == 0:
        return jnp.zeros((0, rhs.shape[1]), out_dtype)
    return _gmm_jit(lhs, rhs, group_sizes, out_dtype=out_dtype, interpret=tiling.resolve_interpret(interpret))


# ---- the experts --------------------------------------------------------------------------------


def act_and_mul(h: jax.Array, activation: str, alpha: float, limit: float, beta: float) -> jax.Array:
    """``customop.math.moe.act_and_mul`` in JAX (fp32 in, fp32 out): ``[..., 2I] -> [..., I]``."""
    if activation == "swigluoai":
        g, u = h[..., 0::2], h[..., 1::2]
    else:
        g, u = jnp.split(h, 2, axis=-1)
    if activation == "silu":
        return jax.nn.silu(jnp.minimum(g, limit)) * jnp.clip(u, -limit, limit)
    if activation in ("gelu", "gelu_tanh"):
        return jax.nn.gelu(g, approximate=activation == "gelu_tanh") * u
    if activation in ("swigluoai", "swigluoai_uninterleave"):
        g, u = jnp.minimum(g, limit), jnp.clip(u, -limit, limit)
        return g * jax.nn.sigmoid(alpha * g) * (u + beta)
    raise ValueError(f"customop.backends.tpu.fused_experts: activation must be one of {ACTIVATIONS}, "
                     f"got {activation!r}")


def fused_experts(x: jax.Array, w13: jax.Array, w2: jax.Array, topk_weights: jax.Array, topk_ids: jax.Array,
                  expert_map: jax.Array | None = None, w13_bias: jax.Array | None = None,
                  w2_bias: jax.Array | None = None, *, activation: str = "silu", alpha: float = 1.0,
                  limit: float = math.inf, beta: float = 0.0, apply_router_weight_on_input: bool = False,
                  interpret: bool | None = None) -> jax.Array:
    """``out[t] = sum_k w[t, k] * w2[e] @ act(w13[e] @ x[t])`` for ``e`` the local expert of
    ``topk_ids[t, k]`` (see the module docstring); ``x [T, H]``, ``w13 [E, 2I, H]``, ``w2 [E, H, I]``,
    ``topk_weights``/``topk_ids [T, K]``, ``expert_map [E_global]`` int (-1: remote) or None, biases
    ``[E, 2I]``/``[E, H]`` or None. Returns ``[T, H]`` in x's dtype."""
    if activation not in ACTIVATIONS:
        act_and_mul(jnp.zeros((1, 2)), activation, alpha, limit, beta)  # raises with the list
    tokens, top_k = topk_ids.shape
    n_local, hidden = w13.shape[0], w2.shape[1]
    if tokens == 0:
        return jnp.zeros((0, hidden), x.dtype)
    interpret = tiling.resolve_interpret(interpret)
    ids = topk_ids.astype(jnp.int32).reshape(-1)
    n_ids = n_local if expert_map is None else expert_map.shape[0]
    known = (ids >= 0) & (ids < n_ids)
    local = jnp.where(known, ids, 0)
    if expert_map is not None:
        local = expert_map.astype(jnp.int32)[local]
    key = jnp.where(known & (local >= 0) & (local < n_local), local, n_local)  # no expert: sorts last
    order = jnp.argsort(key, stable=True)
    sizes = jnp.zeros(n_local + 1, jnp.int32).at[key].add(1)[:n_local]
    sorted_key = key[order]
    expert_row = jnp.minimum(sorted_key, n_local - 1)
    weights = topk_weights.astype(jnp.float32).reshape(-1)[order]
    xs = x[order // top_k]
    if apply_router_weight_on_input:
        xs = xs * weights.astype(x.dtype)[:, None]
    h = gmm(xs, w13, sizes, x.dtype if w13_bias is None else jnp.float32, interpret=interpret)
    if w13_bias is not None:
        h = (h + w13_bias.astype(jnp.float32)[expert_row]).astype(x.dtype)
    a = act_and_mul(h.astype(jnp.float32), activation, alpha, limit, beta).astype(x.dtype)
    y = gmm(a, w2, sizes, jnp.float32, interpret=interpret)
    if w2_bias is not None:
        y = y + w2_bias.astype(jnp.float32)[expert_row]
    if not apply_router_weight_on_input:
        y = y * weights[:, None]
    y = jnp.where((sorted_key < n_local)[:, None], y, 0.0)  # rows in no group are undefined in gmm
    y = y[jnp.argsort(order)]  # back to (token, k) order
    return y.reshape(tokens, top_k, hidden).sum(axis=1).astype(x.dtype)
