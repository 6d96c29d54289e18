"""The MLA family's math: DeepSeek-V2/V3 multi-head latent attention over a paged latent cache
(``multi_head_latent_attention``), as pure functions.

Each token stores one cache row ``[kv_lora_rank + rope_dim]``: its normalised latent ``kv_c`` and
its rotated rope key ``k_pe``, shared by all heads. A head's key is ``[k_nope | k_pe]`` with
``k_nope = W_UK kv_c`` and its value ``W_UV kv_c``, where ``W_UK``/``W_UV`` are the two parts of
``kv_b_proj`` (``[N * (P + V), L]``, per head ``P`` rows then ``V`` rows). Two equal ways to
attend:

- **prefill** (many queries per request): up-project the request's latent history into per-head
  keys and values, then causal attention;
- **decode** (few queries, long history): absorb ``W_UK`` into the query, ``(q_nope W_UK) . kv_c =
  q_nope . (W_UK kv_c)``, attend over the latent rows themselves (one "head" for all), and apply
  ``W_UV`` to the latent output. Nothing per-head is ever built from the cache.

A query at position ``p`` sees the request's keys at positions ``0..p``. The cache is
``[num_blocks, block_size, L + R]``; position ``p`` of request ``r`` lives in block
``block_table[r, p // block_size]`` at offset ``p % block_size``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class MLAMetadata:
    """One batch's layout. Tokens are ``[decode tokens | prefill tokens]``, grouped by request in
    ``query_start_loc`` order; the first ``num_decodes`` requests are decodes.

    Attributes:
        slot_mapping: ``[T]`` int, the cache slot (``block * block_size + offset``) each token's row
            is written to; negative: not written (padding).
        block_table: ``[R, max_blocks]`` int32, each request's cache blocks in position order.
        seq_lens: ``[R]`` int, each request's context length after this step (its new tokens
            included, as the last ``query_len`` positions).
        query_start_loc: ``[R + 1]`` int, the request's tokens in the batch.
        num_decodes: how many of the requests (the first ones) take the decode path.
    """

    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    num_decodes: int = 0

    @property
    def num_decode_tokens(self) -> int:
        return int(self.query_start_loc[self.num_decodes])


@dataclasses.dataclass(frozen=True)
class MLADims:
    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int
    scale: float


def write_cache(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_c_normed: torch.Tensor,
                k_pe: torch.Tensor) -> None:
    """In place: ``kv_cache`` row ``slot_mapping[t]`` <- ``[kv_c_normed[t] | k_pe[t]]`` (cast to the
    cache's dtype) for every token with a non-negative slot."""
    keep = slot_mapping >= 0
    rows = torch.cat((kv_c_normed, k_pe.reshape(k_pe.shape[0], -1)), dim=-1)[keep].to(kv_cache.dtype)
    kv_cache.view(-1, kv_cache.shape[-1]).index_copy_(0, slot_mapping[keep].long(), rows)


def gather_history(kv_cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` cache rows of one request (``blocks``: its block-table row), ``[length, L + R]``."""
    block_size = kv_cache.shape[1]
    pos = torch.arange(length, device=kv_cache.device)
    return kv_cache[blocks[pos // block_size].long(), pos % block_size]


def _causal(q_len: int, length: int, device: torch.device) -> torch.Tensor:
    """``[q_len, length]`` bool: the queries are the last ``q_len`` positions of ``length``."""
    q_pos = torch.arange(length - q_len, length, device=device)[:, None]
    return torch.arange(length, device=device)[None, :] <= q_pos


def prefill_attention(q: torch.Tensor, history: torch.Tensor, kv_b_weight: torch.Tensor, d: MLADims) -> torch.Tensor:
    """Up-projected causal attention: ``q`` ``[t, N, P + R]`` (the request's last ``t`` positions),
    ``history`` ``[L_ctx, L + R]`` -> ``[t, N, V]``."""
    latent, k_pe = history[:, :d.kv_lora_rank], history[:, d.kv_lora_rank:]
    kv = F.linear(latent.to(q.dtype), kv_b_weight).view(-1, d.num_heads, d.qk_nope_head_dim + d.v_head_dim)
    k_nope, v = kv.split([d.qk_nope_head_dim, d.v_head_dim], dim=-1)
    k = torch.cat((k_nope, k_pe.to(q.dtype)[:, None, :].expand(-1, d.num_heads, -1)), dim=-1)
    mask = _causal(q.shape[0], history.shape[0], q.device)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                         scale=d.scale)
    return out.transpose(0, 1)


def absorbed_weights(kv_b_weight: torch.Tensor, d: MLADims) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_UK [N, P, L], W_UV [N, L, V])`` from ``kv_b_proj``'s ``[N * (P + V), L]`` weight."""
    w = kv_b_weight.view(d.num_heads, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank)
    w_uk, w_uv = w.split([d.qk_nope_head_dim, d.v_head_dim], dim=1)
    return w_uk, w_uv.transpose(1, 2)


def decode_attention(q: torch.Tensor, history: torch.Tensor, kv_b_weight: torch.Tensor, d: MLADims) -> torch.Tensor:
    """Absorbed attention over the latent rows: ``q`` ``[t, N, P + R]`` -> ``[t, N, V]``. Scores,
    softmax and the latent output in fp32, rounded to q's dtype before ``W_UV``."""
    w_uk, w_uv = absorbed_weights(kv_b_weight.float(), d)
    q_nope, q_pe = q.float().split([d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
    query = torch.cat((torch.einsum("tnp,npl->tnl", q_nope, w_uk), q_pe), dim=-1)  # [t, N, L + R]
    rows = history.float()
    scores = torch.einsum("tnc,sc->tns", query, rows) * d.scale
    scores = scores.masked_fill(~_causal(q.shape[0], rows.shape[0], q.device)[:, None, :], float("-inf"))
    o_latent = torch.einsum("tns,sl->tnl", scores.softmax(-1), rows[:, :d.kv_lora_rank])
    return torch.einsum("tnl,nlv->tnv", o_latent.to(q.dtype).float(), w_uv).to(q.dtype)


def mla_attention(q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                  meta: MLAMetadata, kv_b_weight: torch.Tensor, d: MLADims) -> torch.Tensor:
    """Writes the batch's rows into ``kv_cache`` (in place), then attends: decode requests by
    absorption, prefill requests by up-projection, each over its whole history. ``q``
    ``[T, N, P + R]`` -> ``[T, N * V]`` in q's dtype."""
    write_cache(kv_cache, meta.slot_mapping, kv_c_normed, k_pe)
    out = q.new_zeros(q.shape[0], d.num_heads, d.v_head_dim)
    starts, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    for r, length in enumerate(lens):
        a, b = starts[r], starts[r + 1]
        if a == b:
            continue
        history = gather_history(kv_cache, meta.block_table[r], length)
        attend = decode_attention if r < meta.num_decodes else prefill_attention
        out[a:b] = attend(q[a:b], history, kv_b_weight, d)
    return out.reshape(q.shape[0], -1)
