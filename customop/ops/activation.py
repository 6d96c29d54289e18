"""Activations: gated units (``*_and_mul``) and elementwise GELU variants, with vLLM's class names
and registered names.

Gated ops split the last dimension: ``d = x.shape[-1] // 2``, gate ``a = x[..., :d]``, up
``b = x[..., d:]`` (``swigluoai_and_mul`` interleaves them instead), and return
``x.shape[:-1] + (d,)``. The spec computes in the input dtype, as vLLM's native paths do;
forward_cpu's compiled kernels keep bf16/fp16 intermediates in fp32 (Inductor's rule), so they
round once instead of at every step: closer to float64, not bit-equal to eager.

The math itself (the spec) is in ``customop/math/activation.py`` and re-exported here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from customop.backends.cpu import CpuTiers, eager, for_this_cpu, run_tiered
from customop.backends.cpu.tiering import is_warming_up
from customop.custom_op import CustomOp
from customop.math.activation import (  # noqa: F401  (the spec, re-exported here)
    fatrelu_and_mul, gelu, gelu_and_mul, gelu_and_mul_sparse, gelu_fast, gelu_new, gelu_tanh, mul_and_silu,
    quick_gelu, relu2, silu_and_mul, silu_and_mul_with_clamp, situ_and_mul, swiglustep_and_mul, swigluoai_and_mul,
    swigluoai_on_halves, xielu,
)

# ---- input checks (every path; the kernels also need contiguity) --------------------------

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CPU_DTYPES = (*_KERNEL_DTYPES, torch.float64)


def _check_input(op: str, x: Any, *, gated: bool, dtypes: tuple[torch.dtype, ...], contiguous: bool) -> None:
    # The valid case in one expression: a decode-sized CPU call takes ~8 us, so 100 ns shows.
    if (isinstance(x, torch.Tensor) and x.dtype in dtypes and x.dim() > 0 and not (gated and x.size(-1) % 2)
            and (not contiguous or x.is_contiguous())):
        return
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"customop {op}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"customop {op}: x has dtype {x.dtype}; supported here: {names}")
    if x.dim() == 0:
        raise ValueError(f"customop {op}: x must have at least one dimension, got a 0-dim tensor")
    if gated and x.shape[-1] % 2:
        raise ValueError(f"customop {op}: x's last dimension must be even (gate and up halves), "
                         f"got shape {tuple(x.shape)}")
    if contiguous and not x.is_contiguous():
        raise ValueError(f"customop {op}: the device kernel needs a contiguous x (strides "
                         f"{tuple(x.stride())}); call x.contiguous()")


# ---- the CPU path -----------------------------------------------------------------------------

# Input sizes (elements) from which forward_cpu runs Inductor's fused kernel rather than eager,
# measured in benchmarks/results/cpu_activation.md. A compiled call costs ~15 us of guards and
# wrapper. Ops that are two or three eager kernels (silu_and_mul, relu2, ...) break even at about
# 1M elements, once the data outgrows the caches; ops that are many (gelu_new: 8) win from ~16K;
# xielu (12 kernels) and the sparse row statistics from 2K (1.2-1.4x at 1x2048, one thread).
# (Measured through Dynamo; the standalone route moved several since: the constants below.)
FEW_KERNELS_MIN_NUMEL = 1 << 21
MANY_KERNELS_MIN_NUMEL = 1 << 14
STATS_KERNELS_MIN_NUMEL = 1 << 11
#: One ATen kernel (gelu, gelu_tanh): nothing for Inductor to fuse; compiled tied or lost at every
#: size measured (up to 256x14336), so forward_cpu stays eager.
NEVER_COMPILE = math.inf


#: mul_and_silu, gelu_and_mul, fatrelu_and_mul (silu_and_mul measured the same) since the
#: standalone route (issue 18: the compiled call without Dynamo's ~20-40 us): compiled beats their
#: in-place eager tier from
#: 16x8192 in bf16 (41-56 vs 44-63 us, 2 threads) and from 64x8192 in fp32 (71-177 vs 88-174);
#: at 1-4 rows eager still ties or wins (benchmarks/results/cpu_activation.md, 2026-12-02).
#: The route's artifacts are dynamic in the width (``CpuTiers.dynamic_hidden``, as the Dynamo
#: graphs are): ``customop.warmup`` cannot know an activation's width, and its width-256 inputs
#: build artifacts that serve every width (BENCHMARKS.md, "the standalone route beyond the norms").
GATED_FEW_KERNELS_FP32_MIN_NUMEL = 1 << 19
GATED_FEW_KERNELS_LOW_PRECISION_MIN_NUMEL = 1 << 17
#: gelu_and_mul in bf16/fp16 (both approximations): the eager tier's gelu costs more than silu's,
#: and the compiled call wins from 16K input elements, not 128K: at 4-8 rows of 8192 the eager tier
#: ran at 0.92-1.00x torch.compile (tanh 4x8192 bf16 0.94-0.95, 8x8192 0.92-0.94; erf 8x8192
#: 0.91-0.92), compiled (2 threads) 1.13-1.56x at 2-16 rows. A one-thread band was slower (tanh
#: 3x8192 0.99-1.06x). 2 threads, best of 15 rounds, two runs each (BENCHMARKS.md, "issue 18,
#: CPU, ninth day"). fp32 keeps the gated ops' 512K (eager 1.03-1.05x compile at 4x8192).
GELU_AND_MUL_LOW_PRECISION_MIN_NUMEL = 1 << 14


#: gelu_new, gelu_fast (eight eager kernels): compiled from 16K elements as before, and below that
#: too (the small-size band, every size), for one thread up to 8K elements (no OpenMP region: under
#: load the threaded code and torch.compile's waited 10-30 ms a call where one thread took 20-50 us)
#: and with the threads from 8K. Compiled beat the eager tier at every size measured (1x64-1x14336,
#: bf16/fp16/fp32), which at 1-3 x 4096 and 1x14336 ran at 0.45-0.96x torch.compile in
#: bf16/fp16; with the band 1.0-1.9x (2 threads, best of 9 rounds, before/after alternated;
#: BENCHMARKS.md, "issue 18, CPU, seventh day"). One thread lost to two from ~12K (12K:
#: 0.99-1.07x torch.compile), hence 8K.
TANH_GELU_CPU_TIERS = CpuTiers(MANY_KERNELS_MIN_NUMEL, standalone=True, compiled_up_to=MANY_KERNELS_MIN_NUMEL - 1,
                               one_thread_up_to=1 << 13)
#: quick_gelu (three eager kernels), since the standalone route: compiled beats the eager tier from
#: 32K elements (8x4096 bf16: 23 vs 35 us; fp32 19 vs 25), ties it at 8-16K and loses below
#: (1x4096: 11-13 vs 8-11 us), 2 threads. The 2M threshold (set through Dynamo) left 16-256 x 4096
#: at 0.79-0.97x torch.compile in bf16 (fp32 256x4096: 0.83x); from 32K now 1.13-1.71x. Below
#: 32K eager is 1.3-3x torch.compile and, like ATen itself there, opens no OpenMP region.
QUICK_GELU_MIN_NUMEL = 1 << 15
#: relu2 (relu, square: two kernels), since the standalone route: compiled beats the eager tier from
#: 64K elements in bf16 (64x4096: 28-32 vs 48-52 us; 16x4096 ties), from 512K in fp32 (256K ties,
#: 229K eager wins) and from 4K in fp16, whose eager relu2 is slow (8x4096: 17 vs 103 us; bf16's
#: eager 14). The 2M threshold left bf16 64-256 x 4096 at 0.73-0.96x torch.compile and fp16 at 0.16-0.88x
#: from 2x4096; now 1.3-1.9x. 2 threads, best of 9 rounds, alternated runs (BENCHMARKS.md).
RELU2_FP32_MIN_NUMEL = 1 << 19
RELU2_BF16_MIN_NUMEL = 1 << 16
RELU2_FP16_MIN_NUMEL = 1 << 12


def _low_precision_from(fp32_and_fp64: int, bf16_and_fp16: int, aligned_widths: bool = False) -> CpuTiers:
    return CpuTiers(fp32_and_fp64, by_dtype={torch.bfloat16: bf16_and_fp16, torch.float16: bf16_and_fp16},
                    standalone=True, aligned_widths=aligned_widths)


#: silu_and_mul and mul_and_silu: x of a width that is a multiple of 64 (and 2+ rows) runs an
#: artifact traced as 64 x a symbol (``CpuTiers.aligned_widths``): the shared width-dynamic code
#: tests each 16-lane (fp32) or 32-lane (bf16) step of a row for the row's tail, which cost their
#: fp32 kernels 1.3-2.7% at 4096x28672 (silu: 30.4-31.3 ms against 29.8 for the aligned artifact
#: and for torch.compile's per-shape code, the kernels alone into one output), mul_and_silu bf16
#: 3.6-5.1% with fresh outputs, and ~2% of silu's fp32 calls at 64-256 x 28672; gelu_and_mul and
#: fatrelu_and_mul gained nothing from it (docs/cpu.md, "The 4096x28672 gated rows"). Warm-up's
#: width 256 builds it with the shared artifact.
SILU_GATED_CPU_TIERS = _low_precision_from(GATED_FEW_KERNELS_FP32_MIN_NUMEL, GATED_FEW_KERNELS_LOW_PRECISION_MIN_NUMEL,
                                           aligned_widths=True)


# ---- the ops ----------------------------------------------------------------------------------


def _checked_approximate(op: str, approximate: str) -> str:
    if approximate not in ("none", "tanh"):
        raise ValueError(f"{op}: approximate must be 'none' or 'tanh', got {approximate!r}")
    return approximate




class _Activation(CustomOp):
    """Shared plumbing. A subclass names its pure function (``math_fn``), whether it is gated,
    and the arguments after ``x`` (``math_args``); the library op ``torch.ops.customop.<name>``
    takes the same arguments."""

    math_fn: ClassVar[Callable[..., torch.Tensor]]
    #: forward_cpu below its compile threshold: math_fn's operations with in-place temporaries,
    #: bitwise equal to it (backends/cpu/eager.py); None: math_fn itself
    eager_fn: ClassVar[Callable[..., torch.Tensor] | None] = None
    #: what forward_cpu's compiled tier compiles (the same math in a form Inductor's width-dynamic
    #: code runs faster); None: math_fn itself
    compiled_fn: ClassVar[Callable[..., torch.Tensor] | None] = None
    gated: ClassVar[bool] = False
    compile_native_default: ClassVar[bool] = False
    cpu_tiers: ClassVar[CpuTiers] = CpuTiers(FEW_KERNELS_MIN_NUMEL, standalone=True)
    repr_fields: ClassVar[tuple[str, ...]] = ()  # constructor arguments shown by print(module)

    def __init__(self, *, enforce_enable: bool = False, compile_native: bool | None = None) -> None:
        if compile_native is None:
            compile_native = self.compile_native_default
        super().__init__(enforce_enable=enforce_enable, compile_native=compile_native)

    def math_args(self) -> tuple[Any, ...]:
        return ()

    def extra_repr(self) -> str:
        return ", ".join(f"{field}={getattr(self, field)!r}" for field in self.repr_fields)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(self.name, x, gated=self.gated, dtypes=_CPU_DTYPES, contiguous=False)
        return type(self).math_fn(x, *self.math_args())

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(self.name, x, gated=self.gated, dtypes=_CPU_DTYPES, contiguous=False)
        return run_tiered(self.cpu_tiers, self.math_fn, x, *self.math_args(), eager=self.eager_fn,
                          compiled_spec=self.compiled_fn)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_kernel(x)

    forward_xpu = forward_tpu = forward_cuda

    def forward_kernel(self, x: torch.Tensor) -> torch.Tensor:
        """The ``torch.ops.customop`` call every accelerator shares (same name as the op)."""
        _check_input(self.name, x, gated=self.gated, dtypes=_KERNEL_DTYPES, contiguous=True)
        return getattr(torch.ops.customop, self.name)(x, *self.math_args())


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


@CustomOp.register("gelu")
class GELU(_Activation):
    """The erf GELU as a CustomOp (vLLM 0.33's ``GELU``), elementwise; what ``get_act_fn("gelu")``
    returns."""

    math_fn = staticmethod(gelu)
    cpu_tiers = CpuTiers(NEVER_COMPILE)


@CustomOp.register("gelu_tanh")
class GELUTanh(_Activation):
    """The tanh GELU as a CustomOp (vLLM 0.33's ``GELUTanh``), elementwise. ``get_act_fn
    ("gelu_pytorch_tanh")`` keeps returning ``nn.GELU(approximate="tanh")``, as vLLM does off ARM
    CPUs."""

    math_fn = staticmethod(gelu_tanh)
    #: ATen's fused tanh-GELU kernel; on AVX2 CPUs (AMD EPYC) the compiled code (without Dynamo)
    #: ties it at 64 x 8192 and is 1.4-6% faster from 128 x 8192 (1M elements), where the eager
    #: tier ran at 0.95-0.99x torch.compile (2 threads, best of 7; BENCHMARKS.md, "issue 18, CPU,
    #: twelfth day"); below, eager is 1.1-1.9x compiled
    cpu_tiers = for_this_cpu(CpuTiers(NEVER_COMPILE), AVX2=CpuTiers(1 << 20, standalone=True))


@CustomOp.register("gelu_new")
class NewGELU(_Activation):
    """GPT-2's tanh GELU, elementwise."""

    math_fn = staticmethod(gelu_new)
    eager_fn = staticmethod(eager.gelu_new)
    cpu_tiers = TANH_GELU_CPU_TIERS


@CustomOp.register("gelu_fast")
class FastGELU(_Activation):
    """The tanh GELU with the constant inlined, elementwise."""

    math_fn = staticmethod(gelu_fast)
    eager_fn = staticmethod(eager.gelu_fast)
    cpu_tiers = TANH_GELU_CPU_TIERS


@CustomOp.register("quick_gelu")
class QuickGELU(_Activation):
    """``x * sigmoid(1.702 x)``, elementwise."""

    math_fn = staticmethod(quick_gelu)
    eager_fn = staticmethod(eager.quick_gelu)
    cpu_tiers = CpuTiers(QUICK_GELU_MIN_NUMEL, standalone=True)


@CustomOp.register("relu2")
class ReLUSquaredActivation(_Activation):
    """``relu(x)^2`` (arXiv 2109.08668). Compiles its native path when disabled."""

    math_fn = staticmethod(relu2)
    eager_fn = staticmethod(eager.relu2)
    compile_native_default = True
    cpu_tiers = CpuTiers(RELU2_FP32_MIN_NUMEL, by_dtype={torch.bfloat16: RELU2_BF16_MIN_NUMEL,
                                                         torch.float16: RELU2_FP16_MIN_NUMEL}, standalone=True)


@CustomOp.register("xielu")
class XIELU(_Activation):
    """xIELU with trainable ``alpha_p``/``alpha_n`` stored in inverse-softplus form, so that
    ``softplus(alpha_p) == alpha_p_init`` and ``beta + softplus(alpha_n) == alpha_n_init`` (up to
    the rounding of ``dtype``, bf16 by default as in vLLM). ``beta`` and ``eps`` are buffers of
    ``dtype`` too; the op uses their rounded values."""

    math_fn = staticmethod(xielu)
    cpu_tiers = CpuTiers(STATS_KERNELS_MIN_NUMEL, standalone=True)

    def __init__(self, alpha_p_init: float = 0.8, alpha_n_init: float = 0.8, beta: float = 0.5,
                 eps: float = -1e-6, dtype: torch.dtype = torch.bfloat16,
                 with_vector_loads: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)

        def inverse_softplus(value: float) -> torch.Tensor:  # log(exp(v) - 1), in dtype like vLLM
            return torch.log(torch.exp(torch.tensor(value, dtype=dtype)) - 1).unsqueeze(0)

        self.alpha_p = nn.Parameter(inverse_softplus(alpha_p_init))
        self.alpha_n = nn.Parameter(inverse_softplus(alpha_n_init - beta))
        self.register_buffer("beta", torch.tensor(beta, dtype=dtype))
        self.register_buffer("eps", torch.tensor(eps, dtype=dtype))
        self.with_vector_loads = with_vector_loads  # vLLM's CUDA-extension flag; no effect here
        self._read_scalars()

    def _read_scalars(self) -> None:
        # beta and eps reach the kernel as host floats, read here rather than per call (a sync)
        self._beta, self._eps = float(self.beta), float(self.eps)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._read_scalars()  # a checkpoint may carry its own beta/eps buffers

    def math_args(self) -> tuple[Any, ...]:
        return (F.softplus(self.alpha_p), self.beta + F.softplus(self.alpha_n), self._beta, self._eps)

    def forward_kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self.alpha_p.device != x.device:
            raise ValueError(f"customop xielu: x is on {x.device} but the parameters are on "
                             f"{self.alpha_p.device}; move the module with .to(x.device)")
        return super().forward_kernel(x)


# ---- factories: one shared instance per name, built on first use (vLLM's LazyDict) ------------

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "gelu": GELU,
    "gelu_fast": FastGELU,
    "gelu_new": NewGELU,
    "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
    "relu": nn.ReLU,
    "relu2": ReLUSquaredActivation,
    "silu": nn.SiLU,
    "quick_gelu": QuickGELU,
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
    "xielu": XIELU,
}
ACTIVATIONS_AND_MUL: dict[str, Callable[..., nn.Module]] = {
    "gelu": GeluAndMul,
    "geglu": GeluAndMul,
    "silu": SiluAndMul,
    "swigluoai": SwigluOAIAndMul,
}
#: (registry, name) -> module. Every layer asking for "silu" gets the same module, dispatched
#: under the config current when it was first asked for.
_shared: dict[tuple[int, str], nn.Module] = {}


def _shared_instance(factories: dict[str, Callable[..., nn.Module]], name: str) -> nn.Module:
    key = (id(factories), name)
    if key not in _shared:
        _shared[key] = factories[name]()
    return _shared[key]


def clear_shared_activations() -> None:
    """Forgets the shared instances (tests, or after changing the config)."""
    _shared.clear()


def get_act_fn(act_fn_name: str) -> nn.Module:
    """The shared activation module for a model config's name (case-insensitive). A
    ``torch.nn.modules.<...>.<Name>`` path maps to ``<name>``; its ``Identity`` is a new module."""
    name = act_fn_name.lower()
    if name.startswith("torch.nn.modules."):
        name = name.rsplit(".", 1)[-1]
        if name == "identity":
            return nn.Identity()
    if name not in ACTIVATIONS:
        raise ValueError(f"get_act_fn: activation {act_fn_name!r} is not supported; known: {sorted(ACTIVATIONS)}")
    return _shared_instance(ACTIVATIONS, name)


def get_act_and_mul_fn(act_fn_name: str, **kwargs: Any) -> nn.Module:
    """The shared gated activation for a name (case-insensitive). With keyword arguments
    (e.g. ``compile_native=False``, or ``alpha=`` for swigluoai) a new, unshared module is built."""
    name = act_fn_name.lower()
    if name not in ACTIVATIONS_AND_MUL:
        raise ValueError(f"get_act_and_mul_fn: activation {act_fn_name!r} is not supported; "
                         f"known: {sorted(ACTIVATIONS_AND_MUL)}")
    if kwargs:
        return ACTIVATIONS_AND_MUL[name](**kwargs)
    return _shared_instance(ACTIVATIONS_AND_MUL, name)
