"""``customop::mm_encoder_attn`` on IPEX: ``ipex.llm.functional.varlen_attention``.

Both IPEX 2.8 builds have it with one signature (the CPU build's docstring and vLLM's XPU
``flash_attn_varlen_func`` agree): ``varlen_attention(q, k, v, out, cu_seqlens_q, cu_seqlens_k,
alibi_slopes, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, zero_tensors, is_causal,
return_softmax, generator, window_left, window_right, softcap)``. The op maps onto it exactly:
the same packed ``[T, H, D]`` layout and ``cu_seqlens`` for queries and keys, no causal mask, no
dropout, no window, no soft cap, GQA as is (key/value heads dividing the query heads). Measured on
the CPU build (2.8.0+cpu, xpu tier): fp32, bf16 and fp16, head sizes 64 to 128, GQA, MQA, empty
and one-token segments, all within the project's tolerances of the float64 reference, **but** its
``softmax_scale`` is ignored: it always scales by ``head_size ** -0.5`` (an explicit 0.1 at head
size 64 gave errors of 0.4 on O(1) outputs; the xpu tier asserts this, so a fix shows up). So only
calls with that scale (the op classes' default, vLLM's too) go to IPEX; folding another scale into
the query would add a rounding of the query in 16-bit dtypes, so those calls take the next
provider instead.

``max_seqlen <= 0`` ("unknown") reads and checks ``cu_seqlens`` on the host first, as the Triton
kernel does (the same ``ValueError`` as the reference for a bad one). Handed to the chain's next
provider: a scale other than ``head_size ** -0.5``, fp64, head sizes above 256 (the XPU build's
limits are not known here: never run on an Intel GPU), a ``cu_seqlens`` that is not int32.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import torch

from customop.math import attention as _math

Tensor = torch.Tensor
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256
CALL = "varlen_attention(q, k, v, out, cu, cu, None, max_seqlen, max_seqlen, 0.0, scale, False, is_causal=False, ...)"


def supports(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float) -> bool:
    return (query.dim() == 3 and query.dtype in DTYPES and key.dtype == query.dtype and value.dtype == query.dtype
            and query.shape[-1] <= MAX_HEAD_DIM and cu_seqlens.dtype == torch.int32
            and math.isclose(scale, query.shape[-1] ** -0.5, rel_tol=1e-9))  # the CPU build ignores the scale


def bind(fns: ModuleType, modules: Any = None):
    """The ``IpexKernel`` of ``mm_encoder_attn``, or None when this build lacks the function."""
    from customop.backends.xpu.ipex_ops import IpexKernel  # not at the top: ipex_ops imports this module

    if not hasattr(fns, "varlen_attention"):
        return None

    def run(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float) -> Tensor:
        total = query.shape[0]
        if max_seqlen <= 0:
            max_seqlen = max(_math.segment_lengths(cu_seqlens, total), default=0)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if total == 0:
            return out
        fns.varlen_attention(query.contiguous(), key.contiguous(), value.contiguous(), out, cu_seqlens, cu_seqlens,
                             None, max_seqlen, max_seqlen, 0.0, float(scale), False, False, False, None, -1, -1, -1.0)
        return out

    return IpexKernel(CALL, run, supports)
