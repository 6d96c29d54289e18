"""``ApplyRotaryEmb`` (``apply_rotary_emb``): RoPE with cos/sin already gathered per position,
as vision encoders and some attention backends call it."""

from __future__ import annotations

import torch

from customop.backends.cpu import CpuTiers, run_tiered
from customop.custom_op import CustomOp
from customop.math import rotary as common

Tensor = torch.Tensor

#: On the CPU this op is only ~8 ATen ops eagerly, so the compiled call's guards (~20 us through
#: Dynamo) paid off from about 4-8 tokens of 32 heads x 128 (16-32k elements;
#: benchmarks/results/cpu_rotary.md). The compiled tier runs without Dynamo for a 3-D x
#: (``standalone``: backends/cpu/standalone.py ``run_tokens``): 0.7-0.9x -> ~1.1x torch.compile at
#: 8-16 tokens, and from 4 tokens (16K) it beats eager (bf16 43 -> 33 us, fp32 36 -> 32); at
#: 1-2 tokens the two are within a few us, and eager compiles nothing (BENCHMARKS.md, 2026-12-02).
#: A 4-D x keeps Dynamo's path.
APPLY_ROTARY_CPU_TIERS = CpuTiers(16384, rows=False, dynamic_hidden=False, feature_dims=2,  # [.., S, heads, D]
                                  standalone=True)


def _check_apply_inputs(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    op = "apply_rotary_emb"
    if not x.dtype.is_floating_point:
        raise TypeError(f"{op}: x must be a floating-point tensor, got {x.dtype}")
    if x.dim() not in (3, 4):
        raise ValueError(f"{op}: x must be [seq, heads, head_size] or [batch, seq, heads, head_size], "
                         f"got shape {tuple(x.shape)}")
    if cos.shape != sin.shape or cos.dim() != 2:
        raise ValueError(f"{op}: cos and sin must both be [seq, rotary_dim/2], got {tuple(cos.shape)} "
                         f"and {tuple(sin.shape)}")
    if cos.shape[0] != x.shape[-3]:
        raise ValueError(f"{op}: cos has {cos.shape[0]} positions but x has seq length {x.shape[-3]}")
    if 2 * cos.shape[-1] > x.shape[-1]:
        raise ValueError(f"{op}: cos/sin rotate {2 * cos.shape[-1]} lanes but x's head_size is {x.shape[-1]}")
    if not (x.device == cos.device == sin.device):
        raise ValueError(f"{op}: x, cos and sin must share a device, got {x.device}, {cos.device}, {sin.device}")


@CustomOp.register("apply_rotary_emb")
class ApplyRotaryEmb(CustomOp):
    """``forward(x, cos, sin)``: ``x`` ``[B?, S, H, D]``, ``cos``/``sin`` ``[S, R/2]`` with
    ``R <= D`` (the first ``R`` lanes of each head rotate). Returns a NEW tensor; ``x`` is never
    modified. ``enforce_enable`` is the first positional parameter, as in vLLM.

    ``enable_fp32_compute`` rotates in fp32 and casts back to ``x``'s dtype.
    """

    cpu_tiers = APPLY_ROTARY_CPU_TIERS

    def __init__(self, enforce_enable: bool = False, is_neox_style: bool = True,
                 enable_fp32_compute: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        self.is_neox_style = is_neox_style
        self.enable_fp32_compute = enable_fp32_compute

    def forward_native(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return common.apply_rotary_emb(x, cos, sin, self.is_neox_style, self.enable_fp32_compute)

    def forward_cpu(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        _check_apply_inputs(x, cos, sin)
        return run_tiered(self.cpu_tiers, common.apply_rotary_emb, x, cos, sin, self.is_neox_style,
                          self.enable_fp32_compute)

    def forward_cuda(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return self.forward_kernel(x, cos, sin)

    forward_xpu = forward_tpu = forward_cuda

    def forward_kernel(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """One kernel for the whole family: a copy of ``x`` is rotated in place by
        ``customop::rotary_embedding`` with ``cat(cos, sin)`` as the cache and position ``s`` for
        every token of sequence index ``s``."""
        _check_apply_inputs(x, cos, sin)
        if torch.is_grad_enabled() and x.requires_grad:
            return self.forward_native(x, cos, sin)  # the kernel rotates in place: no backward
        dtype = torch.float32 if self.enable_fp32_compute else x.dtype
        seq_len, head_size = x.shape[-3], x.shape[-1]
        # repeat, not expand + flatten: at seq_len 1 the latter is a stride-0 view (the launcher
        # would then have to copy it)
        positions = torch.arange(seq_len, device=x.device).repeat(x.shape[:-3].numel())
        flat = x.reshape(positions.shape[0], x.shape[-2] * head_size)  # not -1: an empty batch has no size to infer
        flat = flat.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)
        cache = torch.cat((cos, sin), dim=-1).to(dtype)
        torch.ops.customop.rotary_embedding(positions, flat, None, head_size, cache, self.is_neox_style)
        return flat.view(x.shape).to(x.dtype)

    def extra_repr(self) -> str:
        return f"is_neox_style={self.is_neox_style}, enable_fp32_compute={self.enable_fp32_compute}"
