"""Kernel entry point of the attention family: ``torch.ops.customop.mm_encoder_attn``.

The schema is a contract with the backends that register device kernels for it (Triton's launcher
for CUDA/ROCm/XPU, which hands NVIDIA's 16-bit inputs to torch's own varlen flash attention);
do not change it:

- ``query`` ``[T, Hq, D]``, ``key``/``value`` ``[T, Hkv, D]``: one packed sequence of ``T`` tokens,
  one dtype (fp32, fp16 or bf16), unit stride in the last dim; ``Hkv`` divides ``Hq`` and query
  head ``h`` reads key/value head ``h // (Hq // Hkv)``.
- ``cu_seqlens`` ``[N + 1]`` int32 on the tensors' device: segment ``i`` is tokens
  ``cu_seqlens[i]:cu_seqlens[i + 1]``; it starts at 0, never decreases and ends at ``T``.
  Attention is bidirectional inside each segment and never crosses one.
- ``max_seqlen``: an upper bound on the longest segment (a kernel sizes its grid by it), or ``0``
  for "unknown": the kernel then reads ``cu_seqlens`` itself (a device-to-host copy; under CUDA
  graph capture it takes ``T`` instead, which is correct but launches idle programs).
- ``scale``: the softmax scale (the op classes default it to ``D ** -0.5``).
- Returns a new contiguous ``[T, Hq, D]`` tensor in query's dtype.

The body below is the reference (runs on any device without a kernel, e.g. XLA): the spec's
segment loop, after checking ``cu_seqlens`` and ``max_seqlen`` against the data. The fake gives
the shape only.
"""

from __future__ import annotations

import torch

from customop.math import attention as _math

Tensor = torch.Tensor

#: Written out rather than inferred so that the contract reads exactly as the backends see it
#: (inference would spell ``int`` as ``SymInt``).
SCHEMAS = {
    "mm_encoder_attn": "(Tensor query, Tensor key, Tensor value, Tensor cu_seqlens, int max_seqlen, "
                       "float scale) -> Tensor",
    "varlen_attn": "(Tensor query, Tensor key, Tensor value, Tensor cu_seqlens, int max_seqlen, float scale, "
                   "bool causal) -> Tensor",
}


@torch.library.custom_op("customop::mm_encoder_attn", mutates_args=(), schema=SCHEMAS["mm_encoder_attn"])
def mm_encoder_attn(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                    scale: float) -> Tensor:
    """Bidirectional attention inside each ``cu_seqlens`` segment of a packed sequence."""
    return _math.varlen_attention(query, key, value, cu_seqlens, max_seqlen, scale).contiguous()


@mm_encoder_attn.register_fake
def _(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float) -> Tensor:
    return query.new_empty(query.shape)


# ``customop::varlen_attn``: ``mm_encoder_attn``'s contract (above) plus ``causal``: when true,
# token ``i`` of a segment attends to the segment's tokens ``0..i`` only (query and key lengths
# are equal per segment, so top-left and bottom-right alignment agree). A separate op rather than
# a new argument of ``mm_encoder_attn``, whose schema the TPU and XPU backends implement as it is.
# Its first user is MLA's prefill (customop/math/mla.py), with the value padded to the query's
# head dim. The Triton launcher serves it on CUDA/ROCm/XPU; elsewhere this reference runs.


@torch.library.custom_op("customop::varlen_attn", mutates_args=(), schema=SCHEMAS["varlen_attn"])
def varlen_attn(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float,
                causal: bool) -> Tensor:
    """Attention inside each ``cu_seqlens`` segment of a packed sequence, causal when asked."""
    return _math.varlen_attention(query, key, value, cu_seqlens, max_seqlen, scale, causal, "varlen_attn").contiguous()


@varlen_attn.register_fake
def _(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float,
      causal: bool) -> Tensor:
    return query.new_empty(query.shape)
