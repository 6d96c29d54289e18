"""The layer norms: LayerNorm (vLLM 0.33's ``layer_norm``) and NemotronLayerNorm1P (``1 + w``,
+ fused residual add).
"""

from __future__ import annotations

import torch
from torch import nn

from customop.backends.cpu import run_tiered
from customop.custom_op import CustomOp
from customop.math.layernorm import fused_add_nemotron_layer_norm, layer_norm, nemotron_layer_norm
from customop.ops.layernorm.checks import _autograd_records, _check_affine, _check_like, _last_dim_contiguous
from customop.ops.layernorm.cpu_tiers import FUSED_ADD_LAYER_NORM_CPU_TIERS, LAYER_NORM_CPU_TIERS

# ---- layer norms (vLLM 0.33: layer_norm, nemotron_layer_norm) ------------------------------------


@CustomOp.register("layer_norm")
class LayerNorm(CustomOp):
    """vLLM 0.33's ``LayerNorm``: ``(x - mean) / sqrt(var + eps) * w + b`` over the last dim.

    ``elementwise_affine=False``: no weight and no bias (``bias`` ignored); ``bias=False``: a
    weight only. The weight starts at ones and the bias at zeros, in ``dtype`` (default: torch's
    default dtype). The compute dtype is ``promote(x, w)``: a bf16/fp16 input with an fp32 weight
    is normalised in fp32 and cast back. There is no residual argument (vLLM 0.33 has none).
    Never in place.
    """

    cpu_tiers = LAYER_NORM_CPU_TIERS

    def __init__(self, hidden_size: int, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        dtype = dtype or torch.get_default_dtype()
        weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype)) if elementwise_affine else None
        bias_p = nn.Parameter(torch.zeros(hidden_size, dtype=dtype)) if elementwise_affine and bias else None
        self.register_parameter("weight", weight)
        self.register_parameter("bias", bias_p)

    def _check(self, x: torch.Tensor) -> None:
        _check_affine(self.name, self.hidden_size, x, self.weight, self.bias)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        return layer_norm(x, self.weight, self.bias, self.eps)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        return run_tiered(self.cpu_tiers, layer_norm, x, self.weight, self.bias, self.eps)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_kernel(x)

    forward_xpu = forward_tpu = forward_cuda

    def forward_kernel(self, x: torch.Tensor) -> torch.Tensor:
        """The ``torch.ops.customop`` call every accelerator shares (fp32 math, one cast to x's
        dtype: what ``promote(x, w)`` gives for the dtypes ``_check_affine`` lets through)."""
        self._check(x)
        return torch.ops.customop.layer_norm(_last_dim_contiguous(x), self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
                f"bias={self.bias is not None}")


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype for x's device while autocast is on there (Nemotron's norm casts to it)."""
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


@CustomOp.register("nemotron_layer_norm")
class NemotronLayerNorm1P(CustomOp):
    """Nemotron's LayerNorm1P (vLLM 0.33's ``nemotron_layer_norm``): a layer norm whose weight is
    stored as an offset from 1 (weight and bias start at zeros, in torch's default dtype) and
    applied as ``1 + w``, formed in the weight's dtype.

    ``forward(x, residual)`` adds ``h = x + residual`` **in x's dtype** (no fp32 add, unlike
    RMSNorm) and returns ``(norm(h), h)``. Same in-place contract as ``RMSNorm``: the kernel paths
    write into ``x`` and ``residual``, the native and CPU paths return new tensors; **callers must
    use the returned tensors**. Under torch autocast, x, ``1 + w`` and the bias are cast to the
    autocast dtype first, as vLLM does (every path runs the spec then).
    """

    cpu_tiers = LAYER_NORM_CPU_TIERS
    fused_add_cpu_tiers = FUSED_ADD_LAYER_NORM_CPU_TIERS

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))

    def _check(self, x: torch.Tensor, residual: torch.Tensor | None) -> None:
        _check_affine(self.name, self.hidden_size, x, self.weight, self.bias)
        if residual is not None:
            _check_like(self.name, "residual", residual, x)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        self._check(x, residual)
        return self._spec(x, residual)

    def _spec(self, x: torch.Tensor, residual: torch.Tensor | None):
        """The math on inputs already checked, autocast included."""
        dtype = _autocast_dtype(x)
        if dtype is None:
            if residual is None:
                return nemotron_layer_norm(x, self.weight, self.bias, self.eps)
            return fused_add_nemotron_layer_norm(x, residual, self.weight, self.bias, self.eps)
        h = x if residual is None else x + residual
        with torch.autocast(x.device.type, enabled=False):
            y = torch.nn.functional.layer_norm(h.to(dtype), (self.hidden_size,), (self.weight + 1).to(dtype),
                                               None if self.bias is None else self.bias.to(dtype), self.eps)
        return y if residual is None else (y, h)

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        self._check(x, residual)
        if _autocast_dtype(x) is not None:
            return self._spec(x, residual)
        if residual is None:
            return run_tiered(self.cpu_tiers, nemotron_layer_norm, x, self.weight, self.bias, self.eps)
        return run_tiered(self.fused_add_cpu_tiers, fused_add_nemotron_layer_norm, x, residual, self.weight,
                          self.bias, self.eps)

    def forward_cuda(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.forward_kernel(x, residual)

    forward_xpu = forward_tpu = forward_cuda

    def forward_kernel(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """The ``torch.ops.customop`` call every accelerator shares; autocast, and the fused add
        while autograd records (an in-place op has no backward), run the spec."""
        self._check(x, residual)
        if _autocast_dtype(x) is not None or (residual is not None and _autograd_records(x, residual)):
            return self._spec(x, residual)
        if residual is None:
            return torch.ops.customop.nemotron_layer_norm(_last_dim_contiguous(x), self.weight, self.bias, self.eps)
        x, residual = _last_dim_contiguous(x), _last_dim_contiguous(residual)
        torch.ops.customop.fused_add_nemotron_layer_norm(x, residual, self.weight, self.bias, self.eps)
        return x, residual

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, eps={self.eps}"
