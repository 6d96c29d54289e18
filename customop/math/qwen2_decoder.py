"""The qwen2_decoder family's math: the attention mask of DeepSeek-OCR-2's Qwen2 vision decoder.

The decoder runs a Qwen2 stack over image tokens and learned query tokens, told apart by
``token_type_ids`` (0 = image, 1 = query; vLLM's encoder puts ``n = S // 2`` image tokens first,
the default here when no types are given). Every image and query token sees every image token
(the image tokens attend bidirectionally among themselves and never to the queries); a query
token also sees the queries up to itself (causal).
The rest of the stack is standard Qwen2 (RMSNorm, GQA with RoPE, SwiGLU), built from customop's
own ops in ``customop/ops/qwen2_decoder.py``.
"""

from __future__ import annotations

import torch


def half_split_types(batch: int, seq_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The layout vLLM's encoder builds (``n = S // 2`` image tokens, then the queries) as
    ``token_type_ids`` ``[B, S]``: 0 = image (bidirectional), 1 = query (causal)."""
    return (torch.arange(seq_len, device=device) >= seq_len // 2).long().expand(batch, seq_len)


def allowed_by_type(token_type_ids: torch.Tensor) -> torch.Tensor:
    """``[B, S, S]`` bool: ``allowed[b, i, j]`` when token ``i`` may attend to token ``j``:
    ``j`` is an image token (type 0) and ``i`` an image or query token, or both are query tokens
    (type 1) with ``j <= i``. A token of any other type attends to nothing and is seen by nothing
    (vLLM's rule: its row stays fully masked)."""
    image, query = token_type_ids == 0, token_type_ids == 1
    s = token_type_ids.shape[-1]
    idx = torch.arange(s, device=token_type_ids.device)
    causal = idx[None, :] <= idx[:, None]  # [S, S]: j <= i
    return ((image | query)[:, :, None] & image[:, None, :]) | (query[:, :, None] & query[:, None, :] & causal)


def allowed(seq_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[S, S]`` bool for the half split: ``j < n`` or ``n <= j <= i`` with ``n = S // 2``."""
    return allowed_by_type(half_split_types(1, seq_len, device))[0]


def additive_mask(seq_len: int, dtype: torch.dtype, device: torch.device | str | None = None,
                  attention_mask: torch.Tensor | None = None,
                  token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The SDPA mask, built as vLLM builds it: the dtype's most negative value where not allowed
    (``token_type_ids``, or the half split when None), 0 elsewhere, ``[B or 1, 1, S, S]``; a
    ``[B, S]`` ``attention_mask`` (1 = keep) ADDS the most negative value on padded keys (so a
    padded key that is also not allowed is -inf, as in vLLM)."""
    keep = (allowed_by_type(token_type_ids.to(device)) if token_type_ids is not None
            else allowed(seq_len, device)[None])[:, None]
    lowest = torch.finfo(dtype).min
    zero = torch.zeros((), dtype=dtype, device=keep.device)
    mask = torch.where(keep, zero, lowest)
    if attention_mask is not None:
        padded = ~attention_mask.to(device=keep.device, dtype=torch.bool)[:, None, None, :]
        mask = mask + torch.where(padded, lowest, zero)
    return mask
