"""FusedRMSNormGated (vLLM 0.33's ``fused_rms_norm_gated``, the KDA output norm; + fused residual
add and ``prenorm``).
"""

from __future__ import annotations

import torch
from torch import nn

from customop.backends.cpu import run_tiered
from customop.custom_op import CustomOp
from customop.math.layernorm import fused_add_rms_norm_gated, fused_rms_norm_gated
from customop.ops.layernorm.checks import (
    _autograd_records, _check_float, _check_norm_inputs, _last_dim_contiguous, _norm_inputs_pass, _weight,
)
from customop.ops.layernorm.cpu_tiers import FUSED_RMS_NORM_GATED_CPU_TIERS
from customop.ops.layernorm.rms import _GATE_ACTIVATIONS

# ---- FusedRMSNormGated (vLLM 0.33: fused_rms_norm_gated, the KDA output norm) -------------------


@CustomOp.register("fused_rms_norm_gated")
class FusedRMSNormGated(CustomOp):
    """vLLM 0.33's ``FusedRMSNormGated``: ``rms(x) * w``, then the gate, always after the norm:
    ``* g * sigmoid(g)`` (``"swish"``/``"silu"``) or ``* sigmoid(g)``; all in fp32, returned in
    x's dtype. There is no group size and no ``norm_before_gate`` (the math is
    ``RMSNormGated``'s with ``norm_before_gate=True`` over whole rows).

    ``forward(x, g, residual=None, prenorm=False, residual_in_fp32=False)``: with a residual the
    fp32 sum ``s = x + residual`` is normalised; ``prenorm`` returns ``(y, residual_out)`` where
    ``residual_out`` is ``s`` in residual's dtype (without a residual: x, in fp32 if
    ``residual_in_fp32``). ``elementwise_affine=False``: no weight. No bias.

    Deliberate differences from vLLM 0.33: the weight starts at ones (vLLM leaves ``torch.empty``
    memory until a checkpoint loads); no path writes into x (vLLM's kernel writes y over x's
    buffer, so its ``prenorm`` call without a residual returns y twice; here the second element
    is x, the pre-norm value, as the residual stream needs); the residual and prenorm forms have a
    native path here (vLLM's native method calls its Triton kernel for them).
    """

    cpu_tiers = FUSED_RMS_NORM_GATED_CPU_TIERS

    def __init__(self, hidden_size: int, elementwise_affine: bool = True, eps: float = 1e-5,
                 activation: str = "swish", device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if activation not in _GATE_ACTIVATIONS:
            raise ValueError(f"customop.fused_rms_norm_gated: activation={activation!r} is not one of "
                             f"{sorted(_GATE_ACTIVATIONS)}")
        self.hidden_size = hidden_size
        self.elementwise_affine = elementwise_affine
        self.eps = eps
        self.activation = activation
        weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype)) if elementwise_affine else None
        self.register_parameter("weight", weight)
        self.register_parameter("bias", None)

    @property
    def sigmoid(self) -> bool:
        return _GATE_ACTIVATIONS[self.activation]

    def _check(self, x: torch.Tensor, g: torch.Tensor, residual: torch.Tensor | None) -> None:
        _check_norm_inputs(self.name, self.hidden_size, x, self.weight, {"g": g})
        if residual is not None:  # (any float dtype: residual_out keeps it)
            _check_float(self.name, "residual", residual)
            if residual.device != x.device:
                raise ValueError(f"customop.{self.name}: residual is on {residual.device} but x is on {x.device}")
            if residual.shape != x.shape:
                raise ValueError(f"customop.{self.name}: residual has shape {tuple(residual.shape)}, "
                                 f"expected x's {tuple(x.shape)}")

    @staticmethod
    def _prenorm_residual(x: torch.Tensor, residual_in_fp32: bool) -> torch.Tensor:
        return x.float() if residual_in_fp32 else x

    def _run(self, run_plain, run_fused, x, g, residual, prenorm, residual_in_fp32):
        if residual is None:
            y = run_plain(x, g)
            return (y, self._prenorm_residual(x, residual_in_fp32)) if prenorm else y
        y, residual_out = run_fused(x, g, residual)
        return (y, residual_out) if prenorm else y

    def forward_native(self, x: torch.Tensor, g: torch.Tensor, residual: torch.Tensor | None = None,
                       prenorm: bool = False, residual_in_fp32: bool = False):
        self._check(x, g, residual)
        return self._run(self._plain_spec, self._fused_spec, x, g, residual, prenorm, residual_in_fp32)

    def _plain_spec(self, x, g):
        return fused_rms_norm_gated(x, g, self.weight, self.eps, self.sigmoid)

    def _fused_spec(self, x, g, residual):
        return fused_add_rms_norm_gated(x, g, residual, self.weight, self.eps, self.sigmoid)

    def forward_cpu(self, x: torch.Tensor, g: torch.Tensor, residual: torch.Tensor | None = None,
                    prenorm: bool = False, residual_in_fp32: bool = False):
        # the plain form's per-call cost matters at decode sizes (RMSNormGated.forward_cpu's
        # shortcuts: the checks' conditions in one pass, g's as a residual's; the weight without
        # nn.Module's __getattr__); the residual form takes the full check
        weight = _weight(self)
        if residual is not None or not _norm_inputs_pass(self.hidden_size, x, weight, g):
            self._check(x, g, residual)
        sigmoid = self.sigmoid
        return self._run(
            lambda x, g: run_tiered(self.cpu_tiers, fused_rms_norm_gated, x, g, weight, self.eps, sigmoid),
            lambda x, g, r: run_tiered(self.cpu_tiers, fused_add_rms_norm_gated, x, g, r, weight, self.eps, sigmoid),
            x, g, residual, prenorm, residual_in_fp32)

    def forward_cuda(self, x: torch.Tensor, g: torch.Tensor, residual: torch.Tensor | None = None,
                     prenorm: bool = False, residual_in_fp32: bool = False):
        return self.forward_kernel(x, g, residual, prenorm, residual_in_fp32)

    forward_xpu = forward_tpu = forward_cuda

    def forward_kernel(self, x: torch.Tensor, g: torch.Tensor, residual: torch.Tensor | None = None,
                       prenorm: bool = False, residual_in_fp32: bool = False):
        """The ``torch.ops.customop`` calls every accelerator shares (the fused add runs the spec
        while autograd records: its op has no backward)."""
        self._check(x, g, residual)

        def fused(x, g, r):
            if _autograd_records(x, g, r, self.weight):
                return self._fused_spec(x, g, r)
            return torch.ops.customop.fused_add_rms_norm_gated(
                _last_dim_contiguous(x), _last_dim_contiguous(g), _last_dim_contiguous(r), self.weight, self.eps,
                self.sigmoid)

        return self._run(
            lambda x, g: torch.ops.customop.fused_rms_norm_gated(
                _last_dim_contiguous(x), _last_dim_contiguous(g), self.weight, self.eps, self.sigmoid),
            fused, x, g, residual, prenorm, residual_in_fp32)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, elementwise_affine={self.elementwise_affine}, eps={self.eps}, "
                f"activation={self.activation!r}")
