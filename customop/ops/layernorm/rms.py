"""The RMS norms: RMSNorm (+ fused residual add), GemmaRMSNorm (+ fused residual add) and
RMSNormGated (Mamba-2's grouped gated norm), with the gate activations FusedRMSNormGated shares.
"""

from __future__ import annotations

import torch
from torch import nn

from customop.backends.cpu import eager, run_tiered
from customop.custom_op import CustomOp
from customop.math.layernorm import (
    fused_add_rms_norm, gemma_fused_add_rms_norm, gemma_rms_norm, rms_norm, rms_norm_gated,
)
from customop.ops.layernorm.checks import (
    _autograd_records, _check_norm_inputs, _last_dim_contiguous, _norm_inputs_pass, _weight,
)
from customop.ops.layernorm.cpu_tiers import GEMMA_RMS_NORM_CPU_TIERS, RMS_NORM_CPU_TIERS, RMS_NORM_GATED_CPU_TIERS

# ---- the ops -----------------------------------------------------------------------------------


@CustomOp.register("rms_norm")
class RMSNorm(CustomOp):
    """Root-mean-square norm (Llama), optionally fused with the residual add.

    ``forward(x)`` returns the normalised ``x``; ``forward(x, residual)`` computes
    ``h = x + residual`` and returns ``(rms_norm(h), h)``. The kernel paths write those results
    into ``x`` and ``residual`` and return them; the native and CPU paths return new tensors:
    **callers must use the returned tensors**.

    ``var_hidden_size`` (when it differs from ``hidden_size``) computes the variance over the
    first ``var_hidden_size`` lanes only; the kernels do not support it, so that case, and the
    fused case with a weight whose dtype differs from x's, run ``forward_native`` everywhere.
    ``has_weight=False`` normalises without a weight.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, var_hidden_size: int | None = None,
                 has_weight: bool = True, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.variance_size_override = None if var_hidden_size in (None, hidden_size) else var_hidden_size
        if self.variance_size_override is not None and not 0 < self.variance_size_override <= hidden_size:
            raise ValueError(f"customop.rms_norm: var_hidden_size={var_hidden_size} must be in (0, {hidden_size}]")
        self.has_weight = has_weight
        weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype)) if has_weight else None
        self.register_parameter("weight", weight)

    cpu_tiers = RMS_NORM_CPU_TIERS

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        _check_norm_inputs(self.name, self.hidden_size, x, self.weight, {"residual": residual})
        return self._spec(x, residual)

    def _spec(self, x: torch.Tensor, residual: torch.Tensor | None):
        """The math on inputs already checked (forward_kernel's cases without a kernel come here)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps, self.variance_size_override)
        return fused_add_rms_norm(x, residual, self.weight, self.eps, self.variance_size_override)

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        # per-call cost matters here (issue 18: ~30 us calls against torch.compile's own)
        weight, eps, variance_size = _weight(self), self.eps, self.variance_size_override
        if not _norm_inputs_pass(self.hidden_size, x, weight, residual):
            _check_norm_inputs(self.name, self.hidden_size, x, weight, {"residual": residual})
        static = (weight is None, eps, variance_size)  # what the compiled graph guards on besides tensors
        if residual is None:
            return run_tiered(self.cpu_tiers, rms_norm, x, weight, eps, variance_size, eager=eager.rms_norm,
                              static=static)
        return run_tiered(self.cpu_tiers, fused_add_rms_norm, x, residual, weight, eps, variance_size,
                          eager=eager.fused_add_rms_norm, static=static)

    def forward_cuda(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.forward_kernel(x, residual)

    forward_xpu = forward_tpu = forward_cuda

    def forward_kernel(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """The ``torch.ops.customop`` call every accelerator shares; cases without a kernel
        (a variance subset; the fused add with a weight dtype other than x's, or while autograd
        records: torch attaches no backward to an in-place op) run the spec."""
        _check_norm_inputs(self.name, self.hidden_size, x, self.weight, {"residual": residual})
        mixed_weight = self.weight is not None and self.weight.dtype != x.dtype
        if self.variance_size_override is not None or (
                residual is not None and (mixed_weight or _autograd_records(x, residual))):
            return self._spec(x, residual)
        if residual is None:
            return torch.ops.customop.rms_norm(_last_dim_contiguous(x), self.weight, self.eps)
        x, residual = _last_dim_contiguous(x), _last_dim_contiguous(residual)
        torch.ops.customop.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x, residual

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, eps={self.eps}, var_hidden_size={self.variance_size_override}, "
                f"has_weight={self.has_weight}")


@CustomOp.register("gemma_rms_norm")
class GemmaRMSNorm(CustomOp):
    """Gemma's RMSNorm: the weight is stored as an offset (init zeros) and applied as ``1 + w``,
    in fp32, before the single cast to x's dtype. The residual add is done in fp32 and the new
    residual is returned in x's dtype. Same in-place contract as ``RMSNorm``: the kernel paths
    write into ``x`` and ``residual``, the native and CPU paths return new tensors; **callers must
    use the returned tensors**."""

    cpu_tiers = GEMMA_RMS_NORM_CPU_TIERS

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size))

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        _check_norm_inputs(self.name, self.hidden_size, x, self.weight, {"residual": residual})
        return self._spec(x, residual)

    def _spec(self, x: torch.Tensor, residual: torch.Tensor | None):
        """The math on inputs already checked."""
        if residual is None:
            return gemma_rms_norm(x, self.weight, self.eps)
        return gemma_fused_add_rms_norm(x, residual, self.weight, self.eps)

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        _check_norm_inputs(self.name, self.hidden_size, x, self.weight, {"residual": residual})
        if residual is None:
            return run_tiered(self.cpu_tiers, gemma_rms_norm, x, self.weight, self.eps, eager=eager.gemma_rms_norm)
        return run_tiered(self.cpu_tiers, gemma_fused_add_rms_norm, x, residual, self.weight, self.eps,
                          eager=eager.gemma_fused_add_rms_norm)

    def forward_cuda(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.forward_kernel(x, residual)

    forward_xpu = forward_tpu = forward_cuda

    def forward_kernel(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """The ``torch.ops.customop`` call every accelerator shares (the fused add runs
        spec while autograd records: torch attaches no backward to an in-place op)."""
        _check_norm_inputs(self.name, self.hidden_size, x, self.weight, {"residual": residual})
        if residual is not None and _autograd_records(x, residual):
            return self._spec(x, residual)
        if residual is None:
            return torch.ops.customop.gemma_rms_norm(_last_dim_contiguous(x), self.weight, self.eps)
        x, residual = _last_dim_contiguous(x), _last_dim_contiguous(residual)
        torch.ops.customop.gemma_fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x, residual

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, eps={self.eps}"


_GATE_ACTIVATIONS = {"swish": False, "silu": False, "sigmoid": True}  # name -> uses sigmoid


@CustomOp.register("rms_norm_gated")
class RMSNormGated(CustomOp):
    """RMSNorm with an optional gate ``act(z)`` (Mamba2 / gated delta-net), all math in fp32.

    ``norm_before_gate=False`` (the constructor default; vLLM's static helper defaults to True):
    ``rms(x * act(z)) * w``; ``True``: ``rms(x) * w * act(z)``. ``act`` is silu (``"swish"`` or
    ``"silu"``) or sigmoid. ``group_size`` normalises each chunk of that many lanes separately
    (``None``: the whole row). The weight starts at ones; there is no bias. Never in place.
    ``dtype`` is the weight's dtype (vLLM accepts it too).
    """

    cpu_tiers = RMS_NORM_GATED_CPU_TIERS

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: int | None = None,
                 norm_before_gate: bool = False, activation: str = "swish",
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if activation not in _GATE_ACTIVATIONS:
            raise ValueError(f"customop.rms_norm_gated: activation={activation!r} is not one of "
                             f"{sorted(_GATE_ACTIVATIONS)}")
        group_size = hidden_size if group_size is None else group_size
        if group_size <= 0 or hidden_size % group_size:
            raise ValueError(f"customop.rms_norm_gated: group_size={group_size} must divide hidden_size={hidden_size}")
        self.hidden_size = hidden_size
        self.eps = eps
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.activation = activation
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def _args(self, x: torch.Tensor, z: torch.Tensor | None) -> tuple:
        return (x, self.weight, z, self.eps, self.group_size, self.norm_before_gate, _GATE_ACTIVATIONS[self.activation])

    def forward_native(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        _check_norm_inputs(self.name, self.hidden_size, x, self.weight, {"z": z})
        return rms_norm_gated(*self._args(x, z))

    def forward_cpu(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        # per-call cost matters at decode sizes (a few us against the kernel's): the checks'
        # conditions in one pass (z's are a residual's), the full check and its errors only when
        # that says no; the weight without nn.Module's __getattr__
        weight = _weight(self)
        if not _norm_inputs_pass(self.hidden_size, x, weight, z):
            _check_norm_inputs(self.name, self.hidden_size, x, weight, {"z": z})
        return run_tiered(self.cpu_tiers, rms_norm_gated, x, weight, z, self.eps, self.group_size,
                          self.norm_before_gate, _GATE_ACTIVATIONS[self.activation])

    def forward_cuda(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        return self.forward_kernel(x, z)

    forward_xpu = forward_tpu = forward_cuda

    def forward_kernel(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        """The ``torch.ops.customop`` call every accelerator shares."""
        _check_norm_inputs(self.name, self.hidden_size, x, self.weight, {"z": z})
        z = None if z is None else _last_dim_contiguous(z)
        return torch.ops.customop.rms_norm_gated(*self._args(_last_dim_contiguous(x), z))

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, eps={self.eps}, group_size={self.group_size}, "
                f"norm_before_gate={self.norm_before_gate}, activation={self.activation!r}")
