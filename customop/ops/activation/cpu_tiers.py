"""The activations' CPU path: the measured input sizes from which ``forward_cpu`` compiles, as
constants and ``CpuTiers`` the op classes (``gated.py``, ``unary.py``) take as their ``cpu_tiers``.
"""

from __future__ import annotations

import math

import torch

from customop.backends.cpu import CpuTiers

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
