"""Rotary embedding (neox and gptj, partial rotary) on query and key in one launch, in place.

``customop::rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)``:
each head's first ``rotary_dim`` lanes are rotated by the angle of its token's position,
``o1 = x1*cos - x2*sin``, ``o2 = x2*cos + x1*sin`` (op-semantics D.3); neox pairs the two halves
of the rotary part, gptj the even/odd lanes. ``cos_sin_cache[pos] = cat(cos, sin)``.

Layout of the work: program ``(t, s)`` handles token ``t`` and the ``s``-th slice of its query
heads and of its key heads. The position and its cos/sin row are loaded once per program and
reused for every head of the slice; the heads go through in tiles of ``[BLOCK_H, rotary_dim]``.
For many tokens there is one slice (all heads of q and k in one program, ~20 KB of traffic for
32+8 heads of 128 in bf16); at decode sizes the heads are split so that more SMs share the
latency. When a slice fits one tile (the common case) its q and k loads are issued before the
position's, so they overlap the position -> cos/sin dependency instead of queueing behind it
(one memory round trip per program instead of three). The math is fp32 and rounds once into the
input dtype (vLLM's native path rounds after each multiply in bf16; the kernel is closer to the
exact value).

gptj lanes are loaded as one contiguous ``[BLOCK_H, rotary_dim]`` tile (16-byte vector loads)
and de-interleaved in registers with ``reshape`` + ``split``; strided loads would move the same
bytes with 4x the load instructions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from customop.backends.triton._tuning import rotary_config, sm_count
from customop.backends.triton.quant import launch_device

#: lanes of one half-tile per loop step: 32 heads of 64 pairs (a Llama-8B token's q in one step,
#: 8 KB of bf16 per load pair), 16 lanes per thread with 4 warps: two 16-byte vectors per load
_TILE_LANES = 2048
#: split heads across programs until a launch has this many programs per SM (decode sizes)
_PROGRAMS_PER_SM = 4
_MAX_SPLITS = 8


@triton.jit
def _load_pairs(rows, head_ok, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                IS_NEOX: tl.constexpr):
    """The rotary lanes of heads ``rows`` (``[BLOCK_H, 1]`` pointers) as fp32 ``(x1, x2)``, each
    ``[BLOCK_H, BLOCK_HALF]`` (zero in masked lanes)."""
    if IS_NEOX:
        pair = tl.arange(0, BLOCK_HALF)[None, :]
        mask = head_ok[:, None] & (pair < HALF)
        x1 = tl.load(rows + pair, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(rows + HALF + pair, mask=mask, other=0.0).to(tl.float32)
    else:
        lane = tl.arange(0, 2 * BLOCK_HALF)[None, :]
        x = tl.load(rows + lane, mask=head_ok[:, None] & (lane < 2 * HALF), other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, [BLOCK_H, BLOCK_HALF, 2]))
    return x1, x2


@triton.jit
def _store_rotated(rows, head_ok, x1, x2, cos, sin, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   BLOCK_H: tl.constexpr, IS_NEOX: tl.constexpr):
    """``o1 = x1*cos - x2*sin``, ``o2 = x2*cos + x1*sin`` in fp32, stored back in the rows' dtype."""
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    dtype = rows.dtype.element_ty
    if IS_NEOX:
        pair = tl.arange(0, BLOCK_HALF)[None, :]
        mask = head_ok[:, None] & (pair < HALF)
        tl.store(rows + pair, o1.to(dtype), mask=mask)
        tl.store(rows + HALF + pair, o2.to(dtype), mask=mask)
    else:
        lane = tl.arange(0, 2 * BLOCK_HALF)[None, :]
        out = tl.reshape(tl.join(o1, o2), [BLOCK_H, 2 * BLOCK_HALF])
        tl.store(rows + lane, out.to(dtype), mask=head_ok[:, None] & (lane < 2 * HALF))


@triton.jit
def _rotate_heads(base, stride_h, h_begin, h_end, cos, sin, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, IS_NEOX: tl.constexpr):
    """Heads ``[h_begin, h_end)`` at ``base + h*stride_h``, ``BLOCK_H`` at a time."""
    for h0 in range(h_begin, h_end, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        rows = base + heads.to(tl.int64)[:, None] * stride_h
        x1, x2 = _load_pairs(rows, heads < h_end, HALF, BLOCK_HALF, BLOCK_H, IS_NEOX)
        _store_rotated(rows, heads < h_end, x1, x2, cos, sin, HALF, BLOCK_HALF, BLOCK_H, IS_NEOX)


@triton.jit
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, cache_ptr,
                   q_stride_t, q_stride_h, k_stride_t, k_stride_h, cache_stride,
                   num_q_heads, num_k_heads, q_heads_per_split, k_heads_per_split,
                   HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, SINGLE_TILE: tl.constexpr,
                   IS_NEOX: tl.constexpr, HAS_KEY: tl.constexpr):
    token = tl.program_id(0)
    split = tl.program_id(1)
    q_base = q_ptr + token.to(tl.int64) * q_stride_t
    k_base = k_ptr + token.to(tl.int64) * k_stride_t
    q_begin = split * q_heads_per_split
    q_end = tl.minimum(q_begin + q_heads_per_split, num_q_heads)
    k_begin = split * k_heads_per_split
    k_end = tl.minimum(k_begin + k_heads_per_split, num_k_heads)
    if SINGLE_TILE:
        # Every head of the slice fits one tile: issue the q and k loads before the position's,
        # so they overlap the position -> cos/sin dependency instead of waiting behind it.
        hq = q_begin + tl.arange(0, BLOCK_HQ)
        q_rows = q_base + hq.to(tl.int64)[:, None] * q_stride_h
        q1, q2 = _load_pairs(q_rows, hq < q_end, HALF, BLOCK_HALF, BLOCK_HQ, IS_NEOX)
        if HAS_KEY:
            hk = k_begin + tl.arange(0, BLOCK_HK)
            k_rows = k_base + hk.to(tl.int64)[:, None] * k_stride_h
            k1, k2 = _load_pairs(k_rows, hk < k_end, HALF, BLOCK_HALF, BLOCK_HK, IS_NEOX)

    pos = tl.load(pos_ptr + token).to(tl.int64)
    pair = tl.arange(0, BLOCK_HALF)
    cache_row = cache_ptr + pos * cache_stride
    # The cache is rounded to the query's dtype first, as the reference casts it.
    dtype = q_ptr.dtype.element_ty
    cos = tl.load(cache_row + pair, mask=pair < HALF, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(cache_row + HALF + pair, mask=pair < HALF, other=0.0).to(dtype).to(tl.float32)

    if SINGLE_TILE:
        _store_rotated(q_rows, hq < q_end, q1, q2, cos, sin, HALF, BLOCK_HALF, BLOCK_HQ, IS_NEOX)
        if HAS_KEY:
            _store_rotated(k_rows, hk < k_end, k1, k2, cos, sin, HALF, BLOCK_HALF, BLOCK_HK, IS_NEOX)
    else:
        _rotate_heads(q_base, q_stride_h, q_begin, q_end, cos, sin, HALF, BLOCK_HALF, BLOCK_HQ, IS_NEOX)
        if HAS_KEY:
            _rotate_heads(k_base, k_stride_h, k_begin, k_end, cos, sin, HALF, BLOCK_HALF, BLOCK_HK, IS_NEOX)


def _as_heads(x: torch.Tensor, num_tokens: int, head_size: int, what: str) -> torch.Tensor:
    """``[T, H*head_size]`` (or anything viewing as ``[T, -1, head_size]``) as a 3-D view of the
    same storage; the kernel writes through it, so a copy would lose the result."""
    heads = x.view(num_tokens, -1, head_size)
    if heads.stride(2) != 1:
        raise ValueError(f"rotary_embedding: {what} must have unit stride in the head dim, "
                         f"got strides {tuple(x.stride())}")
    return heads


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
                     head_size: int, cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    """Launcher for ``customop::rotary_embedding``: rotates ``query`` and ``key`` in place."""
    # The kernel reads position t at ``pos_ptr + t``: a 1-D view with another stride (an
    # ``expand``ed arange flattens to stride 0) would read past the tensor's storage, and the
    # garbage position then indexes past the cache (an illegal access on the GPU).
    positions = positions.reshape(-1).contiguous()
    num_tokens = positions.numel()
    rotary_dim = cos_sin_cache.shape[-1]
    if rotary_dim % 2 or rotary_dim > head_size:
        raise ValueError(f"rotary_embedding: cos_sin_cache width {rotary_dim} must be even and "
                         f"at most head_size {head_size}")
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    if num_tokens == 0:
        return
    q = _as_heads(query, num_tokens, head_size, "query")
    k = _as_heads(key, num_tokens, head_size, "key") if key is not None else q
    num_q, num_k = q.shape[1], (k.shape[1] if key is not None else 0)

    half = rotary_dim // 2
    block_half = triton.next_power_of_2(half)
    cfg = rotary_config(query.device, bool(is_neox))  # warps, forced head splits
    target_programs = _PROGRAMS_PER_SM * sm_count(query.device)
    splits = max(1, min(_MAX_SPLITS, num_q, max(cfg.min_splits, target_programs // num_tokens)))
    q_per_split = triton.cdiv(num_q, splits)
    k_per_split = triton.cdiv(num_k, splits) if num_k else 0
    max_heads = max(1, _TILE_LANES // block_half)
    block_hq = min(max_heads, triton.next_power_of_2(q_per_split))
    block_hk = min(max_heads, triton.next_power_of_2(max(k_per_split, 1)))
    with launch_device(query):
        _rotary_kernel[(num_tokens, splits)](
            positions, q, k, cos_sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
            num_q, num_k, q_per_split, k_per_split,
            HALF=half, BLOCK_HALF=block_half, BLOCK_HQ=block_hq, BLOCK_HK=block_hk,
            SINGLE_TILE=block_hq >= q_per_split and block_hk >= k_per_split,
            IS_NEOX=bool(is_neox), HAS_KEY=key is not None,
            num_warps=cfg.num_warps)


KERNELS = {"customop::rotary_embedding": rotary_embedding}
TUNING = {"customop::rotary_embedding": "rotary"}
