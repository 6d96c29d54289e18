"""Kernel entry points of the norms family: ``torch.ops.customop.{rms_norm, fused_add_rms_norm,
gemma_rms_norm, gemma_fused_add_rms_norm, rms_norm_gated}``.

The schemas are a contract with the backends (Triton, XPU, TPU) that register device kernels for
them; do not change them. ``x`` is ``[..., hidden]``; kernels may require a unit-stride last dim
(the op classes make it so). The bodies below are the reference, which runs on any device; the
in-place ops compute out of place and write back with ``copy_``. The fakes give shapes only.
"""

from __future__ import annotations

import torch

from customop.ops import layernorm as _math

Tensor = torch.Tensor

#: Written out rather than inferred so that the contract reads exactly as the backends see it
#: (inference would spell ``int`` as ``SymInt`` and the alias sets as ``a0!``/``a1!``).
SCHEMAS = {
    "rms_norm": "(Tensor x, Tensor? weight, float eps) -> Tensor",
    "fused_add_rms_norm": "(Tensor(a!) x, Tensor(b!) residual, Tensor? weight, float eps) -> ()",
    "gemma_rms_norm": "(Tensor x, Tensor weight, float eps) -> Tensor",
    "gemma_fused_add_rms_norm": "(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()",
    "rms_norm_gated": "(Tensor x, Tensor weight, Tensor? z, float eps, int group_size, "
                      "bool norm_before_gate, bool sigmoid) -> Tensor",
}


@torch.library.custom_op("customop::rms_norm", mutates_args=(), schema=SCHEMAS["rms_norm"])
def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """RMSNorm of each row of x; the weight multiply happens in the weight's dtype."""
    return _math.rms_norm(x, weight, eps)


@rms_norm.register_fake
def _(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("customop::fused_add_rms_norm", mutates_args=("x", "residual"),
                         schema=SCHEMAS["fused_add_rms_norm"])
def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float) -> None:
    """In place: ``residual <- x + residual`` (added in fp32, stored in x's dtype),
    ``x <- rms_norm(x + residual)``."""
    out, new_residual = _math.fused_add_rms_norm(x, residual, weight, eps)
    residual.copy_(new_residual)
    x.copy_(out)


@fused_add_rms_norm.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float) -> None:
    return None


@torch.library.custom_op("customop::gemma_rms_norm", mutates_args=(), schema=SCHEMAS["gemma_rms_norm"])
def gemma_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Gemma RMSNorm: ``rms(x) * (1 + w)`` in fp32, cast to x's dtype."""
    return _math.gemma_rms_norm(x, weight, eps)


@gemma_rms_norm.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("customop::gemma_fused_add_rms_norm", mutates_args=("x", "residual"),
                         schema=SCHEMAS["gemma_fused_add_rms_norm"])
def gemma_fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    """In place: ``residual <- x + residual`` (fp32 add, stored in x's dtype),
    ``x <- gemma_rms_norm(x + residual)``."""
    out, new_residual = _math.gemma_fused_add_rms_norm(x, residual, weight, eps)
    residual.copy_(new_residual)
    x.copy_(out)


@gemma_fused_add_rms_norm.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    return None


@torch.library.custom_op("customop::rms_norm_gated", mutates_args=(), schema=SCHEMAS["rms_norm_gated"])
def rms_norm_gated(x: Tensor, weight: Tensor, z: Tensor | None, eps: float, group_size: int,
                   norm_before_gate: bool, sigmoid: bool) -> Tensor:
    """Gated RMSNorm over chunks of ``group_size`` lanes, all in fp32 (see the math module)."""
    return _math.rms_norm_gated(x, weight, z, eps, group_size, norm_before_gate, sigmoid)


@rms_norm_gated.register_fake
def _(x: Tensor, weight: Tensor, z: Tensor | None, eps: float, group_size: int,
      norm_before_gate: bool, sigmoid: bool) -> Tensor:
    return torch.empty_like(x)
