"""Packed variable-length attention for the attention ops' ``forward_xpu``: IPEX's
``varlen_attention`` where it computes the spec, else a plain-torch reference.

The spec (``varlen_attention_native``) is flash-attention's varlen convention: ``query`` is
``[total_q, heads, D]``, ``key``/``value`` are ``[total_k, kv_heads, D]`` (``heads`` a multiple of
``kv_heads``, GQA), sequence ``b`` owns rows ``cu_seqlens[b]:cu_seqlens[b + 1]``. The causal mask
is aligned to the *bottom right*: query ``i`` of a sequence with ``Lq`` queries and ``Lk`` keys sees
keys ``j <= i + Lk - Lq``. ``window_size=(left, right)`` (``-1``: unbounded) limits that to
``i' - left <= j <= i' + right`` with ``i' = i + Lk - Lq``; ``softcap > 0`` maps scores to
``softcap * tanh(s / softcap)`` before the softmax; rows with no visible key are zeros.

What IPEX 2.8's CPU build was measured to do (tests/backends/xpu/test_attention_moe.py, xpu tier):
GQA and equal-length causal match the spec; causal with ``Lq != Lk`` is aligned *top left*
(``j <= i``), not bottom right; ``window_size``, ``softcap`` and ``alibi_slopes`` raise
("ipex do not support ..."). Those calls therefore run the reference. The XPU build's signature
differs (no ``alibi_slopes`` and no window arguments), so IPEX is called by parameter *name*, in the
order of the installed build's signature.
"""

from __future__ import annotations

import inspect
import math
from types import ModuleType

import torch

Tensor = torch.Tensor


def varlen_attention_native(query: Tensor, key: Tensor, value: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                            scale: float | None = None, causal: bool = False,
                            window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0) -> Tensor:
    """The spec (module docstring), in fp32 per sequence; returns ``query``'s shape and dtype.
    Reads the cumulative lengths on the host (a sync): a reference and a fallback, not a kernel."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    groups = query.shape[1] // key.shape[1]
    out = query.new_zeros(query.shape)
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for q0, q1, k0, k1 in zip(starts_q[:-1], starts_q[1:], starts_k[:-1], starts_k[1:]):
        q = query[q0:q1].float()
        k = key[k0:k1].float().repeat_interleave(groups, dim=1)
        v = value[k0:k1].float().repeat_interleave(groups, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        row = torch.arange(q1 - q0, device=query.device)[:, None] + (k1 - k0) - (q1 - q0)
        col = torch.arange(k1 - k0, device=query.device)[None, :]
        visible = torch.ones_like(row + col, dtype=torch.bool)
        if causal:
            visible &= col <= row
        if window_size[0] >= 0:
            visible &= col >= row - window_size[0]
        if window_size[1] >= 0:
            visible &= col <= row + window_size[1]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


def ipex_takes(fns: ModuleType, query: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
               max_seqlen_k: int, causal: bool, window_size: tuple[int, int], softcap: float) -> bool:
    """Whether IPEX computes the spec for these arguments (see the module docstring)."""
    if not hasattr(fns, "varlen_attention") or window_size != (-1, -1) or softcap > 0:
        return False
    if query.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    # IPEX aligns the causal mask top left; it equals the spec only where every Lq == Lk.
    return not causal or (max_seqlen_q == max_seqlen_k and torch.equal(cu_seqlens_q, cu_seqlens_k))


def varlen_attention_ipex(fns: ModuleType, query: Tensor, key: Tensor, value: Tensor, cu_seqlens_q: Tensor,
                          cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: float | None = None,
                          causal: bool = False, out: Tensor | None = None) -> Tensor:
    """``fns.varlen_attention`` (``fns`` = ``ipex.llm.functional``) with the arguments matched by
    name: both builds take ``(query, key, value, out, seqlen_q, seqlen_k, ...)`` but place
    ``alibi_slopes`` and the window arguments differently or not at all. Sequence lengths must be
    int32; IPEX writes into ``out``."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    out = torch.empty_like(query, memory_format=torch.contiguous_format) if out is None else out
    by_name = {
        "query": query.contiguous(), "key": key.contiguous(), "value": value.contiguous(), "out": out,
        "seqlen_q": cu_seqlens_q.to(torch.int32), "seqlen_k": cu_seqlens_k.to(torch.int32),
        "alibi_slopes": None, "max_seqlen_q": int(max_seqlen_q), "max_seqlen_k": int(max_seqlen_k),
        "pdropout": 0.0, "softmax_scale": float(scale), "zero_tensors": False, "is_causal": causal,
        "return_softmax": False, "gen_": None, "window_size_left": -1, "window_size_right": -1, "softcap": -1.0,
    }
    params = inspect.signature(fns.varlen_attention).parameters
    unknown = [name for name, p in params.items() if name not in by_name and p.default is inspect.Parameter.empty]
    if unknown:
        raise TypeError(f"customop xpu varlen_attention: this IPEX build's varlen_attention needs {unknown}, "
                        "which the mapping does not know")
    fns.varlen_attention(*(by_name[name] for name in params if name in by_name))
    return out


def varlen_attention(query: Tensor, key: Tensor, value: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                     max_seqlen_q: int, max_seqlen_k: int, *, scale: float | None = None, causal: bool = False,
                     window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0) -> Tensor:
    """The entry point for attention ops: IPEX on XPU tensors when the backend chose IPEX and
    IPEX computes the spec for these arguments, else ``varlen_attention_native``."""
    from customop.backends.xpu import chain

    fns = chain.ipex_functional()
    if (fns is not None and query.device.type == "xpu"
            and ipex_takes(fns, query, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                           window_size, softcap)):
        return varlen_attention_ipex(fns, query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, scale, causal)
    return varlen_attention_native(query, key, value, cu_seqlens_q, cu_seqlens_k, scale, causal, window_size, softcap)
