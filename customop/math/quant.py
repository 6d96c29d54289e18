"""The fp8 quantization spec: pure PyTorch functions, one per mode, as vLLM computes them.

Notation: ``MAX`` = ``fp8_max`` (448 e4m3fn, 224 e4m3fnuz), ``MIN_SCALE`` = ``min_scale``
(``1/(MAX*512)``), ``H`` = ``x.shape[-1]``. Every scale is float32. Rounding order matters and is
vLLM's:

- amax is taken in the input dtype (exact), then cast to float32;
- ``scale = max(amax / MAX, MIN_SCALE)`` in float32;
- per-tensor / per-token / static: ``q = clamp(float32(x) * (1/scale), -MAX, MAX).to(fp8)``:
  a float32 **reciprocal, then a multiply** (not a division; the results differ in the last bit);
- per-group: ``q = clamp(float32(x) / scale, -MAX, MAX).to(fp8)``: a true **division**, as in
  vLLM's group path (native and Triton).

These functions are what ``forward_native`` runs and what the ``torch.ops.customop.*`` entry
points run by default; device kernels must reproduce them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from customop.math.layernorm import rms_norm


def scaled_fp8_quant(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, fp8_max: float) -> torch.Tensor:
    """Static quant with a given scale that broadcasts against ``x`` (numel 1: per tensor;
    ``[..., T, 1]``: per token; ``[H]`` / ``[1, H]``: per channel):
    ``q = clamp(float32(x) * (1/float32(scale)), -MAX, MAX).to(fp8)``."""
    inverse = scale.to(torch.float32).reciprocal()
    return (x.to(torch.float32) * inverse).clamp(-fp8_max, fp8_max).to(fp8_dtype)


def dynamic_scaled_fp8_quant(x: torch.Tensor, fp8_dtype: torch.dtype, fp8_max: float,
                             min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-tensor: ``scale = max(max|x| / MAX, MIN_SCALE)``, shape ``[1]``; then the
    static quant with it. Returns ``(q, scale)``."""
    amax = x.abs().max().to(torch.float32).reshape(1)  # .max(): torch_xla 2.9 leaves .amax() unreduced
    scale = (amax / fp8_max).clamp(min=min_scale)
    return scaled_fp8_quant(x, scale, fp8_dtype, fp8_max), scale


def dynamic_per_token_scaled_fp8_quant(x: torch.Tensor, scale_ub: torch.Tensor | None, fp8_dtype: torch.dtype,
                                       fp8_max: float, min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token: ``amax = max|x|`` over the last dim, capped at ``scale_ub`` when given
    (``scale_ub`` bounds the amax, not the scale); ``scale = max(amax / MAX, MIN_SCALE)``, shape
    ``x.shape[:-1] + (1,)``; then the static quant. Returns ``(q, scale)``."""
    amax = x.abs().amax(dim=-1, keepdim=True).to(torch.float32)
    if scale_ub is not None:
        amax = torch.minimum(amax, scale_ub.to(torch.float32).reshape(()))
    scale = (amax / fp8_max).clamp(min=min_scale)
    return scaled_fp8_quant(x, scale, fp8_dtype, fp8_max), scale


def ue8m0_round_up(scale: torch.Tensor) -> torch.Tensor:
    """Rounds a positive scale up to a power of two, exactly ``2^ceil(log2 s)`` (UE8M0 stores only
    the exponent). Computed from ``frexp`` (``s = m * 2^e``, ``0.5 <= m < 1``: the answer is ``2^e``,
    or ``s`` itself when ``m == 0.5``), because a float32 ``log2`` rounds ``log2(2^k (1 + 2^-23))``
    to ``k`` for ``|k| >= 2`` and so rounds such scales *down*, past which values overflow into
    the clamp."""
    mantissa, exponent = torch.frexp(scale)
    return torch.exp2((exponent - (mantissa == 0.5).to(exponent.dtype)).to(scale.dtype))


def per_token_group_fp8_quant(x: torch.Tensor, group_size: int, column_major_scales: bool, use_ue8m0: bool,
                              fp8_dtype: torch.dtype, fp8_max: float,
                              min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-group (``G = group_size`` consecutive elements of a row share a scale).

    The last dim is zero-padded to a multiple of ``G`` (zeros do not change an amax);
    ``s = max(max|x_g| / MAX, MIN_SCALE)``, then, with ``use_ue8m0``, ``s = 2^ceil(log2 s)``
    exactly (after the clamp, so every ue8m0 scale is a power of two, the all-zero group's included);
    ``q = clamp(float32(x_g) / s, -MAX, MAX).to(fp8)``. Scales have shape
    ``x.shape[:-1] + (ceil(H/G),)``; ``column_major_scales`` stores the last two dims transposed
    (the same values, strides of a ``[..., H/G, T]`` tensor). Returns ``(q, scales)``.
    """
    groups = token_groups(x, group_size)
    amax = groups.abs().amax(dim=-1, keepdim=True).to(torch.float32)
    scale = (amax / fp8_max).clamp(min=min_scale)
    if use_ue8m0:
        scale = ue8m0_round_up(scale)
    q = (groups.to(torch.float32) / scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)
    return group_outputs(q, scale, x.shape[-1], column_major_scales)


def token_groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """``x`` as ``[..., ceil(H/G), G]``, the last dim zero-padded to a multiple of ``G``."""
    hidden = x.shape[-1]
    num_groups = -(-hidden // group_size)
    padding = num_groups * group_size - hidden
    return (F.pad(x, (0, padding)) if padding else x).unflatten(-1, (num_groups, group_size))


def group_outputs(q_groups: torch.Tensor, scale: torch.Tensor, hidden: int,
                  column_major_scales: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` back to ``[..., H]`` (padding dropped) and the scales ``[..., ceil(H/G)]``, stored
    column-major when asked."""
    q = q_groups.flatten(-2)
    if q.shape[-1] != hidden:
        q = q[..., :hidden].contiguous()
    scales = scale.squeeze(-1)
    if column_major_scales:
        scales = scales.transpose(-2, -1).contiguous().transpose(-2, -1)
    return q, scales


def static_group_scales(scale: torch.Tensor, group_size: int, hidden: int) -> torch.Tensor:
    """Broadcasts static per-group scales ``[..., ceil(H/G)]`` to one scale per element."""
    return scale.repeat_interleave(group_size, dim=-1)[..., :hidden]


def tma_align_scales(scales: torch.Tensor) -> torch.Tensor:
    """The same column-major scales ``[..., T, n]`` stored in a ``[..., n, T4]`` buffer with
    ``T4 = ceil(T/4)*4`` (16-byte aligned columns, what TMA loads of the scales need)."""
    tokens = scales.shape[-2]
    aligned = -(-tokens // 4) * 4
    storage = scales.new_zeros(tuple(scales.shape[:-2]) + (scales.shape[-1], aligned))
    storage[..., :tokens] = scales.transpose(-2, -1)
    return storage[..., :tokens].transpose(-2, -1)


def pad_tokens(q: torch.Tensor, num_tokens: int | None) -> torch.Tensor:
    """Zero-pads the leading (token) dim of ``q`` up to ``num_tokens`` (never shrinks)."""
    if num_tokens is None or q.shape[0] >= num_tokens:
        return q
    # Pads the bits (zero bits are +0.0 in every fp8 format): Inductor cannot pad fp8 directly.
    bits = F.pad(q.view(torch.uint8), (0, 0) * (q.dim() - 1) + (0, num_tokens - q.shape[0]))
    return bits.view(q.dtype)


def rms_norm_dynamic_per_token_fp8_quant(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                                         scale_ub: torch.Tensor | None, fp8_dtype: torch.dtype, fp8_max: float,
                                         min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The fusion's spec is the composition: ``rms_norm`` (rounded to ``x.dtype``) then the dynamic
    per-token quant. A fused kernel must round the normalised value to ``x.dtype`` too."""
    return dynamic_per_token_scaled_fp8_quant(rms_norm(x, weight, eps), scale_ub, fp8_dtype, fp8_max, min_scale)
