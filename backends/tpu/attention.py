"""Encoder attention over packed sequences (``mm_encoder_attn``) as a Pallas flash-attention kernel
with segment ids.

**Emulation only**: this kernel has run in Pallas interpret mode on a CPU and has been lowered for
TPU (``jax.export(..., platforms=["tpu"])``); libtpu has never compiled it and it has never run on a
TPU (docs/tpu.md).

``varlen_attention(q [T, Hq, D], k/v [T, Hkv, D], cu_seqlens [N + 1], scale)``: bidirectional
attention inside each segment ``cu_seqlens[i]:cu_seqlens[i + 1]`` (the spec:
``customop/math/attention.py``). How it maps onto a TPU:

- ``cu_seqlens`` becomes a segment id per token (a search over the boundaries, in XLA); a query
  attends exactly the keys with its own id. Tokens padded past ``T`` get one more id of their own,
  so padded queries attend only padded keys (finite values, sliced away).
- Head-major ``[H, T, D]`` blocks: the grid is ``(query head, query block, key block)``, key blocks
  innermost, with the running max, sum and fp32 output of an online softmax in VMEM scratch. GQA is
  the key/value block's index map (query head ``h`` reads head ``h // (Hq // Hkv)``): no repeat.
- Block skipping, the reason segment ids pay off for many short segments: for each query block the
  first and last key block that can share a segment with it are computed in XLA and passed as
  scalar prefetch; key blocks outside that range are not computed, and their index map is clamped
  into the range, so Pallas does not fetch them either (the block index does not change).
- The head dim is zero-padded to a multiple of 128 lanes (64, 72, 80 and 96 compute as 128): zero
  lanes add nothing to ``q . k`` and give zero output lanes, which are sliced away. The sequence is
  padded to the block size.
- Segment ids are stored lane-replicated for queries (``[T, 128]``) and sublane-replicated for keys
  (``[8, T]``) so that each block is a legal TPU tile; the kernel tiles the query ids across the key
  block and compares them with one row of key ids, and keeps the running max and sum
  lane-replicated (``[bq, 128]``), widening them by tiling: the layout pattern of jax's own TPU
  flash attention, which avoids broadcasting a ``[bq, 1]`` column across several vregs.
- Precision: scores and ``P @ V`` accumulate in fp32; fp32 inputs multiply at ``HIGHEST``
  precision; 16-bit inputs feed the MXU in their dtype and round the probabilities to it before
  ``P @ V`` (as FlashAttention does).

``cu_seqlens`` is trusted as given (it is made monotone and clamped into ``[0, T]`` first, so a
malformed one yields wrong rows, never an out-of-range block); the ``xla`` kernel checks it on the
host when ``max_seqlen`` is unknown, as the Triton kernel does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from customop.backends.tpu import tiling

LANES = 128
SUBLANES = 8
#: the default query and key block (rows); a multiple of 128 so that the key segment-id block
#: ``(8, block_k)`` is a legal tile. Not tuned on a TPU (none was available).
DEFAULT_BLOCK = 128
#: a finite "minus infinity": masked scores and the initial running max (exp underflows to 0, and
#: no inf - inf can produce a NaN)
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _widen(x: jax.Array, width: int) -> jax.Array:
    """A lane-replicated ``[rows, 128]`` array as ``[rows, width]``: tiled, or its first lanes when
    ``width`` < 128 (the pattern of jax's own TPU flash attention, which avoids broadcasting a
    ``[rows, 1]`` column across more than one vreg)."""
    return jnp.tile(x, (1, width // LANES)) if width >= LANES else x[:, :width]


def _flash_kernel(lo_ref, hi_ref, q_seg_ref, kv_seg_ref, q_ref, k_ref, v_ref, o_ref, m_sc, l_sc, acc_sc, *,
                  scale: float, precision):
    qi, ki = pl.program_id(1), pl.program_id(2)
    bk, dim = k_ref.shape[0], acc_sc.shape[1]

    @pl.when(ki == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, _MASK_VALUE, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when((ki >= lo_ref[qi]) & (ki <= hi_ref[qi]))
    def _compute():
        q, k, v = q_ref[...], k_ref[...], v_ref[...]
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                            precision=precision) * scale                       # [bq, bk]
        same = _widen(q_seg_ref[...], bk) == kv_seg_ref[0:1, :]                 # [bq, bk] == [1, bk]
        s = jnp.where(same, s, _MASK_VALUE)
        m_prev = m_sc[...]                                                      # [bq, 128], lane-replicated
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1)[:, None])
        p = jnp.where(same, jnp.exp(s - _widen(m_next, bk)), 0.0)
        alpha = jnp.exp(m_prev - m_next)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1)[:, None]
        m_sc[...] = m_next
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                             precision=precision)
        acc_sc[...] = acc_sc[...] * _widen(alpha, dim) + pv

    @pl.when(ki == pl.num_programs(2) - 1)
    def _finish():
        l = l_sc[...]
        # every real query row has at least one key (itself); the guard keeps a malformed
        # cu_seqlens from producing a NaN
        inv = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
        o_ref[...] = (acc_sc[...] * _widen(inv, dim)).astype(o_ref.dtype)


def _blocks(total: int, block_q: int | None, block_k: int | None) -> tuple[int, int, int]:
    """(padded length, query block, key block). One block over a short sequence (full dims are
    always legal tiles); else blocks that are multiples of 128 and a length padded to both."""
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b <= 0 or b % LANES):
            raise ValueError(f"customop.backends.tpu.varlen_attention: {name}={b!r} must be a positive multiple "
                             f"of {LANES}")
    if block_q is None and block_k is None and total <= DEFAULT_BLOCK:
        padded = _round_up(max(total, 1), 16)  # 16: full bf16 sublane tiles
        return padded, padded, padded
    bq, bk = block_q or DEFAULT_BLOCK, block_k or DEFAULT_BLOCK
    return _round_up(total, bq * bk // _gcd(bq, bk)), bq, bk


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def segment_ids(cu_seqlens: jax.Array, total: int, padded: int) -> tuple[jax.Array, jax.Array]:
    """(int32 id of each of ``padded`` tokens, int32 boundaries ``[N + 2]``): token ``t`` of segment
    ``i`` gets ``i``; tokens past ``total`` get ``N`` (the padding's own segment). The boundaries
    are ``cu_seqlens`` made monotone and clamped into ``[0, total]``, then ``padded``."""
    cu = jnp.clip(lax.cummax(cu_seqlens.astype(jnp.int32), axis=0), 0, total)
    bounds = jnp.concatenate([cu, jnp.array([padded], jnp.int32)])
    ids = jnp.searchsorted(bounds[1:], jnp.arange(padded, dtype=jnp.int32), side="right").astype(jnp.int32)
    return ids, bounds


def key_block_ranges(ids: jax.Array, bounds: jax.Array, bq: int, bk: int) -> tuple[jax.Array, jax.Array]:
    """For each query block, the first and last key block holding a key of one of its segments."""
    padded = ids.shape[0]
    first = ids[0::bq]
    last = ids[bq - 1::bq]
    n_kv = padded // bk
    lo = jnp.clip(bounds[first] // bk, 0, n_kv - 1)
    hi = jnp.clip((bounds[last + 1] - 1) // bk, 0, n_kv - 1)
    return lo.astype(jnp.int32), jnp.maximum(hi, lo).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_k", "interpret"))
def _varlen_attention_jit(q, k, v, cu_seqlens, *, scale, block_q, block_k, interpret):
    total, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    padded, bq, bk = _blocks(total, block_q, block_k)
    dim = _round_up(head_dim, LANES)
    ids, bounds = segment_ids(cu_seqlens, total, padded)
    lo, hi = key_block_ranges(ids, bounds, bq, bk)
    q_ids = jnp.broadcast_to(ids[:, None], (padded, LANES))
    kv_ids = jnp.broadcast_to(ids[None, :], (SUBLANES, padded))

    def head_major(t):  # [T, H, D] -> [H, padded, dim], zero-padded
        return jnp.pad(jnp.swapaxes(t, 0, 1), ((0, 0), (0, padded - total), (0, dim - head_dim)))

    group = heads // kv_heads

    def kv_head(h):  # lax.div: jnp's floor division lowers through sign, which Mosaic off-TPU cannot
        return lax.div(h, group)

    def kv_block(qi, ki, lo_ref, hi_ref):
        return jnp.minimum(jnp.maximum(ki, lo_ref[qi]), hi_ref[qi])

    squeezed = pl.Squeezed()
    in_specs = [
        pl.BlockSpec((bq, LANES), lambda h, qi, ki, lo_ref, hi_ref: (qi, 0)),
        pl.BlockSpec((SUBLANES, bk), lambda h, qi, ki, lo_ref, hi_ref: (0, kv_block(qi, ki, lo_ref, hi_ref))),
        pl.BlockSpec((squeezed, bq, dim), lambda h, qi, ki, lo_ref, hi_ref: (h, qi, 0)),
        pl.BlockSpec((squeezed, bk, dim), lambda h, qi, ki, lo_ref, hi_ref: (kv_head(h), kv_block(qi, ki, lo_ref,
                                                                                                    hi_ref), 0)),
        pl.BlockSpec((squeezed, bk, dim), lambda h, qi, ki, lo_ref, hi_ref: (kv_head(h), kv_block(qi, ki, lo_ref,
                                                                                                    hi_ref), 0)),
    ]
    out_spec = pl.BlockSpec((squeezed, bq, dim), lambda h, qi, ki, lo_ref, hi_ref: (h, qi, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(heads, padded // bq, padded // bk),
        in_specs=in_specs,
        out_specs=out_spec,
        scratch_shapes=[pltpu.VMEM((bq, LANES), jnp.float32), pltpu.VMEM((bq, LANES), jnp.float32),
                        pltpu.VMEM((bq, dim), jnp.float32)],
    )
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else lax.Precision.DEFAULT
    out = pl.pallas_call(
        functools.partial(_flash_kernel, scale=scale, precision=precision),
        out_shape=jax.ShapeDtypeStruct((heads, padded, dim), q.dtype),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="customop_varlen_attention",
    )(lo, hi, q_ids, kv_ids, head_major(q), head_major(k), head_major(v))
    return jnp.swapaxes(out[:, :total, :head_dim], 0, 1)


def varlen_attention(query: jax.Array, key: jax.Array, value: jax.Array, cu_seqlens: jax.Array,
                     scale: float | None = None, *, block_q: int | None = None, block_k: int | None = None,
                     interpret: bool | None = None) -> jax.Array:
    """Bidirectional attention inside each ``cu_seqlens`` segment of a packed sequence.

    ``query [T, Hq, D]``, ``key``/``value [T, Hkv, D]`` (``Hkv`` divides ``Hq``; one dtype: fp32,
    bf16 or fp16), ``cu_seqlens [N + 1]`` integer (starts at 0, never decreases, ends at ``T``).
    ``scale`` defaults to ``D ** -0.5``. ``block_q``/``block_k``: rows per block, multiples of 128
    (default: one block up to 128 tokens, else 128). Returns ``[T, Hq, D]`` in query's dtype."""
    op = "customop.backends.tpu.varlen_attention"
    if query.ndim != 3 or key.ndim != 3 or key.shape != value.shape or key.shape[0] != query.shape[0] \
            or key.shape[2] != query.shape[2] or key.shape[1] == 0 or query.shape[1] % key.shape[1]:
        raise ValueError(f"{op}: query [T, Hq, D] and key/value [T, Hkv, D] with Hkv dividing Hq, got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(f"{op}: one dtype for query, key and value, got {query.dtype}, {key.dtype}, {value.dtype}")
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2 or not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
        raise ValueError(f"{op}: cu_seqlens must be 1-D integer [N + 1], got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)}")
    scale = float(query.shape[-1] ** -0.5 if scale is None else scale)
    if query.shape[0] == 0:
        return jnp.zeros(query.shape, query.dtype)
    return _varlen_attention_jit(query, key, value, cu_seqlens, scale=scale, block_q=block_q, block_k=block_k,
                                 interpret=tiling.resolve_interpret(interpret))
