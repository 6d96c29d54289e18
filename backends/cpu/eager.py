"""Eager CPU paths for inputs below ``forward_cpu``'s compile thresholds (decode-sized calls).

Small CPU calls are bound by per-kernel and per-allocation overhead, not by arithmetic, so each
function here runs the spec's own operations, in the spec's order and dtypes, with fewer kernels
or temporaries:

- activations write each step into one temporary with in-place ops: the same ATen kernel and
  the same rounding per step, so the result is **bitwise** the spec's (tests/ops/test_cpu_eager.py
  checks that), with 1-2 allocations instead of 2-9; the gated ones take both halves from one
  ``chunk`` call;
- fp8 quant (per tensor, per token, per group, static) the same way, bitwise; the float32
  conversion of x happens inside ``torch.mul``/``torch.div`` (type promotion) instead of a copy;
- norms whose weight multiply happens in fp32 (fp32 weight or none; Gemma always) call ATen's
  fused RMSNorm on the fp32 values, which is the spec's formula in one kernel (equal to 1 ulp;
  bitwise on torch 2.13). A bf16/fp16 weight makes the spec round before the multiply (HF Llama),
  which the fused kernel does not do, so those keep the spec.

In-place steps overwrite values that autograd may have saved, so callers use the activations and
the quant here only while autograd is not recording for ``x``, and none of these under
``torch.compile``, where Inductor fuses the spec itself.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from customop.math import quant as qm

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


# ---- activations (bitwise the spec: customop/math/activation.py) ---------------------


# The gated ones take both halves from one ``chunk`` call: ~1 us less than two ``x[..., :d]``
# slices at decode sizes.


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, -1)
    return F.silu(gate).mul_(up)


def mul_and_silu(x: torch.Tensor) -> torch.Tensor:
    up, gate = x.chunk(2, -1)
    return F.silu(gate).mul_(up)


def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    gate, up = x.chunk(2, -1)
    return F.gelu(gate, approximate=approximate).mul_(up)


def fatrelu_and_mul(x: torch.Tensor, threshold: float = 0.0) -> torch.Tensor:
    gate, up = x.chunk(2, -1)
    return torch.threshold(gate, threshold, 0.0).mul_(up)  # torch.*: no F.* Python wrapper


def swigluoai_and_mul(x: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    # spec: (clamp(u) + 1) * (clamp(g) * sigmoid(clamp(g) * alpha)) on interleaved lanes
    gate = x[..., ::2].clamp(max=limit)
    up = x[..., 1::2].clamp(min=-limit, max=limit)
    gated = (gate * alpha).sigmoid_().mul_(gate)
    return up.add_(1).mul_(gated)


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    # spec: 0.5 * x * (1.0 + tanh(c * (x + 0.044715 * x^3)))
    inner = torch.pow(x, 3.0).mul_(0.044715).add_(x).mul_(_SQRT_2_OVER_PI).tanh_().add_(1.0)
    return (0.5 * x).mul_(inner)


def gelu_fast(x: torch.Tensor) -> torch.Tensor:
    # spec: 0.5 * x * (1.0 + tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))
    inner = (0.044715 * x).mul_(x).add_(1.0)
    inner = (x * 0.7978845608).mul_(inner).tanh_().add_(1.0)
    return (0.5 * x).mul_(inner)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    # spec: x * sigmoid(1.702 * x)
    return (1.702 * x).sigmoid_().mul_(x)


def relu2(x: torch.Tensor) -> torch.Tensor:
    # spec: square(relu(x))
    return torch.relu(x).square_()


# ---- norms (the spec's formula where its weight multiply is in fp32) --------------------------


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)  # a no-op .to() still costs ~0.9 us


def _fused_rms(xf: torch.Tensor, weight: torch.Tensor | None, eps: float, dtype: torch.dtype) -> torch.Tensor:
    return _cast(F.rms_norm(xf, (xf.size(-1),), weight, eps), dtype)


def _add_then_rms(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    # the fused variants normalise the fp32 sum and return it in x's dtype as the new residual
    h = x.float() + residual.float()
    return _fused_rms(h, weight, eps, x.dtype), _cast(h, x.dtype)


def _fp32_weight(weight: torch.Tensor | None) -> bool:
    return weight is None or weight.dtype == torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             variance_size: int | None = None) -> torch.Tensor | None:
    """The spec's value, or None when this case must run the spec (a low-precision weight, or a
    variance over part of the row)."""
    if variance_size is not None or not _fp32_weight(weight):
        return None
    return _fused_rms(x.float(), weight, eps, x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float,
                       variance_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    if variance_size is not None or not _fp32_weight(weight):
        return None
    return _add_then_rms(x, residual, weight, eps)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _fused_rms(x.float(), 1.0 + weight.float(), eps, x.dtype)


def gemma_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _add_then_rms(x, residual, 1.0 + weight.float(), eps)


# ---- fp8 quant (bitwise the spec: customop/math/quant.py) --------------------
# float32 inputs and fp16/bf16 ones (torch.mul promotes them to float32 exactly as the spec's
# x.to(float32) does); the scale is at least 1-D here, so it takes part in the promotion.

QUANT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def scaled_fp8_quant(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, fp8_max: float) -> torch.Tensor:
    # spec: clamp(float32(x) * (1/float32(scale)), -MAX, MAX).to(fp8)
    inverse = scale.to(torch.float32).reciprocal()
    if inverse.dim() == 0:  # a 0-d float32 tensor would not promote a bf16 x
        inverse = inverse.reshape(1)
    return torch.mul(x, inverse).clamp_(-fp8_max, fp8_max).to(fp8_dtype)


def dynamic_scaled_fp8_quant(x: torch.Tensor, fp8_dtype: torch.dtype, fp8_max: float,
                             min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.abs().max().to(torch.float32).reshape(1).div(fp8_max).clamp_(min=min_scale)
    return scaled_fp8_quant(x, scale, fp8_dtype, fp8_max), scale


def dynamic_per_token_scaled_fp8_quant(x: torch.Tensor, scale_ub: torch.Tensor | None, fp8_dtype: torch.dtype,
                                       fp8_max: float, min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x.abs().amax(dim=-1, keepdim=True).to(torch.float32)
    if scale_ub is not None:
        amax = torch.minimum(amax, scale_ub.to(torch.float32).reshape(()))
    scale = amax.div(fp8_max).clamp_(min=min_scale)
    return scaled_fp8_quant(x, scale, fp8_dtype, fp8_max), scale


def per_token_group_fp8_quant(x: torch.Tensor, group_size: int, column_major_scales: bool, use_ue8m0: bool,
                              fp8_dtype: torch.dtype, fp8_max: float,
                              min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    # the spec's own grouping, rounding and layout helpers; only the arithmetic in between runs
    # in place
    groups = qm.token_groups(x, group_size)
    scale = groups.abs().amax(dim=-1, keepdim=True).to(torch.float32).div_(fp8_max).clamp_(min=min_scale)
    if use_ue8m0:
        scale = qm.ue8m0_round_up(scale)
    q = torch.div(groups, scale).clamp_(-fp8_max, fp8_max).to(fp8_dtype)
    return qm.group_outputs(q, scale, x.shape[-1], column_major_scales)
