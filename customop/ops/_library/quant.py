"""fp8 quantization kernel entry points: ``torch.ops.customop.*`` schemas, references and fakes.

Backends fill these with ``torch.library.register_kernel(name, device_type, fn)``; the bodies
below are the reference (``customop.math.quant``) and run on any device. Every
output is freshly allocated and contiguous, except column-major group scales (a ``[H/G, T]``
contiguous tensor, transposed). Scales are float32. ``fp8_max`` and ``min_scale`` are passed in
(not derived from ``out_dtype``) so that e4m3fnuz's 224 reaches the kernel unchanged.

Math a kernel must reproduce (bit for bit on real hardware):

- static / per-tensor / per-token: ``clamp(float32(x) * (1 / scale), -fp8_max, fp8_max)`` with a
  float32 reciprocal, then round to ``out_dtype``;
- per-token: ``scale = max(min(amax_row, scale_ub) / fp8_max, min_scale)``;
- per-group: ``s = max(amax_g / fp8_max, min_scale)``, then ``2^ceil(log2 s)`` with ``use_ue8m0``,
  and ``clamp(float32(x) / s, ...)`` (a division, as vLLM's group kernels do);
- rms-norm fusion: the RMSNorm result rounded to ``x.dtype`` before the per-token quant.
"""

from __future__ import annotations

import torch
from torch import Tensor

from customop.math import quant as qm


def _scale_shape(x: Tensor, last: int) -> tuple[int, ...]:
    return tuple(x.shape[:-1]) + (last,)


def _check_scale_ub(op: str, scale_ub: Tensor | None) -> None:
    """Before any reshape of it: a cap with more than one element would otherwise fail inside the
    math as ``shape '[]' is invalid``, naming neither the op nor the argument."""
    if scale_ub is not None and scale_ub.numel() != 1:
        raise ValueError(f"customop::{op}: scale_ub must have one element, got shape {tuple(scale_ub.shape)}")


def _check_groups(x: Tensor, group_size: int) -> int:
    if group_size < 1 or x.dim() < 2 or x.shape[-1] % group_size:
        raise ValueError(f"customop::per_token_group_fp8_quant: x of shape {tuple(x.shape)} must be [T, H] "
                         f"with H a multiple of group_size={group_size}")
    return x.shape[-1] // group_size


@torch.library.custom_op("customop::static_scaled_fp8_quant", mutates_args=())
def static_scaled_fp8_quant(x: Tensor, scale: Tensor, out_dtype: torch.dtype, fp8_max: float) -> Tensor:
    """``q = clamp(float32(x) * (1/scale), -fp8_max, fp8_max).to(out_dtype)``; ``scale`` has one
    element (static per-tensor)."""
    if scale.numel() != 1:
        raise ValueError(f"customop::static_scaled_fp8_quant: scale must have one element, got {tuple(scale.shape)}")
    return qm.scaled_fp8_quant(x, scale.reshape(()), out_dtype, fp8_max).contiguous()


@static_scaled_fp8_quant.register_fake
def _(x: Tensor, scale: Tensor, out_dtype: torch.dtype, fp8_max: float) -> Tensor:
    return x.new_empty(x.shape, dtype=out_dtype)


@torch.library.custom_op("customop::dynamic_scaled_fp8_quant", mutates_args=())
def dynamic_scaled_fp8_quant(x: Tensor, out_dtype: torch.dtype, fp8_max: float,
                             min_scale: float) -> tuple[Tensor, Tensor]:
    """Dynamic per-tensor: ``(q, scale)``, scale shape ``[1]``; no element: empty ``q``, ``min_scale``."""
    if x.numel() == 0:  # the amax of nothing is 0 (max() would raise), as the Triton kernel does
        return x.new_empty(x.shape, dtype=out_dtype), torch.full((1,), min_scale, dtype=torch.float32,
                                                                 device=x.device)
    q, scale = qm.dynamic_scaled_fp8_quant(x, out_dtype, fp8_max, min_scale)
    return q.contiguous(), scale


@dynamic_scaled_fp8_quant.register_fake
def _(x: Tensor, out_dtype: torch.dtype, fp8_max: float, min_scale: float) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty((1,), dtype=torch.float32)


@torch.library.custom_op("customop::dynamic_per_token_scaled_fp8_quant", mutates_args=())
def dynamic_per_token_scaled_fp8_quant(x: Tensor, scale_ub: Tensor | None, out_dtype: torch.dtype, fp8_max: float,
                                       min_scale: float) -> tuple[Tensor, Tensor]:
    """Dynamic per-token on ``x [T, H]``: ``(q, scale [T, 1])``; ``scale_ub`` (one element) caps
    each row's amax."""
    _check_scale_ub("dynamic_per_token_scaled_fp8_quant", scale_ub)
    q, scale = qm.dynamic_per_token_scaled_fp8_quant(x, scale_ub, out_dtype, fp8_max, min_scale)
    return q.contiguous(), scale.contiguous()


@dynamic_per_token_scaled_fp8_quant.register_fake
def _(x: Tensor, scale_ub: Tensor | None, out_dtype: torch.dtype, fp8_max: float,
      min_scale: float) -> tuple[Tensor, Tensor]:
    _check_scale_ub("dynamic_per_token_scaled_fp8_quant", scale_ub)
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty(_scale_shape(x, 1), dtype=torch.float32)


# Explicit schema: an inferred ``int`` would become ``SymInt``; the group size is a constant.
@torch.library.custom_op(
    "customop::per_token_group_fp8_quant", mutates_args=(),
    schema="(Tensor x, int group_size, bool column_major_scales, bool use_ue8m0, ScalarType out_dtype, "
           "float fp8_max, float min_scale) -> (Tensor, Tensor)")
def per_token_group_fp8_quant(x: Tensor, group_size: int, column_major_scales: bool, use_ue8m0: bool,
                              out_dtype: torch.dtype, fp8_max: float, min_scale: float) -> tuple[Tensor, Tensor]:
    """Dynamic per-group on ``x [T, H]`` (``H % group_size == 0``): ``(q, scales [T, H/G])``;
    column-major scales are a ``[H/G, T]`` contiguous tensor transposed."""
    _check_groups(x, group_size)
    q, scales = qm.per_token_group_fp8_quant(x, group_size, column_major_scales, use_ue8m0, out_dtype,
                                             fp8_max, min_scale)
    return q.contiguous(), scales


@per_token_group_fp8_quant.register_fake
def _(x: Tensor, group_size: int, column_major_scales: bool, use_ue8m0: bool, out_dtype: torch.dtype,
      fp8_max: float, min_scale: float) -> tuple[Tensor, Tensor]:
    groups = _check_groups(x, group_size)
    q = x.new_empty(x.shape, dtype=out_dtype)
    if column_major_scales:
        scales = x.new_empty(tuple(x.shape[:-2]) + (groups, x.shape[-2]), dtype=torch.float32).transpose(-2, -1)
    else:
        scales = x.new_empty(_scale_shape(x, groups), dtype=torch.float32)
    return q, scales


@torch.library.custom_op("customop::rms_norm_dynamic_per_token_fp8_quant", mutates_args=())
def rms_norm_dynamic_per_token_fp8_quant(x: Tensor, weight: Tensor | None, eps: float, scale_ub: Tensor | None,
                                         out_dtype: torch.dtype, fp8_max: float,
                                         min_scale: float) -> tuple[Tensor, Tensor]:
    """RMSNorm of ``x [T, H]`` (optional ``weight [H]``) then dynamic per-token quant:
    ``(q, scale [T, 1])``."""
    _check_scale_ub("rms_norm_dynamic_per_token_fp8_quant", scale_ub)
    q, scale = qm.rms_norm_dynamic_per_token_fp8_quant(x, weight, eps, scale_ub, out_dtype, fp8_max, min_scale)
    return q.contiguous(), scale.contiguous()


@rms_norm_dynamic_per_token_fp8_quant.register_fake
def _(x: Tensor, weight: Tensor | None, eps: float, scale_ub: Tensor | None, out_dtype: torch.dtype,
      fp8_max: float, min_scale: float) -> tuple[Tensor, Tensor]:
    _check_scale_ub("rms_norm_dynamic_per_token_fp8_quant", scale_ub)
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty(_scale_shape(x, 1), dtype=torch.float32)
