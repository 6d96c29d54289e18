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
import itertools
from collections.abc import Callable

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

    @property
    def sizes(self) -> list[int]:
        """The int fields in order (``customop::mla_attention``'s ``dims``: ``MLADims(*sizes, scale)``)."""
        return [self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim, self.kv_lora_rank]


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


def prefill_attention(q: torch.Tensor, history: torch.Tensor, kv_b_weight: torch.Tensor, d: MLADims,
                      linear: Callable[..., torch.Tensor] = F.linear) -> torch.Tensor:
    """Up-projected causal attention: ``q`` ``[t, N, P + R]`` (the request's last ``t`` positions),
    ``history`` ``[L_ctx, L + R]`` -> ``[t, N, V]``. ``linear``: the up-projection's GEMM."""
    latent, k_pe = history[:, :d.kv_lora_rank], history[:, d.kv_lora_rank:]
    kv = linear(latent.to(q.dtype), kv_b_weight).view(-1, d.num_heads, d.qk_nope_head_dim + d.v_head_dim)
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
    mask = _causal(q.shape[0], rows.shape[0], q.device)
    o_latent = latent_attention(query, rows, d.kv_lora_rank, d.scale, mask)
    return torch.einsum("tnl,nlv->tnv", o_latent.to(q.dtype).float(), w_uv).to(q.dtype)


def latent_attention(query: torch.Tensor, rows: torch.Tensor, kv_lora_rank: int, scale: float,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """The absorbed attention itself, all fp32: ``query`` ``[t, N, L + R]`` against the latent
    rows ``[S, L + R]`` (``mask`` ``[t, S]`` bool: which rows each query sees) -> the latent output
    ``[t, N, L]``. Over no rows at all the output is zeros."""
    scores = torch.einsum("tnc,sc->tns", query, rows) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    return torch.einsum("tns,sl->tnl", scores.softmax(-1), rows[:, :kv_lora_rank])


def paged_latent_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """``customop::mla_decode``'s reference: one absorbed query per row ``b`` (``q_latent``
    ``[B, N, L]``, ``q_pe`` ``[B, N, R]``) over the first ``seq_lens[b]`` cache rows of
    ``block_table[b]`` -> the latent output ``[B, N, L]`` in q's dtype (fp32 scores and softmax;
    zeros where ``seq_lens[b]`` is 0)."""
    out = []  # rows stacked at the end, not written into a buffer (torch_xla drops such writes here)
    for b, length in enumerate(seq_lens.tolist()):
        if length <= 0:  # a softmax over nothing: zeros
            out.append(q_latent.new_zeros(q_latent.shape[1:]))
            continue
        rows = gather_history(kv_cache, block_table[b], length).float()
        query = torch.cat((q_latent[b], q_pe[b]), dim=-1).float()[None]
        out.append(latent_attention(query, rows, q_latent.shape[-1], scale)[0].to(q_latent.dtype))
    return torch.stack(out) if out else q_latent.new_zeros(q_latent.shape)


def absorbed_decode(q: torch.Tensor, kv_cache: torch.Tensor, meta: MLAMetadata, kv_b_weight: torch.Tensor, d: MLADims,
                    latent_decode) -> torch.Tensor:
    """The decode requests' tokens (``q`` ``[n, N, P + R]``, the batch's first ``n`` tokens) through
    ``latent_decode`` (``customop::mla_decode``'s signature): each token is its own row, seeing
    its request's positions up to its own (so a request with several decode tokens stays causal).
    The absorbed query is rounded to q's dtype (the latent op's input). -> ``[n, N, V]``."""
    w_uk, w_uv = absorbed_weights(kv_b_weight.float(), d)
    q_nope, q_pe = q.split([d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
    q_latent = torch.einsum("tnp,npl->tnl", q_nope.float(), w_uk).to(q.dtype)
    starts, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    request, visible = [], []
    for r in range(meta.num_decodes):
        q_len = starts[r + 1] - starts[r]
        request += [r] * q_len
        visible += range(lens[r] - q_len + 1, lens[r] + 1)
    table = meta.block_table[torch.tensor(request, dtype=torch.long, device=q.device)]
    seq_lens = torch.tensor(visible, dtype=torch.int32, device=q.device)
    o_latent = latent_decode(q_latent, q_pe.contiguous(), kv_cache, table, seq_lens, max(visible, default=0), d.scale)
    return torch.einsum("tnl,nlv->tnv", o_latent.float(), w_uv).to(q.dtype)


def span_rows(spans: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """The token indices of the ``[a, b)`` spans, in order."""
    return torch.cat([torch.arange(a, b, device=device) for a, b in spans])


def packed_prefill(q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, cache_dtype: torch.dtype,
                   spans: list[tuple[int, int]], kv_b_weight: torch.Tensor, d: MLADims, varlen_attn,
                   linear: Callable[..., torch.Tensor] = F.linear) -> torch.Tensor:
    """Prefill requests without cached context (``spans``: each one's tokens ``[a, b)`` of the
    batch, its whole history) through one causal ``varlen_attn`` (``customop::varlen_attn``'s
    signature) over their packed tokens, instead of one SDPA per request. Keys and values are
    up-projected from the batch's own latent rows, rounded through the cache's dtype as the spec's
    read-back of the same rows is (they are the rows ``write_cache`` wrote, where ``slot_mapping``
    and ``block_table`` agree, as the metadata's contract says). -> ``[sum(b - a), N, V]``.

    The varlen op takes one head dim for q, k and v (torch's flash varlen kernel requires it, and
    the Triton kernel keeps the op's contract), while MLA's values are narrower (DeepSeek: q/k
    ``P + R`` = 192, v ``V`` = 128): v is zero-padded to the q/k width and the output sliced back
    to ``V`` (zero lanes of v give zero output lanes, the scores are untouched), what serving
    stacks do for FlashAttention-2. Were ``V`` the wider, q and k would be zero-padded instead
    (zero lanes add nothing to the scores; the scale is passed explicitly)."""
    if all(b0 == a1 for (_, b0), (a1, _) in zip(spans, spans[1:])):
        pick = lambda t: t[spans[0][0]:spans[-1][1]]  # noqa: E731  (the usual batch: one slice, no gather)
    else:
        rows = span_rows(spans, q.device)
        pick = lambda t: t[rows]  # noqa: E731
    latent = pick(kv_c_normed).to(cache_dtype).to(q.dtype)
    rope = pick(k_pe.reshape(k_pe.shape[0], -1)).to(cache_dtype).to(q.dtype)
    kv = linear(latent, kv_b_weight).view(-1, d.num_heads, d.qk_nope_head_dim + d.v_head_dim)
    k_nope, v = kv.split([d.qk_nope_head_dim, d.v_head_dim], dim=-1)
    k = torch.cat((k_nope, rope[:, None, :].expand(-1, d.num_heads, -1)), dim=-1)
    query = pick(q)
    width = max(query.shape[-1], d.v_head_dim)
    query, k, v = (F.pad(t, (0, width - t.shape[-1])) if t.shape[-1] < width else t.contiguous() for t in (query, k, v))
    lengths = [b - a for a, b in spans]
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=q.device)
    out = varlen_attn(query, k, v, cu, max(lengths), d.scale, True)
    return out[..., :d.v_head_dim]


def mla_attention(q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                  meta: MLAMetadata, kv_b_weight: torch.Tensor, d: MLADims, latent_decode=None,
                  varlen_attn=None, linear: Callable[..., torch.Tensor] = F.linear) -> torch.Tensor:
    """Writes the batch's rows into ``kv_cache`` (in place), then attends: decode requests by
    absorption, prefill requests by up-projection, each over its whole history. ``q``
    ``[T, N, P + R]`` -> ``[T, N * V]`` in q's dtype. ``latent_decode`` (a kernel with
    ``customop::mla_decode``'s signature): the decode requests go through it, all at once
    (``absorbed_decode``), instead of the per-request spec. ``varlen_attn`` (a kernel with
    ``customop::varlen_attn``'s signature): the prefill requests without cached context go through
    it, all at once (``packed_prefill``); a prefill with cached context (chunked prefill) keeps
    the spec's up-projection of its history read from the cache. ``linear``: the prefills'
    up-projection GEMM (``F.linear``'s stand-in: ``forward_cpu`` passes ``cpu_linear``)."""
    write_cache(kv_cache, meta.slot_mapping, kv_c_normed, k_pe)
    out = q.new_zeros(q.shape[0], d.num_heads, d.v_head_dim)
    starts, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    first = 0
    if latent_decode is not None and meta.num_decodes:
        first, n = meta.num_decodes, starts[meta.num_decodes]
        if n:
            out[:n] = absorbed_decode(q[:n], kv_cache, meta, kv_b_weight, d, latent_decode)
    packed = set()
    if varlen_attn is not None:
        packed = {r for r in range(meta.num_decodes, len(lens)) if lens[r] == starts[r + 1] - starts[r] > 0}
        if packed:
            spans = [(starts[r], starts[r + 1]) for r in sorted(packed)]
            result = packed_prefill(q, kv_c_normed, k_pe, kv_cache.dtype, spans, kv_b_weight, d, varlen_attn, linear)
            out.index_copy_(0, span_rows(spans, q.device), result)
    for r, length in enumerate(lens):
        a, b = starts[r], starts[r + 1]
        if a == b or r < first or r in packed:
            continue
        history = gather_history(kv_cache, meta.block_table[r], length)
        if r < meta.num_decodes:
            out[a:b] = decode_attention(q[a:b], history, kv_b_weight, d)
        else:
            out[a:b] = prefill_attention(q[a:b], history, kv_b_weight, d, linear)
    return out.reshape(q.shape[0], -1)
