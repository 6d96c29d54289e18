"""The norms' math: the spec each norm op's ``forward_native`` runs, as pure functions.

The rounding order follows vLLM's native paths, because checkpoints are trained against it: plain
RMSNorm casts the normalised fp32 value to the *weight* dtype before multiplying (Hugging Face
Llama numerics), Gemma multiplies by ``1 + w`` in fp32 and casts last, and the gated norm does
everything in fp32. The layer norms (``layer_norm``, Nemotron's ``1 + w`` variant) are
``F.layer_norm``, which computes in fp32 for bf16/fp16 inputs and rounds once; Nemotron's residual
add rounds to the input dtype first (vLLM adds in the input dtype there, not in fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             variance_size: int | None = None) -> torch.Tensor:
    """``y = x / sqrt(mean(x[..., :V]^2) + eps)`` in fp32 (``V`` = ``variance_size`` or the full
    last dim); with a weight ``y = y.to(w.dtype) * w`` (multiply in the weight dtype); returns
    ``y`` in x's dtype."""
    xf = x.float()
    x_var = xf if variance_size is None else xf[..., :variance_size]
    y = xf * torch.rsqrt(x_var.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y.to(weight.dtype) * weight
    return y.to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                       eps: float, variance_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = fp32(x) + fp32(residual)``; returns ``(rms_norm(h) in x's dtype, h in x's dtype)``.
    The unrounded fp32 sum is what gets normalised."""
    h = x.float() + residual.float()
    return rms_norm(h, weight, eps, variance_size).to(x.dtype), h.to(x.dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``y = x / sqrt(mean(x^2) + eps) * (1 + w)``, all in fp32, cast to x's dtype at the end
    (Gemma stores ``w`` as an offset from 1)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def gemma_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = fp32(x) + fp32(residual)``; returns ``(gemma_rms_norm(h) in x's dtype, h in x's dtype)``."""
    h = x.float() + residual.float()
    return gemma_rms_norm(h, weight, eps).to(x.dtype), h.to(x.dtype)


def rms_norm_gated(x: torch.Tensor, weight: torch.Tensor, z: torch.Tensor | None, eps: float,
                   group_size: int, norm_before_gate: bool, sigmoid: bool) -> torch.Tensor:
    """All in fp32, ``act = sigmoid if sigmoid else silu``:
    ``norm_before_gate=False``: ``y = rms(x * act(z)) * w``; ``True``: ``y = rms(x) * w * act(z)``.
    ``rms`` normalises each chunk of ``group_size`` lanes separately (``group_size = hidden`` is
    the plain norm). Without ``z`` there is no gate. Returns ``y`` in x's dtype."""
    xf = x.float()
    gate = None if z is None else (torch.sigmoid(z.float()) if sigmoid else F.silu(z.float()))
    if gate is not None and not norm_before_gate:
        xf = xf * gate
    groups = xf.unflatten(-1, (-1, group_size))
    y = (groups * torch.rsqrt(groups.pow(2).mean(dim=-1, keepdim=True) + eps)).flatten(-2)
    y = y * weight.float()
    if gate is not None and norm_before_gate:
        y = y * gate
    return y.to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               eps: float) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps) * w + b`` over the last dim (biased variance), vLLM's
    ``LayerNorm``: the compute dtype is ``promote(x, w)`` (x's without a weight), so a bf16 input
    with an fp32 weight is normalised in fp32; returns x's dtype. The weight is never cast."""
    compute = x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype)
    xc = x if compute == x.dtype else x.to(compute)
    return F.layer_norm(xc, (x.shape[-1],), weight, bias, eps).to(x.dtype)


def nemotron_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        eps: float) -> torch.Tensor:
    """Nemotron's LayerNorm1P: ``layer_norm(x)`` with the weight ``1 + w``, where ``1 + w`` is
    formed in the weight's dtype (a bf16 weight gives a bf16 ``1 + w``)."""
    return F.layer_norm(x, (x.shape[-1],), weight + 1, bias, eps).to(x.dtype)


def fused_add_nemotron_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                  bias: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` added in x's dtype (rounded there, unlike the RMS norms' fp32 add);
    returns ``(nemotron_layer_norm(h), h)``."""
    h = x + residual
    return nemotron_layer_norm(h, weight, bias, eps), h


def fused_rms_norm_gated(x: torch.Tensor, g: torch.Tensor, weight: torch.Tensor | None, eps: float,
                         sigmoid: bool) -> torch.Tensor:
    """The KDA output norm (vLLM's ``FusedRMSNormGated``), all in fp32: ``y = rms(x) * w`` (no
    weight: no multiply), then the gate always after the norm: ``y * g * sigmoid(g)`` (swish/silu)
    or ``y * sigmoid(g)``; returned in x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    gf = g.float()
    y = y * torch.sigmoid(gf) if sigmoid else y * gf * torch.sigmoid(gf)
    return y.to(x.dtype)


def fused_add_rms_norm_gated(x: torch.Tensor, g: torch.Tensor, residual: torch.Tensor,
                             weight: torch.Tensor | None, eps: float,
                             sigmoid: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = fp32(x) + fp32(residual)``; returns ``(fused_rms_norm_gated(s) in x's dtype, s in
    residual's dtype)``: the fp32 sum is what gets normalised."""
    s = x.float() + residual.float()
    return fused_rms_norm_gated(s, g, weight, eps, sigmoid).to(x.dtype), s.to(residual.dtype)
