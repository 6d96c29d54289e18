"""The CPU form of encoder attention (``mm_encoder_attn``'s ``forward_cpu``): the spec's segment
loop with every run of consecutive equal-length segments batched into one SDPA call.

Consecutive segments of one length are a ``[n * L, H, D]`` slice of the packed sequence, so
``reshape(n, L, H, D)`` is a view: no gather, no padding, and SDPA's CPU flash kernel gets ``n``
times the batch to spread over its threads. ViT encoders make such runs everywhere (windowed
attention's equal windows; images of one size). The arithmetic per segment is the spec's own, so
the result is bitwise the spec's; only the number of calls changes. Measured against the loop
(1.0-1.5x on one thread, up to 12x on two) and against one SDPA over the whole packed sequence
with a block-diagonal mask (``T^2`` work instead of ``sum(L_i^2)``: 1.7-10x slower than the loop
on one thread): benchmarks/results/cpu_attention.md.
"""

from __future__ import annotations

import itertools

import torch

from customop.math.attention import sdpa


def runs(lengths: list[int]) -> list[tuple[int, int]]:
    """``(length, count)`` for each run of consecutive equal lengths."""
    return [(length, len(list(group))) for length, group in itertools.groupby(lengths)]


def encoder_attention_by_runs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              lengths: list[int] | None, scale: float) -> torch.Tensor:
    """The spec (``customop.math.attention.encoder_attention``) on ``[B, S, H, D]`` tensors, one
    SDPA per run of equal segment lengths instead of one per segment."""
    if lengths is None:
        return sdpa(query, key, value, scale)
    batch = query.shape[0]
    outs, start = [], 0
    for length, count in runs(lengths):
        end = start + length * count
        # [B, n*L, H, D] -> [B*n, L, H, D]; a reshape of a slice, a view for contiguous rows
        pieces = (t[:, start:end].reshape(batch * count, length, *t.shape[2:]) for t in (query, key, value))
        outs.append(sdpa(*pieces, scale).reshape(batch, length * count, *query.shape[2:]))
        start = end
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
