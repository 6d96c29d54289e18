"""The norms' CPU path: the measured input sizes from which ``forward_cpu`` compiles or runs a
hand-written kernel, as ``CpuTiers`` the op classes (``rms.py``, ``layer.py``, ``fused_gated.py``)
take as their ``cpu_tiers``.
"""

from __future__ import annotations

import torch

from customop.backends.cpu import CpuTiers

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


#: Measured on the 2-core CI box (benchmarks/results/cpu_layernorm.md, "Layer norms"): ATen's
#: F.layer_norm is one fused kernel already, so Inductor's code never beat eager from 1x4096 to
#: 256x4096 in bf16 or fp32 (0.3-0.9x), and Nemotron's fused add (one more eager add) did not
#: either (0.4-0.97x): eager at every size. FusedRMSNormGated keeps NORM_CPU_TIERS' thresholds
#: (FUSED_RMS_NORM_GATED_CPU_TIERS, above: compiled 1.3-11x faster from 4096 elements in bf16,
#: 1.4-3x from 65536 in fp32).
LAYER_NORM_CPU_TIERS = CpuTiers(min_numel=float("inf"), dynamic=False)
FUSED_ADD_LAYER_NORM_CPU_TIERS = CpuTiers(min_numel=float("inf"), dynamic=False)
