"""``rms_norm_quant_fp8``: RMSNorm fused with dynamic per-token fp8 quantization.

A plain function, not a ``CustomOp`` (no enable switch): it always calls the
``customop::rms_norm_dynamic_per_token_fp8_quant`` entry point, after loading the platform's
backend so a device kernel is registered. Its reference, and the spec, is the composition
``RMSNorm`` (research/op-semantics.md D.2, rounded to ``x.dtype``) then ``QuantFP8`` dynamic
per-token (D.4); a fused kernel saves writing and re-reading the normalised activations.
On the CPU the composition runs compiled (one fused kernel, rounding as the spec does) above
QuantFP8's ``CPU_COMPILE_MIN_NUMEL`` elements.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from customop.backend_loader import load_backend
from customop.backends.cpu import EMULATE_CASTS, compiled
from customop.math import quant as qm
from customop.math.fp8 import fp8_max, fp8_min_scale
from customop.ops.quantization.input_quant_fp8 import _worth_compiling
from customop.platforms import current_platform


@functools.cache
def _compiled_composition() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The composition compiled with ``emulate_precision_casts``: inside one fused kernel Inductor
    otherwise keeps the RMSNorm result in float32 instead of rounding it to ``x.dtype`` first, and
    the fp8 values drift from the spec (63k of 4M differed by one fp8 step at 512x8192 bf16)."""
    return compiled(qm.rms_norm_dynamic_per_token_fp8_quant, **EMULATE_CASTS)


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
    platform = current_platform()
    fp8 = platform.fp8_dtype()
    args = (weight, eps, scale_ub, fp8, fp8_max(fp8), fp8_min_scale(fp8))
    if platform.is_cpu():
        if not _worth_compiling(x):
            return qm.rms_norm_dynamic_per_token_fp8_quant(x, *args)
        x = x.view(x.shape)  # a fresh view with dynamic dims: one graph serves every size
        torch._dynamo.maybe_mark_dynamic(x, 0)
        torch._dynamo.maybe_mark_dynamic(x, x.dim() - 1)
        return _compiled_composition()(x, *args)
    if platform.backend is not None and platform.backend_unavailable() is None:
        load_backend(platform.backend)  # registers the device kernels (cached: traceable)
    lead, hidden = x.shape[:-1], x.shape[-1]
    q, scale = torch.ops.customop.rms_norm_dynamic_per_token_fp8_quant(x.reshape(-1, hidden).contiguous(), *args)
    return q.view(x.shape), scale.view(lead + (1,))
