"""The CPU form of MLA's absorbed decode (``multi_head_latent_attention``'s ``forward_cpu``): the
decode rows' latent attention, with ``customop::mla_decode``'s signature, walked one row at a
time over whole cache blocks.

Per decode request the spec (``customop.math.mla.decode_attention``) casts ``kv_b_proj``'s weight
to fp32 and splits it, gathers the request's history position by position (an advanced index with
two index tensors: ``aten::index``, the slowest copy on this CPU) and runs three einsums that copy
the latent rows into the layouts they want. ``forward_cpu`` instead absorbs the weights once for
the batch (``absorbed_decode``, as ``forward_kernel`` does), and this function gathers a row's
history by block ids (``index_select``: one contiguous copy per block) and runs the scores and the
output as two ``mm`` over the fp32 rows as gathered (the transposed operand is a BLAS flag, not a
copy). Scores, softmax and the latent output stay fp32, as in the spec.

The rows are walked one at a time, not padded into one ``[B, S, L + R]`` batch: at 8 x 4096
positions that batch is 38 MB in bf16 (75 MB in fp32), fresh memory above glibc's mmap threshold
on every call, and its page faults cost more than the loop saves (one thread's CPU time, the
attention alone, medians, bf16: the spec 84-106 ms, padded in fp32 147 ms, padded with bf16
``bmm`` 98 ms, one SDPA with the heads as query rows 255 ms, this loop 46 ms). Layer timings:
benchmarks/results/cpu_mla.md.
"""

from __future__ import annotations

import torch


def latent_decode_by_rows(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                          block_table: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                          scale: float) -> torch.Tensor:
    """``customop::mla_decode``'s contract (``customop/ops/_library/mla.py``): row ``b``'s query
    (``q_latent`` ``[B, N, L]``, ``q_pe`` ``[B, N, R]``) over the first ``seq_lens[b]`` cache rows of
    ``block_table[b]`` -> ``[B, N, L]`` in q's dtype; fp32 scores and softmax; zeros where
    ``seq_lens[b]`` is 0. ``max_seq_len`` is not needed (the lengths are read on the host)."""
    block_size, rank = kv_cache.shape[1], q_latent.shape[-1]
    query = torch.cat((q_latent, q_pe), dim=-1).float()
    out = q_latent.new_zeros(q_latent.shape)
    for b, length in enumerate(seq_lens.tolist()):
        if length <= 0:  # a softmax over nothing: zeros
            continue
        blocks = block_table[b, :-(-length // block_size)].long()
        rows = kv_cache.index_select(0, blocks).flatten(0, 1)[:length].float()  # [length, L + R]
        scores = torch.mm(query[b], rows.t()).mul_(scale)
        out[b] = torch.mm(scores.softmax(-1), rows[:, :rank])
    return out
