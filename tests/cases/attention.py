"""Float64 references of the attention table (``customop/samples/attention.py``): per segment, the
textbook ``softmax(q k^T * scale) v`` with every key/value head repeated for its query heads,
written from the formula (explicit exponentials, no SDPA, no ``customop.math``). Every tier
judges its path with them.
"""

from __future__ import annotations

import torch

from customop.samples.attention import AttentionCase, Packing


def ref_segment(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One segment: ``q [L, Hq, D]``, ``k``/``v`` ``[L, Hkv, D]`` -> ``[L, Hq, D]`` in float64.
    Query head ``h`` reads key/value head ``h // (Hq // Hkv)``."""
    if q.shape[0] == 0:  # an empty segment
        return q.double()
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))
    weights = weights / weights.sum(-1, keepdim=True)
    return torch.einsum("hqk,khd->qhd", weights, v)


def ref_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], scale: float) -> torch.Tensor:
    """Packed ``[T, H, D]`` tensors, segments of ``lengths``: float64 ``[T, Hq, D]``."""
    out, start = [], 0
    for length in lengths:
        out.append(ref_segment(q[start:start + length], k[start:start + length], v[start:start + length], scale))
        start += length
    return torch.cat(out) if out else q.double().new_empty(q.shape)


def reference(case: AttentionCase, op, packing: Packing, q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> torch.Tensor:
    """The float64 output of ``case``'s op (built by ``case.build``) on ``packing``'s inputs, in
    the inputs' layout."""
    lengths = list(packing.lengths) if packing.lengths is not None else [packing.tokens]
    rows = [ref_packed(q[b].reshape(packing.tokens, op.num_heads, op.head_size),
                       k[b].reshape(packing.tokens, op.num_kv_heads, op.head_size),
                       v[b].reshape(packing.tokens, op.num_kv_heads, op.head_size), lengths, op.scale)
            for b in range(packing.batch)]
    return torch.stack(rows).reshape(q.shape)


# ---- rel_pos_attention ------------------------------------------------------------------------------


def ref_resize(table: torch.Tensor, length: int) -> torch.Tensor:
    """Linear resampling of ``[L, C]`` rows to ``length`` rows, half-pixel centres (what
    ``align_corners=False`` means), written out in float64."""
    table = table.double()
    if table.shape[0] == length:
        return table
    ratio = table.shape[0] / length
    rows = []
    for i in range(length):
        src = max((i + 0.5) * ratio - 0.5, 0.0)
        lo = min(int(src), table.shape[0] - 1)
        hi = min(lo + 1, table.shape[0] - 1)
        rows.append((1 - (src - lo)) * table[lo] + (src - lo) * table[hi])
    return torch.stack(rows)


def ref_rel_pos_attention(op, x: torch.Tensor) -> torch.Tensor:
    """``RelPosAttention`` in float64 with an explicit ``[H*W, H*W]`` bias per (batch, head):
    ``bias[(h, w), (h', w')] = q . Rh[h - h' + H - 1] + q . Rw[w - w' + W - 1]`` with the tables
    resized to ``2H - 1`` and ``2W - 1`` rows. Rounded to x's dtype where the spec stores a result
    in it: the qkv projection, the resized tables, each axis' bias term and their sum, the
    attention output."""
    dtype = x.dtype
    rnd = (lambda t: t.to(dtype).double())  # noqa: E731
    b, height, width, dim = x.shape
    heads, hd, tokens = op.num_heads, op.head_dim, height * width
    w, bias = op.qkv.weight.double(), None if op.qkv.bias is None else op.qkv.bias.double()
    qkv = rnd(x.double().reshape(b, tokens, dim) @ w.t() + (0 if bias is None else bias))
    q, k, v = (qkv[..., i * dim:(i + 1) * dim].reshape(b, tokens, heads, hd).transpose(1, 2) for i in range(3))
    scores = (q @ k.transpose(-1, -2)) * hd ** -0.5  # [B, heads, T, T]
    if op.use_rel_pos:
        # the spec stores each axis' term, then their sum, in x's dtype
        table_h = rnd(ref_resize(op.rel_pos_h, 2 * height - 1))
        table_w = rnd(ref_resize(op.rel_pos_w, 2 * width - 1))
        pos_h, pos_w = torch.arange(tokens) // width, torch.arange(tokens) % width
        rel_h = rnd(torch.einsum("bnic,ikc->bnik", q, table_h[pos_h[:, None] - torch.arange(height)[None, :] + height - 1]))
        rel_w = rnd(torch.einsum("bnic,ikc->bnik", q, table_w[pos_w[:, None] - torch.arange(width)[None, :] + width - 1]))
        bias = rnd(rel_h[..., pos_h] + rel_w[..., pos_w])  # [B, heads, T, T]: key (h', w') = (pos_h, pos_w)
        scores = scores + bias
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))
    out = rnd((weights / weights.sum(-1, keepdim=True)) @ v)  # [B, heads, T, hd]
    out = out.transpose(1, 2).reshape(b, height, width, dim)
    return out @ op.proj.weight.double().t() + op.proj.bias.double()
