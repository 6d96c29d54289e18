"""The norms' input checks (every path) and the small helpers the op classes share: the weight
without nn.Module's ``__getattr__``, unit-stride rows for the kernels, whether autograd records.
"""

from __future__ import annotations

import torch
from torch import nn

# ---- input checks (every path) -------------------------------------------------------------


def _check_float(op: str, arg: str, t: torch.Tensor) -> None:
    if not t.is_floating_point():
        raise TypeError(f"customop.{op}: {arg} must be a floating-point tensor, got {t.dtype}")


def _check_like(op: str, arg: str, t: torch.Tensor, x: torch.Tensor) -> None:
    """``t`` must be a float tensor with x's shape, dtype and device."""
    _check_float(op, arg, t)
    if t.device != x.device:
        raise ValueError(f"customop.{op}: {arg} is on {t.device} but x is on {x.device}")
    if t.shape != x.shape:
        raise ValueError(f"customop.{op}: {arg} has shape {tuple(t.shape)}, expected x's {tuple(x.shape)}")
    if t.dtype != x.dtype:
        raise TypeError(f"customop.{op}: {arg} has dtype {t.dtype}, expected x's {x.dtype}")


def _check_norm_inputs(op: str, hidden_size: int, x: torch.Tensor, weight: torch.Tensor | None,
                       others: dict[str, torch.Tensor | None]) -> None:
    """x is float with last dim ``hidden_size``; weight is float ``[hidden_size]`` on x's device;
    each of ``others`` (residual, z) matches x."""
    _check_float(op, "x", x)
    if x.dim() == 0 or x.shape[-1] != hidden_size:
        raise ValueError(f"customop.{op}: x has shape {tuple(x.shape)}, expected [..., {hidden_size}]")
    if weight is not None:
        _check_float(op, "weight", weight)
        if weight.device != x.device:
            raise ValueError(f"customop.{op}: weight is on {weight.device} but x is on {x.device}")
        if weight.shape != (hidden_size,):
            raise ValueError(f"customop.{op}: weight has shape {tuple(weight.shape)}, expected ({hidden_size},)")
    for arg, t in others.items():
        if t is not None:
            _check_like(op, arg, t, x)


def _norm_inputs_pass(hidden_size: int, x: torch.Tensor, weight: torch.Tensor | None,
                      residual: torch.Tensor | None) -> bool:
    """True when ``_check_norm_inputs`` would pass x, weight and residual: the same conditions
    without building an argument dict or a message (~1 us instead of ~3.5 on the CI box; hot
    paths call the full check only when this says no, so errors keep its messages)."""
    shape = x.shape
    if not shape or shape[-1] != hidden_size or not x.is_floating_point():
        return False
    cpu = x.is_cpu  # both on the CPU: no torch.device objects to build and compare
    if weight is not None and not (weight.is_floating_point() and weight.shape == (hidden_size,)
                                   and ((cpu and weight.is_cpu) or weight.device == x.device)):
        return False
    return residual is None or (residual.dtype == x.dtype and residual.shape == shape
                                and ((cpu and residual.is_cpu) or residual.device == x.device))


def _weight(op: nn.Module) -> torch.Tensor | None:
    """``op.weight`` without nn.Module's ``__getattr__`` (~1 us a call on the CI box: the normal
    lookup misses first)."""
    params = op._parameters
    return params["weight"] if "weight" in params else op.weight


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    # The kernels read rows with unit stride; a copy is cheaper than a strided kernel variant.
    return t if t.stride(-1) == 1 else t.contiguous()


def _autograd_records(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _check_affine(op: str, hidden_size: int, x: torch.Tensor, weight: torch.Tensor | None,
                  bias: torch.Tensor | None) -> None:
    """x, weight and bias of a layer norm. The parameters' dtype is x's, or fp32 under a bf16/fp16
    x (F.layer_norm's mixed mode; fp32 under fp16 x, say, would not run in vLLM either)."""
    _check_norm_inputs(op, hidden_size, x, weight, {})
    for arg, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if arg == "bias":
            _check_float(op, arg, t)
            if t.device != x.device:
                raise ValueError(f"customop.{op}: bias is on {t.device} but x is on {x.device}")
            if t.shape != (hidden_size,):
                raise ValueError(f"customop.{op}: bias has shape {tuple(t.shape)}, expected ({hidden_size},)")
        mixed = x.dtype in (torch.bfloat16, torch.float16) and t.dtype == torch.float32
        if t.dtype != x.dtype and not mixed:
            raise TypeError(f"customop.{op}: {arg} has dtype {t.dtype}, expected x's {x.dtype} "
                            "(or torch.float32 under a bf16/fp16 x)")
    if weight is not None and bias is not None and bias.dtype != weight.dtype:
        raise TypeError(f"customop.{op}: bias has dtype {bias.dtype}, expected weight's {weight.dtype}")
