"""TPUs: JAX Pallas kernels, callable from JAX directly and, on torch_xla tensors, as the ``xla``
kernels of the ``torch.ops.customop`` ops.

JAX users call the kernels on ``jax.Array``s (this needs jax, not torch_xla)::

    from customop.backends import tpu
    y = tpu.rms_norm(x, weight, 1e-6)                       # [..., H]
    y, h = tpu.rms_norm(x, weight, 1e-6, residual=r)        # fused add: h = x + r
    y = tpu.gemma_rms_norm(x, weight, 1e-6)
    y = tpu.rms_norm_gated(x, weight, z, 1e-5, group_size=G, norm_before_gate=False)
    q, k = tpu.rotary_embedding(positions, q, k, head_size, cos_sin_cache, is_neox_style=True)
    y = tpu.silu_and_mul(x); y = tpu.act_and_mul(x, "gelu_tanh")
    q, s = tpu.per_token_quant_fp8(x); q, s = tpu.per_group_quant_fp8(x, 128)
    y, ssm = tpu.mamba.ssd_chunk_scan(x, dt, A, B, C, D, dt_bias, ssm, qsl, slots, init, chunk_size=256)
    y, ssm = tpu.mamba.selective_state_update(ssm, x, dt, A, B, C, D, z, dt_bias, slots)  # decode
    o = tpu.varlen_attention(q, k, v, cu_seqlens, scale)     # packed segments, GQA
    y = tpu.fused_experts(x, w13, w2, topk_weights, topk_ids, activation="silu")  # or tpu.gmm(...)

Every function also takes ``block_rows=`` (rows per block; a multiple of 8 or all rows) and
``interpret=`` (``None``: decided by ``tiling.use_interpret``: ``CUSTOMOP_PALLAS_INTERPRET`` if
set, else interpret unless on a TPU). The math of each is the matching op's spec
(``customop/math``); see docs/tpu.md for what has run where.

PyTorch users do not call this package: the op classes call ``torch.ops.customop.<op>``, and
importing this package registers the ``xla`` kernels of those ops (``xla_kernels.py``) when
torch_xla is installed. Registering imports neither torch_xla nor torchax (a JAX-only process
never starts torch_xla's runtime, which would claim the TPU before JAX could); the first kernel
call does, and names ``pip install customop[tpu]`` when one of them is missing.
"""

from __future__ import annotations

import importlib.util

from customop.backends.tpu.activation import (
    ACTIVATIONS, act_and_mul, gelu_and_mul, silu_and_mul, silu_and_mul_with_clamp, situ_and_mul,
)
from customop.backends.tpu.layernorm import (
    fused_rms_norm_gated, gemma_rms_norm, layer_norm, nemotron_layer_norm, rms_norm, rms_norm_gated,
)
from customop.backends.tpu.quant import fp8_max, per_group_quant_fp8, per_tensor_quant_fp8, per_token_quant_fp8
from customop.backends.tpu.rotary import rotary_embedding
from customop.backends.tpu.tiling import use_interpret
from customop.backends.tpu import mamba  # noqa: I001  (the state-space family: tpu.mamba.*)
from customop.backends.tpu.attention import varlen_attention  # noqa: I001
from customop.backends.tpu.moe import fused_experts, gmm

__all__ = [
    "ACTIVATIONS",
    "act_and_mul",
    "fp8_max",
    "fused_experts",
    "fused_rms_norm_gated",
    "gelu_and_mul",
    "gemma_rms_norm",
    "gmm",
    "layer_norm",
    "nemotron_layer_norm",
    "per_group_quant_fp8",
    "per_tensor_quant_fp8",
    "per_token_quant_fp8",
    "rms_norm",
    "rms_norm_gated",
    "rotary_embedding",
    "silu_and_mul",
    "silu_and_mul_with_clamp",
    "situ_and_mul",
    "use_interpret",
    "varlen_attention",
]

if importlib.util.find_spec("torch_xla") is not None:
    from customop.backends.tpu import xla_attention, xla_kernels, xla_mamba, xla_moe

    xla_kernels.register()
    xla_mamba.register()
    xla_attention.register()  # mm_encoder_attn: Pallas flash attention with segment ids
    xla_moe.register()  # fused_experts: Pallas grouped matmul
