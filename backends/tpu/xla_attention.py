"""The ``xla`` kernel of ``torch.ops.customop.mm_encoder_attn`` (``attention.py`` has the JAX side;
``xla_kernels.py`` the bridge reused here: ``_pallas``, ``_takes``, ``_spec``).

On XLA tensors the op runs the Pallas flash-attention kernel with segment ids; float inputs in a
dtype the kernel does not take (fp64) run the op's spec (``customop/math/attention.py``,
functionalized), as for the other families. ``cu_seqlens`` stays on the device (int32: JAX traces
without x64) and is not read by the kernel; as on the Triton path, ``max_seqlen <= 0`` ("unknown")
reads and checks it on the host first (``segment_lengths``: a device-to-host copy), so a bad one
raises the same ``ValueError`` as the reference. Run only in emulation: the XLA CPU device, Pallas
in interpret mode (docs/tpu.md).
"""

from __future__ import annotations

import torch

from customop.backends.tpu import attention
from customop.backends.tpu import xla_kernels as xk
from customop.math import attention as spec

Tensor = torch.Tensor


def mm_encoder_attn(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                    scale: float) -> Tensor:
    if query.dim() != 3 or key.dim() != 3 or key.shape != value.shape or key.shape[0] != query.shape[0] \
            or key.shape[2] != query.shape[2] or key.shape[1] == 0 or query.shape[1] % key.shape[1]:
        raise ValueError(f"customop::mm_encoder_attn: query [T, Hq, D] and key/value [T, Hkv, D] with Hkv "
                         f"dividing Hq, got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if not xk._takes(query, key, value) or key.dtype != query.dtype or value.dtype != query.dtype:
        # the segments are read on the host first: a functionalized tensor cannot be read there
        lengths = spec.segment_lengths(cu_seqlens, query.shape[0], max_seqlen)
        return xk._spec(_packed_spec, query, key, value, lengths, scale).contiguous()
    if max_seqlen <= 0:
        spec.segment_lengths(cu_seqlens, query.shape[0])
    if query.shape[0] == 0:
        return query.new_empty(query.shape)
    return xk._pallas(attention.varlen_attention, query, key, value, cu_seqlens.to(torch.int32), scale=float(scale))


def _packed_spec(query: Tensor, key: Tensor, value: Tensor, lengths: list[int], scale: float) -> Tensor:
    return spec.encoder_attention(query[None], key[None], value[None], lengths, scale)[0]


KERNELS = {"mm_encoder_attn": mm_encoder_attn}


def register() -> None:
    """Registers the kernels above for XLA tensors (once; ``xla_kernels.register_table``)."""
    xk.register_table(__name__, KERNELS)
