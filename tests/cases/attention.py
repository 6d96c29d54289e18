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
