"""Float64 reference of ``MultiHeadLatentAttentionWrapper`` (``customop/samples/mla.py``): DeepSeek MLA
written from the formulas as plain multi-head attention (every head's keys and values up-projected
from the latent history, never the absorbed form), GPT-J RoPE on interleaved pairs from the module's
cos/sin table, RMSNorm, with no customop op or math. Returns the output and the cache rows the batch
must have written.
"""

from __future__ import annotations

import torch


def _rms(x: torch.Tensor, norm) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.double()


def _rope(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """GPT-J rotation of the last dim of ``x`` (``[T, ..., R]``): pairs ``(2i, 2i + 1)``."""
    half = table.shape[-1] // 2
    rows = table.double()[positions.long()]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = rows[:, :half].reshape(shape), rows[:, half:].reshape(shape)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)


def reference(op, positions: torch.Tensor, hidden: torch.Tensor, cache_before: torch.Tensor, meta,
              llama_4_scaling: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output [T, hidden], written rows [T, L + R])`` in float64."""
    w = lambda layer: layer.weight.double()  # noqa: E731
    n, p, r, v, rank = op.num_heads, op.qk_nope_head_dim, op.qk_rope_head_dim, op.v_head_dim, op.kv_lora_rank
    h = hidden.double()
    if op.q_lora_rank is not None:
        fused = h @ w(op.fused_qkv_a_proj).t()
        q = _rms(fused[:, :op.q_lora_rank], op.q_a_layernorm) @ w(op.q_b_proj).t()
        kv_lora = fused[:, op.q_lora_rank:]
    else:
        q, kv_lora = h @ w(op.q_proj).t(), h @ w(op.kv_a_proj_with_mqa).t()
    q = q.view(-1, n, p + r)
    table = op.rotary_emb.cos_sin_cache
    q = torch.cat((q[..., :p], _rope(q[..., p:], positions, table)), dim=-1)
    if llama_4_scaling is not None:
        q = q * llama_4_scaling.double()
    rows = torch.cat((_rms(kv_lora[:, :rank], op.kv_a_layernorm), _rope(kv_lora[:, rank:], positions, table)), dim=-1)

    block_size = cache_before.shape[1]
    starts, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    w_kvb = w(op.kv_b_proj).view(n, p + v, rank)
    out = torch.zeros(h.shape[0], n, v, dtype=torch.float64)
    for req, length in enumerate(lens):
        a, b = starts[req], starts[req + 1]
        blocks = meta.block_table[req].tolist()
        cached = length - (b - a)
        history = torch.stack([cache_before[blocks[i // block_size], i % block_size].double() for i in range(cached)]
                              + [rows[t] for t in range(a, b)])  # [length, L + R]
        latent, k_pe = history[:, :rank], history[:, rank:]
        k_nope = torch.einsum("sl,npl->snp", latent, w_kvb[:, :p])
        values = torch.einsum("sl,nvl->snv", latent, w_kvb[:, p:])
        keys = torch.cat((k_nope, k_pe[:, None, :].expand(-1, n, -1)), dim=-1)
        for t in range(a, b):
            pos = cached + t - a
            scores = torch.einsum("nc,snc->ns", q[t], keys[:pos + 1]) * op.dims.scale
            out[t] = torch.einsum("ns,snv->nv", scores.softmax(-1), values[:pos + 1])
    return out.reshape(h.shape[0], n * v) @ w(op.o_proj).t(), rows
