"""``rms_norm_quant_fp8``: RMSNorm fused with dynamic per-token fp8 quantization.

A plain function, not a ``CustomOp`` (vLLM has no enable switch for it either). Its spec is the
composition ``RMSNorm`` (rounded to ``x.dtype``) then ``QuantFP8`` dynamic per-token; a fused
kernel saves writing and re-reading the normalised activations. CPU tensors take the CPU tiers
(the composition compiled with eager's casts above QuantFP8's threshold); other tensors call
``customop::rms_norm_dynamic_per_token_fp8_quant``, whose device kernel the platform's backend
registers (loaded here on first use, as an op's construction would).
"""

from __future__ import annotations

import dataclasses

import torch

from customop.backend_loader import load_platform_backend
from customop.backends.cpu import run_tiered
from customop.math import quant as qm
from customop.math.fp8 import fp8_max, fp8_min_scale
from customop.ops.quantization.input_quant_fp8 import QUANT_CPU_TIERS
from customop.platforms import current_platform


#: Compiled with ``emulate_precision_casts``: inside one fused kernel Inductor otherwise keeps the
#: RMSNorm result in float32 instead of rounding it to ``x.dtype`` first, and the fp8 values
#: drift from the spec (63k of 4M differed by one fp8 step at 512x8192 bf16).
CPU_TIERS = dataclasses.replace(QUANT_CPU_TIERS, emulate_casts=True)


def _check(x: torch.Tensor, weight: torch.Tensor | None, scale_ub: torch.Tensor | None) -> None:
    where = "rms_norm_quant_fp8"
    if not x.is_floating_point() or x.dtype.itemsize == 1:
        raise TypeError(f"{where}: x must be a floating-point (not fp8) tensor, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError(f"{where}: x must have at least one dimension")
    if weight is not None and (tuple(weight.shape) != (x.shape[-1],) or weight.device != x.device):
        raise ValueError(f"{where}: weight must have shape ({x.shape[-1]},) on {x.device}, "
                         f"got {tuple(weight.shape)} on {weight.device}")
    if scale_ub is not None and (scale_ub.numel() != 1 or scale_ub.device != x.device):
        raise ValueError(f"{where}: scale_ub must have one element on {x.device}, "
                         f"got shape {tuple(scale_ub.shape)} on {scale_ub.device}")


def rms_norm_quant_fp8(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                       scale_ub: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` = dynamic per-token fp8 quant of ``RMSNorm(x) * weight``; ``scale`` has shape
    ``x.shape[:-1] + (1,)``; the fp8 dtype is the platform's."""
    _check(x, weight, scale_ub)
    fp8 = current_platform().fp8_dtype()
    args = (weight, eps, scale_ub, fp8, fp8_max(fp8), fp8_min_scale(fp8))
    if x.device.type == "cpu":
        return run_tiered(CPU_TIERS, qm.rms_norm_dynamic_per_token_fp8_quant, x, *args)
    load_platform_backend()  # registers the device kernels (cached: traceable)
    lead, hidden = x.shape[:-1], x.shape[-1]
    q, scale = torch.ops.customop.rms_norm_dynamic_per_token_fp8_quant(x.reshape(-1, hidden).contiguous(), *args)
    return q.view(x.shape), scale.view(lead + (1,))
