"""The gated activations (``*_and_mul``): ``d = x.shape[-1] // 2``, gate ``a = x[..., :d]``, up
``b = x[..., d:]`` (``swigluoai_and_mul`` interleaves them), output ``x.shape[:-1] + (d,)``; with
the sparse GeGLU's compiled forms and the helpers of its and SwigluOAIAndMul's CPU paths.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F

from customop.backends.cpu import CpuTiers, eager, for_this_cpu, run_tiered
from customop.backends.cpu.tiering import is_warming_up
from customop.custom_op import CustomOp
from customop.math.activation import (
    fatrelu_and_mul, gelu_and_mul, gelu_and_mul_sparse, mul_and_silu, silu_and_mul, silu_and_mul_with_clamp,
    situ_and_mul, swiglustep_and_mul, swigluoai_and_mul, swigluoai_on_halves,
)
from customop.ops.activation.base import _CPU_DTYPES, _Activation, _check_input, _checked_approximate
from customop.ops.activation.cpu_tiers import (
    FEW_KERNELS_MIN_NUMEL, GATED_FEW_KERNELS_FP32_MIN_NUMEL, GATED_FEW_KERNELS_LOW_PRECISION_MIN_NUMEL,
    GELU_AND_MUL_LOW_PRECISION_MIN_NUMEL, MANY_KERNELS_MIN_NUMEL, SILU_GATED_CPU_TIERS, STATS_KERNELS_MIN_NUMEL,
    _low_precision_from,
)


@CustomOp.register("silu_and_mul")
class SiluAndMul(_Activation):
    """SwiGLU, ``silu(x[..., :d]) * x[..., d:]``. Compiles its native path when disabled."""

    math_fn = staticmethod(silu_and_mul)
    eager_fn = staticmethod(eager.silu_and_mul)
    gated = True
    #: with the route on, 1.16-1.34x compile from 16x8192 bf16 and 64x8192 fp32, the other gated
    #: ops' thresholds (benchmarks/results/cpu_activation.md, 2026-12-02)
    cpu_tiers = SILU_GATED_CPU_TIERS
    compile_native_default = True


@CustomOp.register("mul_and_silu")
class MulAndSilu(_Activation):
    """``x[..., :d] * silu(x[..., d:])``."""

    math_fn = staticmethod(mul_and_silu)
    eager_fn = staticmethod(eager.mul_and_silu)
    gated = True
    cpu_tiers = SILU_GATED_CPU_TIERS


@CustomOp.register("gelu_and_mul")
class GeluAndMul(_Activation):
    """GeGLU, ``gelu(x[..., :d], approximate) * x[..., d:]``; ``approximate`` is "none" or "tanh"."""

    math_fn = staticmethod(gelu_and_mul)
    eager_fn = staticmethod(eager.gelu_and_mul)
    gated = True
    cpu_tiers = _low_precision_from(GATED_FEW_KERNELS_FP32_MIN_NUMEL, GELU_AND_MUL_LOW_PRECISION_MIN_NUMEL)
    repr_fields = ("approximate",)

    def __init__(self, approximate: str = "none", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.approximate = _checked_approximate(type(self).__name__, approximate)

    def math_args(self) -> tuple[Any, ...]:
        return (self.approximate,)


def gelu_and_mul_sparse_two_pass(x: torch.Tensor, std_multiplier: float, approximate: str = "none") -> torch.Tensor:
    """``gelu_and_mul_sparse`` with the row std taken as the root of the mean squared deviation from
    the row mean (a second pass over the row) instead of ``Tensor.std``: the CPU compiled tier's form.

    Inductor lowers ``std`` to a Welford reduction, and with the width symbolic (the standalone
    route's width-dynamic artifacts) its C++ builds the Welford helpers per row and tests the
    vector tail in the loop: 0.82x a per-shape ``torch.compile`` of the spec at 512x8192 in
    bf16/fp16, 0.71-0.97x in fp32 at 16-512 rows (the per-width artifact: 1.07x at 512x8192 bf16).
    Two plain sums vectorise as the per-width code does: 1.03-1.42x at 16-512 rows of 8192 in
    every dtype (2 threads, benchmarks.cpu.activation; BENCHMARKS.md). Mathematically the same
    population std; in floating point the two-pass sum is the textbook-accurate one (both are
    within fp32 rounding of the float64 reference). Only ever compiled: in bf16/fp16 Inductor
    keeps the row statistics in fp32, as it does for the spec."""
    d = x.shape[-1] // 2
    a = x[..., :d]
    mean = a.mean(dim=-1, keepdim=True)
    std = (a - mean).square().mean(dim=-1, keepdim=True).sqrt()
    return F.gelu(F.relu(a - (mean + std * std_multiplier)), approximate=approximate) * x[..., d:]


def gelu_and_mul_sparse_rounded_statistics(x: torch.Tensor, std_multiplier: float,
                                           approximate: str = "none") -> torch.Tensor:
    """``gelu_and_mul_sparse`` with the row mean and std computed in fp32 (two passes) and rounded
    to x's dtype, as the spec's ``mean`` and ``std`` return them: the CPU path's form for bf16/fp16
    below the compile threshold, compiled with ``emulate_precision_casts`` (Inductor then rounds
    every bf16/fp16 step where eager does). Bitwise the spec on every input measured (1-15 rows,
    1K-16K elements, bf16), where the main compiled form (fp32 statistics, one rounding) moves
    outputs near the cutoff by more than the spec's own tolerance (``customop check``: 0.03 at one
    of 1211 bf16 elements), which is what kept these sizes eager: 0.37-0.72x torch.compile. The
    statistics differ from ATen's only in the fp32 summation order, which their rounding to bf16
    or fp16 hides except at a rounding boundary."""
    d = x.shape[-1] // 2
    a = x[..., :d]
    wide = a.float() if a.dtype.itemsize < 4 else a
    mean = wide.mean(dim=-1, keepdim=True)
    std = (wide - mean).square().mean(dim=-1, keepdim=True).sqrt()
    cutoff = mean.to(x.dtype) + std.to(x.dtype) * std_multiplier
    return F.gelu(F.relu(a - cutoff), approximate=approximate) * x[..., d:]


_LOW_PRECISION = (torch.bfloat16, torch.float16)
#: id(tiers) -> (tiers, the same with ``emulate_casts``): the band's tiers for bf16/fp16
_ROUNDING_TIERS: dict[int, tuple[CpuTiers, CpuTiers]] = {}


def _rounding_tiers(tiers: CpuTiers) -> CpuTiers:
    hit = _ROUNDING_TIERS.get(id(tiers))
    if hit is None or hit[0] is not tiers:
        hit = _ROUNDING_TIERS[id(tiers)] = (tiers, dataclasses.replace(tiers, emulate_casts=True))
    return hit[1]


@CustomOp.register("gelu_and_mul_sparse")
class GeluAndMulSparse(_Activation):
    """Gemma-3n's GeGLU that keeps only gate values above a per-row Gaussian percentile.

    ``activation_sparsity`` (0 < p < 1; vLLM rejects only 0) becomes the std multiplier
    ``Phi^-1(p)`` once, here. Row statistics are local to a tensor-parallel shard, as in vLLM."""

    math_fn = staticmethod(gelu_and_mul_sparse)
    compiled_fn = staticmethod(gelu_and_mul_sparse_two_pass)
    gated = True
    # fp32 compiles from 2K (1.3x at 1x8192); bf16/fp16 keep 16K: there the compiled fp32 row
    # statistics move outputs near the cutoff beyond the tolerance against the bf16 spec
    # (statistics). Below their thresholds every dtype compiles too (the small-size band, one
    # thread up to 8K as for gelu_new): bf16/fp16 the spec's roundings
    # (``gelu_and_mul_sparse_rounded_statistics``, emulated casts), fp32 and fp64 the main form.
    # The width is dynamic on both routes (customop.warmup cannot know it); the row statistics'
    # reduction code is the same through Dynamo and without it (backends/cpu/standalone.py), bitwise
    cpu_tiers = CpuTiers(STATS_KERNELS_MIN_NUMEL, by_dtype={torch.bfloat16: MANY_KERNELS_MIN_NUMEL,
                                                            torch.float16: MANY_KERNELS_MIN_NUMEL},
                         compiled_up_to=MANY_KERNELS_MIN_NUMEL - 1, one_thread_up_to=1 << 13, standalone=True)
    repr_fields = ("activation_sparsity", "approximate")

    def __init__(self, activation_sparsity: float, approximate: str = "none", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.approximate = _checked_approximate(type(self).__name__, approximate)
        if activation_sparsity == 0.0:
            raise ValueError("GeluAndMulSparse: activation_sparsity is 0.0; use GeluAndMul")
        if not 0.0 < activation_sparsity < 1.0:
            raise ValueError(f"GeluAndMulSparse: activation_sparsity must be in (0, 1), got {activation_sparsity}")
        self.activation_sparsity = activation_sparsity
        normal = torch.distributions.Normal(0.0, 1.0)
        self.std_multiplier = normal.icdf(torch.tensor(activation_sparsity, dtype=torch.float32))
        self._std_multiplier = float(self.std_multiplier)  # a Python float: no host sync per call

    def math_args(self) -> tuple[Any, ...]:
        return (self._std_multiplier, self.approximate)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(self.name, x, gated=True, dtypes=_CPU_DTYPES, contiguous=False)
        out = self._tiered(x)
        if is_warming_up() and x.numel():
            for other in _width_class_samples(x):
                self._tiered(other)
        return out

    def _tiered(self, x: torch.Tensor) -> torch.Tensor:
        """bf16/fp16 below the threshold: the rounded-statistics form (emulated casts); else the
        main form. Warm-up runs both, so that it builds either's artifacts."""
        tiers, args = self.cpu_tiers, self.math_args()
        if x.dtype in _LOW_PRECISION and tiers.compiled_up_to:
            warming = is_warming_up()
            if warming or x.numel() < tiers.compile_from(x.dtype):
                out = run_tiered(_rounding_tiers(tiers), gelu_and_mul_sparse, x, *args,
                                 compiled_spec=gelu_and_mul_sparse_rounded_statistics)
                if not warming:
                    return out
        return run_tiered(tiers, gelu_and_mul_sparse, x, *args, compiled_spec=self.compiled_fn)


#: Inductor sums fp32 over more than 4096 elements in 4096-element chunks (``CascadeSumHelper``),
#: and decides that with a guard on the width: each width-dynamic artifact of the sparse op's forms
#: (their row sums) serves output widths up to 4096 or above it, not both; a width of the other
#: class compiled an artifact of its own on its first request (Gemma-3n's 16384 after warm-up's
#: 256). Now it gets one for its class (``standalone._width_class_artifact``: one for x widths that
#: are multiples of 64, traced so, one for the others), which warm-up builds from these output
#: widths: up to 4096 and above it, each with x's width a multiple of 64 and not (whichever class
#: the first call built, the one artifact every class shares the key with serves its own).
_WIDTH_CLASS_SAMPLES = (64, 65, 4160, 4097)


def _width_class_samples(x: torch.Tensor) -> list[torch.Tensor]:
    """Warm-up inputs of every width class of the sparse op's artifacts, with x's row class (one
    row or more) and dtype."""
    rows = 1 if x.numel() == x.shape[-1] else 2
    return [torch.randn(rows, 2 * d).to(x.dtype) for d in _WIDTH_CLASS_SAMPLES]


@CustomOp.register("fatrelu_and_mul")
class FatreluAndMul(_Activation):
    """FATReLU (MiniCPM-S): ``(a if a > threshold else 0) * b``."""

    math_fn = staticmethod(fatrelu_and_mul)
    eager_fn = staticmethod(eager.fatrelu_and_mul)
    gated = True
    cpu_tiers = _low_precision_from(GATED_FEW_KERNELS_FP32_MIN_NUMEL, GATED_FEW_KERNELS_LOW_PRECISION_MIN_NUMEL)
    repr_fields = ("threshold",)

    def __init__(self, threshold: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.threshold = float(threshold)

    def math_args(self) -> tuple[Any, ...]:
        return (self.threshold,)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Interleaved (gate, up) lanes -> ``[gates | ups]``."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).contiguous().flatten(-2)


#: swigluoai_and_mul in bf16/fp16 up to 64K elements: the interleaved spec's standalone artifact
#: (2 threads) beat the eager tier at 1-8 rows of 8192 (1.10-1.46x torch.compile against
#: 0.90-1.16x; one thread lost at 2 rows, 0.85-0.90x). From 9 rows ATen's eager kernels run on two
#: threads (each half above its 32K grain) and won again (12 rows: 1.39-1.41x against 1.06-1.09x),
#: up to the 128K threshold. fp32 keeps the eager tier (1.2-1.4x at 1-8 rows, a tie with the
#: artifact). 2 threads, best of 15 rounds, two runs each (BENCHMARKS.md, "issue 18, CPU, ninth day")
_SWIGLUOAI_BAND = CpuTiers(math.inf, standalone=True, compiled_up_to=1 << 16)


@CustomOp.register("swigluoai_and_mul")
class SwigluOAIAndMul(_Activation):
    """GPT-OSS's clamped SwiGLU on interleaved (gate, up) lanes."""

    math_fn = staticmethod(swigluoai_and_mul)
    eager_fn = staticmethod(eager.swigluoai_and_mul)
    gated = True
    #: bf16/fp16 inputs compile from 128K (eager casts at every step): 1.35x at 16x8192 in bf16
    cpu_tiers = _low_precision_from(FEW_KERNELS_MIN_NUMEL, 1 << 17)
    repr_fields = ("alpha", "limit")

    def __init__(self, alpha: float = 1.702, limit: float = 7.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.alpha = float(alpha)
        self.limit = float(limit)

    def math_args(self) -> tuple[Any, ...]:
        return (self.alpha, self.limit)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        # Inductor's CPU code loads stride-2 lanes one element at a time (2x slower than eager,
        # measured), so large inputs are de-interleaved to [gates | ups] once, in eager, and the
        # compiled math runs on contiguous halves (2x faster than eager). bf16/fp16 up to 64K
        # elements: the small-size band (``_SWIGLUOAI_BAND``), the interleaved spec compiled and
        # called without Dynamo (the de-interleaving ``prepare`` keeps the large path on Dynamo's);
        # warm-up runs both, so that it builds either's code
        _check_input(self.name, x, gated=True, dtypes=_CPU_DTYPES, contiguous=False)
        if x.dtype in _LOW_PRECISION:
            warming = is_warming_up()
            numel = x.numel()
            if warming or numel <= _SWIGLUOAI_BAND.compiled_up_to and numel < self.cpu_tiers.compile_from(x.dtype):
                out = run_tiered(_SWIGLUOAI_BAND, swigluoai_and_mul, x, self.alpha, self.limit, eager=self.eager_fn)
                if not warming:
                    return out
        return run_tiered(self.cpu_tiers, swigluoai_and_mul, x, self.alpha, self.limit, eager=self.eager_fn,
                          compiled_spec=swigluoai_on_halves, prepare=_deinterleave)


@CustomOp.register("swiglustep_and_mul")
class SwigluStepAndMul(_Activation):
    """SwiGLU with a step clamp (vLLM 0.33): ``min(silu(a), limit) * clamp(b, -limit, limit)`` on
    the gate and up halves. ``limit`` is required to be a number (``None`` raises, as in vLLM)."""

    math_fn = staticmethod(swiglustep_and_mul)
    gated = True
    #: through Dynamo compiled won from 16x8192 in bf16 and 64x8192 in fp32 (one thread); without
    #: it (the standalone route, issue 18) from 4x8192 in both (24-28 vs 31-40 us, 2 threads)
    #: (benchmarks/results/cpu_activation.md)
    cpu_tiers = _low_precision_from(1 << 15, 1 << 15)
    repr_fields = ("limit",)

    def __init__(self, limit: float = 7.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if limit is None:
            raise ValueError("SwigluStepAndMul requires limit to be set")
        self.limit = float(limit)

    def math_args(self) -> tuple[Any, ...]:
        return (self.limit,)


@CustomOp.register("silu_and_mul_with_clamp")
class SiluAndMulWithClamp(_Activation):
    """SwiGLU with the inputs clamped before the activation (vLLM 0.33; DeepSeek-V4's shared
    experts, MiniMax-M3 with ``alpha=1.702, beta=1.0``): ``g = min(a, L)``, ``u = clamp(b, -L, L)``,
    ``g * sigmoid(alpha * g) * (u + beta)`` on the gate and up halves. ``swiglu_limit`` is required.
    Compiles its native path when disabled."""

    math_fn = staticmethod(silu_and_mul_with_clamp)
    gated = True
    compile_native_default = True
    #: through Dynamo compiled won from 16x8192 in bf16 and 64x8192 in fp32 (one thread); without
    #: it (the standalone route, issue 18) from one 8192-wide row in bf16 (17-19 vs 30-34 us) and
    #: from 4x8192 in fp32 (38-45 vs 44-65 us), 2 threads (benchmarks/results/cpu_activation.md)
    cpu_tiers = _low_precision_from(1 << 15, 1 << 13)
    repr_fields = ("swiglu_limit", "alpha", "beta")

    def __init__(self, swiglu_limit: float, alpha: float = 1.0, beta: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if swiglu_limit is None:
            raise ValueError("SiluAndMulWithClamp: swiglu_limit is required (a number), got None")
        self.swiglu_limit = float(swiglu_limit)
        self.alpha = float(alpha)
        self.beta = float(beta)

    def math_args(self) -> tuple[Any, ...]:
        return (self.swiglu_limit, self.alpha, self.beta)


#: SituAndMul's tiers on AVX-512 CPUs: compiled from 1M elements and up to 64K (the class says why)
SITU_BAND_CPU_TIERS = CpuTiers(1 << 20, standalone=True, compiled_up_to=1 << 16)


@CustomOp.register("situ_and_mul")
class SituAndMul(_Activation):
    """Kimi's SiTU GLU (vLLM 0.33): ``beta * tanh(a / beta) * sigmoid(a)`` times ``b``, or times
    ``linear_beta * tanh(b / linear_beta)`` when ``linear_beta`` is given; computed in fp32 and
    rounded once to the input dtype on every path. ``linear_beta`` is unset only when None (vLLM's
    CUDA kernel also treats values <= 0 as unset; its native path and every path here do not).
    Compiles its native path when disabled."""

    math_fn = staticmethod(situ_and_mul)
    gated = True
    compile_native_default = True
    #: AVX-512 (Intel Xeon): compiled and eager tie at 64x8192 (Inductor's fp32 tanh is no cheaper
    #: than ATen's) and compiled wins from 128x8192 (1.4x in fp32), one thread
    #: (benchmarks/results/cpu_activation.md). Below 64K input elements the compiled code (called
    #: without Dynamo) wins again: 1-4 rows of 2 x 8192, 2 threads, 2026-12-02, bf16 / fp32 x
    #: torch.compile: eager tier 0.67-0.97x, compiled 1.18-1.95x; from 128K elements (8 x 2 x 8192,
    #: 4 x 2 x 14336) eager was faster (BENCHMARKS.md, "issue 18, CPU, sixth day").
    #: AVX2 (AMD EPYC): the compiled code wins at every size, 1.01-1.40x torch.compile at 1-512 x
    #: 2 x 8192 and 256 x 2 x 28672 where the eager tier ran at 0.68-0.74x (2 threads, best of 7;
    #: BENCHMARKS.md, "issue 18, CPU, twelfth day").
    cpu_tiers = for_this_cpu(SITU_BAND_CPU_TIERS, AVX2=CpuTiers(1, standalone=True))
    repr_fields = ("beta", "linear_beta")

    def __init__(self, beta: float = 1.0, linear_beta: float | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # zero divides by zero (every output NaN): refused here rather than computed
        if not beta:
            raise ValueError(f"SituAndMul: beta must be a non-zero number, got {beta!r}")
        if linear_beta is not None and not linear_beta:
            raise ValueError("SituAndMul: linear_beta must be None (no transform of the up half) or a non-zero "
                             f"number, got {linear_beta!r}")
        self.beta = float(beta)
        self.linear_beta = None if linear_beta is None else float(linear_beta)

    def math_args(self) -> tuple[Any, ...]:
        return (self.beta, self.linear_beta)
