"""The attention family's math as pure functions: multimodal encoder attention (``mm_encoder_attn``)
and SAM/ViTDet attention with decomposed relative positions (``rel_pos_attention``, below).

Encoder attention is bidirectional (no causal mask, no KV cache) over *packed* sequences: the
tokens of several images or windows sit one after another along the sequence dim, and
``cu_seqlens`` (``[0, l0, l0 + l1, ..., S]``) marks where each segment starts, so that attention
never crosses a segment boundary. The spec follows vLLM 0.33's SDPA path: split the sequence at
the segment boundaries, run ``F.scaled_dot_product_attention`` on each piece, concatenate. Grouped
query attention shares key/value head ``h // (Hq // Hkv)`` among query heads ``h`` (SDPA's
``enable_gqa``, the same grouping as ``repeat_interleave``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def segment_lengths(cu_seqlens: torch.Tensor, total: int, max_seqlen: int = 0, op: str = "mm_encoder_attn") -> list[int]:
    """The segment lengths ``cu_seqlens`` describes over a sequence of ``total`` tokens, read to the
    host (a device sync for a device tensor); raises ``ValueError`` unless ``cu_seqlens`` starts at
    0, never decreases and ends at ``total``, and, when ``max_seqlen > 0``, unless no segment is
    longer than ``max_seqlen`` (a kernel sized by it would leave the rest of a longer one unwritten).
    Empty segments are allowed. ``op`` names the op in the messages."""
    cu = cu_seqlens.tolist()
    if len(cu) < 2 or cu[0] != 0:
        raise ValueError(f"customop.{op}: cu_seqlens must start at 0 and hold at least one segment, "
                         f"got {cu[:8]}{'...' if len(cu) > 8 else ''}")
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    if any(n < 0 for n in lengths):
        i = next(i for i, n in enumerate(lengths) if n < 0)
        raise ValueError(f"customop.{op}: cu_seqlens must not decrease, but cu_seqlens[{i + 1}]="
                         f"{cu[i + 1]} < cu_seqlens[{i}]={cu[i]}")
    if cu[-1] != total:
        raise ValueError(f"customop.{op}: cu_seqlens ends at {cu[-1]}, but the sequence has {total} tokens")
    if max_seqlen > 0 and max(lengths) > max_seqlen:
        raise ValueError(f"customop.{op}: max_seqlen={max_seqlen} but a segment has {max(lengths)} tokens")
    return lengths


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
         causal: bool = False) -> torch.Tensor:
    """Bidirectional (``causal``: query ``i`` sees keys ``0..i``) attention of ``[B, S, H, D]``
    tensors (key/value heads may divide H): SDPA in its ``[B, H, S, D]`` layout and back."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


def encoder_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      lengths: list[int] | None, scale: float, causal: bool = False) -> torch.Tensor:
    """The spec: ``[B, S, Hq, D]`` query and ``[B, S, Hkv, D]`` key/value; with ``lengths`` (the
    segment lengths, summing to S) attention runs on each segment of every batch row separately,
    without it over the whole row. Returns ``[B, S, Hq, D]`` in query's dtype. ``causal`` (not
    encoder attention: ``customop::varlen_attn``'s flag): token ``i`` of a segment sees its
    tokens ``0..i`` only."""
    if lengths is None:
        return sdpa(query, key, value, scale, causal)
    pieces = zip(*(torch.split(t, lengths, dim=1) for t in (query, key, value)))
    return torch.cat([sdpa(q, k, v, scale, causal) for q, k, v in pieces], dim=1)


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     cu_seqlens: torch.Tensor, max_seqlen: int, scale: float, causal: bool = False,
                     op: str = "mm_encoder_attn") -> torch.Tensor:
    """The packed form the ``customop::mm_encoder_attn`` op (and, with ``causal``,
    ``customop::varlen_attn``) takes: ``[T, Hq, D]`` query, ``[T, Hkv, D]`` key/value, segments
    at ``cu_seqlens`` (validated, see ``segment_lengths``). Returns ``[T, Hq, D]``."""
    lengths = segment_lengths(cu_seqlens, query.shape[0], max_seqlen, op)
    return encoder_attention(query[None], key[None], value[None], lengths, scale, causal)[0]


# ---- rel_pos_attention: SAM / ViTDet attention with decomposed relative positions ------------------


def get_rel_pos(q_size: int, k_size: int, rel_pos: torch.Tensor) -> torch.Tensor:
    """``[q_size, k_size, C]``: the row of the position table ``rel_pos`` (``[L, C]``) for every
    (query, key) offset along one axis. A table whose length is not ``2 * max(q_size, k_size) - 1``
    is first resized to that length by linear interpolation (in fp32, ``align_corners=False``, cast
    back), so a model trained at one resolution runs at another. Unequal sizes stretch the shorter
    axis' coordinates to the longer one's."""
    length = 2 * max(q_size, k_size) - 1
    if rel_pos.shape[0] != length:
        resized = F.interpolate(rel_pos.float().t()[None], size=length, mode="linear")[0]
        rel_pos = resized.t().to(rel_pos.dtype)
    q_coords = torch.arange(q_size, device=rel_pos.device)[:, None] * max(k_size / q_size, 1.0)
    k_coords = torch.arange(k_size, device=rel_pos.device)[None, :] * max(q_size / k_size, 1.0)
    offsets = (q_coords - k_coords) + (k_size - 1) * max(q_size / k_size, 1.0)
    return rel_pos[offsets.long()]


def decomposed_rel_pos_terms(q: torch.Tensor, rel_pos_h: torch.Tensor, rel_pos_w: torch.Tensor,
                             height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two terms of the bias of ``q`` (``[N, H * W, C]``, unscaled): ``rel_h[n, h, w, kh] =
    q[n, h, w] . Rh[h, kh]`` (``[N, H, W, H]``) and ``rel_w[n, h, w, kw] = q[n, h, w] . Rw[w, kw]``
    (``[N, H, W, W]``), in q's dtype."""
    n, _, c = q.shape
    r_q = q.reshape(n, height, width, c)
    rel_h = torch.einsum("bhwc,hkc->bhwk", r_q, get_rel_pos(height, height, rel_pos_h))
    rel_w = torch.einsum("bhwc,wkc->bhwk", r_q, get_rel_pos(width, width, rel_pos_w))
    return rel_h, rel_w


def decomposed_rel_pos_bias(q: torch.Tensor, rel_pos_h: torch.Tensor, rel_pos_w: torch.Tensor,
                            height: int, width: int) -> torch.Tensor:
    """The additive attention bias of ``q`` (``[N, H * W, C]``, unscaled) over an ``H x W`` grid of
    keys: ``bias[n, (h, w), (kh, kw)] = q[n, h, w] . Rh[h, kh] + q[n, h, w] . Rw[w, kw]``, as
    ``[N, H * W, H * W]`` in q's dtype."""
    rel_h, rel_w = decomposed_rel_pos_terms(q, rel_pos_h, rel_pos_w, height, width)
    return (rel_h[..., :, None] + rel_w[..., None, :]).reshape(q.shape[0], height * width, height * width)


def rel_pos_attention(x: torch.Tensor, qkv_weight: torch.Tensor, qkv_bias: torch.Tensor | None,
                      proj_weight: torch.Tensor, proj_bias: torch.Tensor | None, num_heads: int,
                      rel_pos_h: torch.Tensor | None = None, rel_pos_w: torch.Tensor | None = None) -> torch.Tensor:
    """The spec of ``rel_pos_attention`` (vLLM 0.33's SDPA path): ``x`` ``[B, H, W, dim]`` ->
    ``[B, H, W, dim]``. One qkv projection, multi-head attention over the ``H * W`` tokens with
    scale ``head_dim ** -0.5`` and, when the tables are given, the decomposed relative-position
    bias added to the scaled scores (the bias itself is not scaled), then the output projection."""
    batch, height, width, _ = x.shape
    tokens = height * width
    qkv = F.linear(x, qkv_weight, qkv_bias).reshape(batch, tokens, 3, num_heads, -1).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)  # [B, heads, H * W, head_dim]
    bias = None
    if rel_pos_h is not None:
        flat = q.reshape(batch * num_heads, tokens, -1)
        bias = decomposed_rel_pos_bias(flat, rel_pos_h, rel_pos_w, height, width).view(batch, num_heads, tokens, tokens)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    out = out.view(batch, num_heads, height, width, -1).permute(0, 2, 3, 1, 4).reshape(batch, height, width, -1)
    return F.linear(out, proj_weight, proj_bias)


def rel_pos_attention_blocked(x: torch.Tensor, qkv_weight: torch.Tensor, qkv_bias: torch.Tensor | None,
                              proj_weight: torch.Tensor, proj_bias: torch.Tensor | None, num_heads: int,
                              rel_pos_h: torch.Tensor | None = None, rel_pos_w: torch.Tensor | None = None,
                              block: int = 1 << 22, narrow_add_below: int = 0,
                              linear: Callable[..., torch.Tensor] = F.linear) -> torch.Tensor:
    """``rel_pos_attention``'s arithmetic (every value the spec computes, computed the same way),
    with the bias built contiguous and in blocks of at most ``block`` entries, one SDPA per block.

    The spec's bias comes out of the broadcast add in the (permuted) layout of its terms, so its
    ``reshape`` copies all ``B * heads * (H * W) ** 2`` entries once more, and both full-size
    tensors are fresh memory on every call (page faults on the CPU: 800 MB per 64 x 64 fp32 image).
    Here the terms are made contiguous first (``B * heads * H * W * (H + W)`` entries), and each
    block of query rows (whole images, else groups of heads, else grid rows of queries) gets its
    own slice of the bias, built right before its SDPA call reads it. Query rows are independent
    in attention, so blocking changes no formula: one block is bitwise the spec; several may round
    differently in the last bit where SDPA's kernel blocks a shorter query run differently (seen
    at fp32/fp16 toy sizes; bitwise at the SAM shapes of benchmarks/results/cpu_rel_pos.md).

    ``narrow_add_below``: for grids narrower than this, each block's bias is added with the query
    positions innermost (the terms transposed, the sum transposed back into the same contiguous
    layout): the same additions, bitwise, where the plain broadcast add's innermost dim is the
    grid width, which ATen's CPU loop runs ``W`` elements at a time (13 ms for the
    25 x 12 x 196 x 196 bf16 bias of SAM's 14 x 14 windows, against 5.5 ms this way).

    ``linear``: the qkv and output projections' GEMM, ``F.linear``'s signature (a platform's
    faster GEMM: the CPU path passes ``customop.ops.linear.cpu_linear``)."""
    batch, height, width, _ = x.shape
    tokens = height * width
    qkv = linear(x, qkv_weight, qkv_bias).reshape(batch, tokens, 3, num_heads, -1).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)  # [B, heads, H * W, head_dim]
    if rel_pos_h is None:
        out = F.scaled_dot_product_attention(q, k, v)
    else:
        flat = q.reshape(batch * num_heads, tokens, -1)
        rel_h, rel_w = (t.contiguous().view(batch, num_heads, height, width, -1)
                        for t in decomposed_rel_pos_terms(flat, rel_pos_h, rel_pos_w, height, width))
        per_row = max(1, width * tokens)  # bias entries of one grid row of queries, one head
        rows = min(height, max(1, block // per_row))
        heads = min(num_heads, max(1, block // (rows * per_row))) if rows == height else 1
        images = min(batch, max(1, block // (num_heads * height * per_row))) if heads == num_heads else 1
        # SDPA's output layout ([B, H * W, heads, C] in memory), so the permute below is a view
        out = q.new_empty(batch, tokens, num_heads, q.shape[-1]).transpose(1, 2)
        for b in range(0, batch, images):
            for h in range(0, num_heads, heads):
                for r in range(0, height, rows):
                    i, j, s = slice(b, b + images), slice(h, h + heads), slice(r * width, (r + rows) * width)
                    if width < narrow_add_below:
                        # [.., kh, queries] + [.., kw, queries]: the add's inner loop runs over the queries
                        th = rel_h[i, j, r:r + rows].flatten(2, 3).transpose(-1, -2).contiguous()
                        tw = rel_w[i, j, r:r + rows].flatten(2, 3).transpose(-1, -2).contiguous()
                        bias = (th[..., :, None, :] + tw[..., None, :, :]).flatten(2, 3).transpose(-1, -2)
                        bias = bias.contiguous()  # [.., queries, keys], as below
                    else:
                        bias = rel_h[i, j, r:r + rows, :, :, None] + rel_w[i, j, r:r + rows, :, None, :]
                        bias = bias.reshape(*bias.shape[:2], -1, tokens)  # a view: the add's output is contiguous
                    out[i, j, s] = F.scaled_dot_product_attention(q[i, j, s], k[i, j], v[i, j], attn_mask=bias)
    out = out.view(batch, num_heads, height, width, -1).permute(0, 2, 3, 1, 4).reshape(batch, height, width, -1)
    return linear(out, proj_weight, proj_bias)
