"""The attention family's math: multimodal encoder attention (``mm_encoder_attn``) as pure functions.

Encoder attention is bidirectional (no causal mask, no KV cache) over *packed* sequences: the
tokens of several images or windows sit one after another along the sequence dim, and
``cu_seqlens`` (``[0, l0, l0 + l1, ..., S]``) marks where each segment starts, so that attention
never crosses a segment boundary. The spec follows vLLM 0.33's SDPA path: split the sequence at
the segment boundaries, run ``F.scaled_dot_product_attention`` on each piece, concatenate. Grouped
query attention shares key/value head ``h // (Hq // Hkv)`` among query heads ``h`` (SDPA's
``enable_gqa``, the same grouping as ``repeat_interleave``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def segment_lengths(cu_seqlens: torch.Tensor, total: int, max_seqlen: int = 0) -> list[int]:
    """The segment lengths ``cu_seqlens`` describes over a sequence of ``total`` tokens, read to the
    host (a device sync for a device tensor); raises ``ValueError`` unless ``cu_seqlens`` starts at
    0, never decreases and ends at ``total``, and, when ``max_seqlen > 0``, unless no segment is
    longer than ``max_seqlen`` (a kernel sized by it would leave the rest of a longer one unwritten).
    Empty segments are allowed."""
    cu = cu_seqlens.tolist()
    if len(cu) < 2 or cu[0] != 0:
        raise ValueError(f"customop.mm_encoder_attn: cu_seqlens must start at 0 and hold at least one segment, "
                         f"got {cu[:8]}{'...' if len(cu) > 8 else ''}")
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    if any(n < 0 for n in lengths):
        i = next(i for i, n in enumerate(lengths) if n < 0)
        raise ValueError(f"customop.mm_encoder_attn: cu_seqlens must not decrease, but cu_seqlens[{i + 1}]="
                         f"{cu[i + 1]} < cu_seqlens[{i}]={cu[i]}")
    if cu[-1] != total:
        raise ValueError(f"customop.mm_encoder_attn: cu_seqlens ends at {cu[-1]}, but the sequence has {total} tokens")
    if max_seqlen > 0 and max(lengths) > max_seqlen:
        raise ValueError(f"customop.mm_encoder_attn: max_seqlen={max_seqlen} but a segment has {max(lengths)} tokens")
    return lengths


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Bidirectional attention of ``[B, S, H, D]`` tensors (key/value heads may divide H): SDPA in
    its ``[B, H, S, D]`` layout and back."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


def encoder_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      lengths: list[int] | None, scale: float) -> torch.Tensor:
    """The spec: ``[B, S, Hq, D]`` query and ``[B, S, Hkv, D]`` key/value; with ``lengths`` (the
    segment lengths, summing to S) attention runs on each segment of every batch row separately,
    without it over the whole row. Returns ``[B, S, Hq, D]`` in query's dtype."""
    if lengths is None:
        return sdpa(query, key, value, scale)
    pieces = zip(*(torch.split(t, lengths, dim=1) for t in (query, key, value)))
    return torch.cat([sdpa(q, k, v, scale) for q, k, v in pieces], dim=1)


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     cu_seqlens: torch.Tensor, max_seqlen: int, scale: float) -> torch.Tensor:
    """The packed form the ``customop::mm_encoder_attn`` op takes: ``[T, Hq, D]`` query,
    ``[T, Hkv, D]`` key/value, segments at ``cu_seqlens`` (validated, see ``segment_lengths``).
    Returns ``[T, Hq, D]``."""
    lengths = segment_lengths(cu_seqlens, query.shape[0], max_seqlen)
    return encoder_attention(query[None], key[None], value[None], lengths, scale)[0]
