"""RMSNorm fused with dynamic per-token fp8 quant: ``customop::rms_norm_dynamic_per_token_fp8_quant``.

The fusion vLLM gets from compiler passes: one read of ``x`` and one write of the fp8 ``q``
(3 bytes per bf16 element instead of the 2 + 2 + 2 + 1 of norm-then-quant). The kernel is the
per-token quant kernel of quant.py with its ``NORM`` prologue: sum of squares of the row in
fp32, ``rstd = 1/sqrt(mean + eps)``, ``y = fp32(x) * rstd`` rounded to the weight dtype,
multiplied by the weight there, rounded to x's dtype (RMSNorm's rounding order, op-semantics D.2),
then amax, scale and quantize from the same registers. Against the reference the fp8 bits agree
except where the sum of squares, summed in another order, moves ``y`` by an ulp across a rounding
boundary (rare; tests allow a tiny fraction of one-fp8-ulp differences).
"""

from __future__ import annotations

import torch

from customop.backends.triton.quant import ROW_SWEEP, row_quant


def rms_norm_dynamic_per_token_fp8_quant(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                                         scale_ub: torch.Tensor | None, out_dtype: torch.dtype, fp8_max: float,
                                         min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: ``(q, scale [T, 1])``; ``weight`` (``[H]``) and ``scale_ub`` (one element) optional."""
    if weight is not None and tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"rms_norm_dynamic_per_token_fp8_quant: weight must have shape ({x.shape[-1]},), "
                         f"got {tuple(weight.shape)}")
    if weight is not None and not weight.is_contiguous():
        weight = weight.contiguous()
    return row_quant(x, weight, eps, scale_ub, out_dtype, fp8_max, min_scale, norm=True)


KERNELS = {"customop::rms_norm_dynamic_per_token_fp8_quant": rms_norm_dynamic_per_token_fp8_quant}
TUNING = {"customop::rms_norm_dynamic_per_token_fp8_quant": ("rows", ROW_SWEEP)}
