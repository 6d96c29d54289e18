"""The qwen2_decoder family's math: the attention mask of DeepSeek-OCR-2's Qwen2 vision decoder.

The decoder runs a Qwen2 stack over ``[image tokens | learned query tokens]``, ``n = S // 2`` image
tokens first. Every token sees every image token (the image tokens attend bidirectionally among
themselves and never to the queries); a query token also sees the queries up to itself (causal).
The rest of the stack is standard Qwen2 (RMSNorm, GQA with RoPE, SwiGLU), built from customop's
own ops in ``customop/ops/qwen2_decoder.py``.
"""

from __future__ import annotations

import torch


def allowed(seq_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[S, S]`` bool: ``allowed[i, j]`` when token ``i`` may attend to token ``j``:
    ``j < n`` or ``n <= j <= i`` with ``n = S // 2``."""
    n = seq_len // 2
    i = torch.arange(seq_len, device=device)[:, None]
    j = torch.arange(seq_len, device=device)[None, :]
    return (j < n) | ((i >= n) & (j >= n) & (j <= i))


def additive_mask(seq_len: int, dtype: torch.dtype, device: torch.device | str | None = None,
                  attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The SDPA mask: 0 where allowed, the dtype's most negative value elsewhere; ``[1, 1, S, S]``,
    or ``[B, 1, S, S]`` when a ``[B, S]`` ``attention_mask`` (1 = keep) also masks padded keys."""
    keep = allowed(seq_len, device)[None, None]
    if attention_mask is not None:
        keep = keep & attention_mask.to(device=keep.device, dtype=torch.bool)[:, None, None, :]
    zero = torch.zeros((), dtype=dtype, device=keep.device)
    return torch.where(keep, zero, torch.finfo(dtype).min)
