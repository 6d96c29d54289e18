"""Norms: RMSNorm (+ fused residual add), GemmaRMSNorm, RMSNormGated, LayerNorm,
NemotronLayerNorm1P (+ fused residual add) and FusedRMSNormGated (+ fused residual add).

The math (``customop/math/layernorm.py``, re-exported here) follows vLLM's, rounding order
included, because checkpoints are trained against it.

In-place contract (fused residual add): the kernel paths (``forward_cuda``/``forward_hip``/
``forward_xpu``/``forward_tpu``) write the normalised output into ``x`` and the new residual into ``residual`` and
return those two tensors; ``forward_native`` and ``forward_cpu`` return new tensors and leave the
inputs alone. Either may happen, so **callers must use the returned tensors**.
"""

from __future__ import annotations

import torch
from torch import nn

from customop.backends.cpu import CpuTiers, eager, run_tiered
from customop.custom_op import CustomOp
from customop.math.layernorm import (  # noqa: F401  (the spec, re-exported here)
    fused_add_nemotron_layer_norm, fused_add_rms_norm, fused_add_rms_norm_gated, fused_rms_norm_gated,
    gemma_fused_add_rms_norm, gemma_rms_norm, layer_norm, nemotron_layer_norm, rms_norm, rms_norm_gated,
)

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


# ---- CPU thresholds ----------------------------------------------------------------------------

#: Measured on the 2-core CI box (benchmarks/results/cpu_layernorm.md): a compiled call has a floor
#: of ~18 us, about what the whole eager op costs on a few thousand elements. In bf16/fp16, where
#: eager also pays separate cast kernels, compiled wins from one 4096-wide token; in fp32 it loses
#: up to 4x4096 and wins from 8x4096. Below the threshold the norms whose weight multiply is fp32
#: run ATen's fused RMSNorm (backends/cpu/eager.py); the others run the spec.
_NORM_THRESHOLDS = dict(min_numel=4096, by_dtype={torch.float32: 32768}, dynamic_hidden=False)

#: RMSNorm's ``y.to(w.dtype) * w`` must round y to bf16/fp16 before the multiply (HF Llama), but
#: Inductor fuses the cast away unless told to emulate eager's casts; without it 26% of bf16 outputs
#: differ by one ulp from forward_native (measured on 64x512). Emulation costs bf16 10-70% against
#: plain Inductor (256x4096: 555 vs 325 us on one thread) yet stays 1.2-6x ahead of eager; the
#: other norms cast only once, at the end, and compile plainly. ``standalone``: the compiled code is
#: called without Dynamo's ~20-40 us call path while our guards hold (backends/cpu/standalone.py);
#: that moves fp32's break-even against ATen's fused kernel from 8 to 4 rows of 4096 (4 rows: 26.0
#: vs 26.6-27.6 us, 6 rows: 25.3-26.6 vs 28.6-28.9, 2 threads; one thread alike; 1-2 rows eager
#: still wins: docs/cpu.md, issue 18).
#: ``native_from=1``: bf16/fp16 calls of every size run the hand-written kernel
#: (backends/cpu/native/rms_norm.c: the roundings in hardware) where the CPU and a C compiler allow:
#: faster than the eager and compiled tiers from 1x64 up, 1.1-1.8x torch.compile of the spec (p5)
#: at 1-1024 rows of 4096 and at 2048x8192; at 2048x4096 1.10-1.14x in medians (docs/cpu.md, "A
#: hand-written kernel for RMSNorm"). fp32, and the calls it does not take, tier as before.
RMS_NORM_CPU_TIERS = CpuTiers(min_numel=4096, by_dtype={torch.float32: 16384}, dynamic_hidden=False,
                              emulate_casts=True, standalone=True, native_from=1)
NORM_CPU_TIERS = CpuTiers(**_NORM_THRESHOLDS)
#: Gemma's RMSNorm: the same hand-written kernel (its one rounding, at the end, in hardware) for
#: bf16/fp16 at every size: 1.1-1.6x torch.compile of the spec at 1-2048 rows of 4096, where the
#: compiled tier ran at 0.73-0.87x (docs/cpu.md). fp32 (no kernel) calls its compiled code without
#: Dynamo (``standalone``, as RMSNorm): 0.72-0.73x -> 1.13-1.14x torch.compile at 16x4096 and
#: 0.87-0.88x -> 1.10-1.11x at 256x4096 (p5, 2 threads, two runs each; BENCHMARKS.md, "issue 18,
#: CPU, ninth day")
GEMMA_RMS_NORM_CPU_TIERS = CpuTiers(**_NORM_THRESHOLDS, standalone=True, native_from=1)
#: RMSNormGated (Mamba-2's grouped gated norm): its own hand-written kernel
#: (backends/cpu/native/rms_norm_gated.c) for bf16/fp16/fp32 at every size: one pass per row where
#: Inductor's code keeps the gated product in an fp32 buffer between three loops, and no OpenMP
#: region below 16K elements: 1.05-1.76x torch.compile of the spec (p5 and medians) at 1-256 rows
#: of 4096 in every form, where the compiled tier through Dynamo ran at 0.68-0.98x (docs/cpu.md).
#: Where the kernel cannot run, the compiled tier calls Inductor's code without Dynamo
#: (``standalone``: 0.95-1.2x, the same code as torch.compile's less Dynamo's call path).
RMS_NORM_GATED_CPU_TIERS = CpuTiers(**_NORM_THRESHOLDS, standalone=True, native_from=1)
#: FusedRMSNormGated (the KDA output norm): the same kernel over whole rows for the form without a
#: residual, at every size: 1.18-1.36x torch.compile of the spec (p5) at 1-256 rows of 4096 on the
#: AMD EPYC (AVX2), where the eager/compiled tiers ran at 0.67-0.93x, 1.04-1.05x at 2048x8192;
#: 1.03-1.21x on the Xeon (BENCHMARKS.md, "issue 18, CPU, twelfth day"). The residual form (no
#: kernel) tiers as the other norms.
FUSED_RMS_NORM_GATED_CPU_TIERS = CpuTiers(**_NORM_THRESHOLDS, native_from=1)


def _autograd_records(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


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
        return f"hidden_size={self.hidden_size}, eps={self.eps}, var_hidden_size={self.variance_size_override}, has_weight={self.has_weight}"


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
            raise ValueError(f"customop.rms_norm_gated: activation={activation!r} is not one of {sorted(_GATE_ACTIVATIONS)}")
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


# ---- layer norms (vLLM 0.33: layer_norm, nemotron_layer_norm) ------------------------------------


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


#: Measured on the 2-core CI box (benchmarks/results/cpu_layernorm.md, "Layer norms"): ATen's
#: F.layer_norm is one fused kernel already, so Inductor's code never beat eager from 1x4096 to
#: 256x4096 in bf16 or fp32 (0.3-0.9x), and Nemotron's fused add (one more eager add) did not
#: either (0.4-0.97x): eager at every size. FusedRMSNormGated keeps NORM_CPU_TIERS (compiled 1.3-11x
#: faster from 4096 elements in bf16, 1.4-3x from 65536 in fp32).
LAYER_NORM_CPU_TIERS = CpuTiers(min_numel=float("inf"), dynamic=False)
FUSED_ADD_LAYER_NORM_CPU_TIERS = CpuTiers(min_numel=float("inf"), dynamic=False)


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
