"""CPU timings of the norms family: eager native vs ``torch.compile(native)`` vs ``forward_cpu``.

    .venv/bin/python -m benchmarks.cpu.layernorm [--dtypes bf16,fp32] [--shapes 1x4096,...]
        [--extra] [--gated] [--layer] [--emulated-rounding] [--dynamo-route] [--min-time 0.4] [--threads N]
        [--clock wall|cpu]

``--gated``: RMSNormGated (Mamba-2's grouped gated norm, ``rms_norm_gated``) at the ``--shapes``
instead of RMSNorm, in every form: one group and 8 groups a row, without z, z before the norm
(``norm_before_gate=False``) and after it; the label says which (``g8 z-after``).

``--layer``: vLLM 0.33's layer norms and FusedRMSNormGated (layer_norm, nemotron_layer_norm
with and without the fused add, fused_rms_norm_gated) at the ``--shapes`` instead of RMSNorm.

Prints a markdown table of microseconds per call, ``p5 / median``, for four paths: the math
function called eagerly; ``op.forward_native`` (the same through the op, as a disabled op runs,
with the module's attribute lookups); ``torch.compile`` of the math function with Inductor's
defaults; and ``op.forward_cpu``. Speed-ups are ratios of the 5th percentiles. ``--dynamo-route``
adds ``forward_cpu`` as before the standalone route (``CpuTiers.standalone`` off: the compiled tier
called through Dynamo), timed in the same shuffled rounds, and both against ``torch.compile``.

Method. Every call is timed on its own and the paths take turns call by call in a shuffled order,
so that other jobs' load (and the cache disturbance one call leaves for the next, ~3-5 us after a
compiled call) falls on all alike: on a shared 2-core machine one preempted OpenMP thread stalls a
whole parallel region for a scheduler tick (4-24 ms), which swamps a mean or a per-block time. The
fast tail is the uncontended cost (p5 rather than the minimum, which the thread CPU clock sometimes
reads as 0); the median shows how much contention there was. ``--threads 1 --clock cpu`` counts
only this thread's CPU time, which other jobs barely disturb. Compiled paths are timed in a
serving loop's steady state: two other row counts are served first, so the timed calls run the
graph that is dynamic in the rows (~4 us more per call than a static one; one-row calls still get
a graph of their own, as Dynamo specialises size 1).
"""

from __future__ import annotations

import argparse

import torch

import copy
import dataclasses

from customop.benchmarks.cpu.timing import add_timing_args, start_run, time_us

from customop.config import Config, use_config
from customop.ops import layernorm as L

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SHAPES = ((1, 4096), (16, 4096), (256, 4096), (2048, 8192))
EXTRA_SHAPES = ((16, 4096), (256, 4096))


def with_rows(args: tuple, shape: tuple[int, ...], rows: int) -> tuple:
    """``args`` with every tensor shaped ``shape`` replaced by a random one with ``rows`` rows."""
    return tuple(torch.randn(rows, *shape[1:], dtype=a.dtype)
                 if isinstance(a, torch.Tensor) and a.shape == shape else a for a in args)


def layer_cases(dtype: torch.dtype, shapes):
    """The layer norms' and FusedRMSNormGated's cases, weights in the input dtype."""
    for shape in shapes:
        h = shape[-1]
        x, r, g = (torch.randn(shape, dtype=dtype) for _ in range(3))
        with use_config(Config(custom_ops=["all"])):
            ln = L.LayerNorm(h, dtype=dtype).requires_grad_(False)
            nemotron = L.NemotronLayerNorm1P(h).to(dtype).requires_grad_(False)
            gated = L.FusedRMSNormGated(h, dtype=dtype).requires_grad_(False)
        yield "layer_norm", shape, L.layer_norm, ln, (x, ln.weight, ln.bias, 1e-5), (x,)
        w, b = nemotron.weight, nemotron.bias
        yield "nemotron_layer_norm", shape, L.nemotron_layer_norm, nemotron, (x, w, b, 1e-5), (x,)
        yield ("fused_add_nemotron_layer_norm", shape, L.fused_add_nemotron_layer_norm, nemotron,
               (x, r, w, b, 1e-5), (x, r))
        yield "fused_rms_norm_gated", shape, L.fused_rms_norm_gated, gated, (x, g, gated.weight, 1e-5, False), (x, g)


def gated_cases(dtype: torch.dtype, shapes):
    """RMSNormGated's forms (silu gate, weights in the input dtype): 1 or 8 groups, no z, the gate
    before the norm (on x) or after it (on the output)."""
    for shape in shapes:
        h = shape[-1]
        x, z = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
        for groups in (1, 8):
            for gate in ("none", "before", "after"):
                after = gate == "after"
                with use_config(Config(custom_ops=["all"])):
                    op = L.RMSNormGated(h, group_size=h // groups, norm_before_gate=after,
                                        dtype=dtype).requires_grad_(False)
                zz = None if gate == "none" else z
                yield (f"rms_norm_gated g{groups} z-{gate}", shape, L.rms_norm_gated, op,
                       (x, op.weight, zz, 1e-5, h // groups, after, False), (x, zz))


def cases(dtype: torch.dtype, shapes, extra: bool, layer: bool = False, gated: bool = False):
    """(op label, shape, math fn, op, fn args, op args) for each case."""
    if layer:
        yield from layer_cases(dtype, shapes)
        return
    if gated:
        yield from gated_cases(dtype, shapes)
        return
    for shape in shapes:
        h = shape[-1]
        x, residual = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
        with use_config(Config(custom_ops=["all"])):
            op = L.RMSNorm(h, dtype=dtype).requires_grad_(False)
        w = op.weight
        yield "rms_norm", shape, L.rms_norm, op, (x, w, 1e-6), (x,)
        yield "fused_add_rms_norm", shape, L.fused_add_rms_norm, op, (x, residual, w, 1e-6), (x, residual)
    if not extra:
        return
    for shape in EXTRA_SHAPES:
        h = shape[-1]
        x, z = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
        with use_config(Config(custom_ops=["all"])):
            gemma = L.GemmaRMSNorm(h).to(dtype).requires_grad_(False)
            gated = L.RMSNormGated(h, group_size=h // 8, dtype=dtype).requires_grad_(False)
        yield "gemma_rms_norm", shape, L.gemma_rms_norm, gemma, (x, gemma.weight, 1e-6), (x,)
        yield ("rms_norm_gated", shape, L.rms_norm_gated, gated,
               (x, gated.weight, z, 1e-5, h // 8, False, False), (x, z))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES),
                        help="rms_norm / fused_add_rms_norm shapes, e.g. 1x4096,16x4096")
    parser.add_argument("--extra", action="store_true", help="also gemma_rms_norm and rms_norm_gated")
    parser.add_argument("--gated", action="store_true",
                        help="RMSNormGated in every form (groups, z, norm_before_gate) instead of rms_norm")
    parser.add_argument("--layer", action="store_true",
                        help="the layer norms and fused_rms_norm_gated instead of rms_norm")
    parser.add_argument("--emulated-rounding", action="store_true",
                        help="forward_cpu as before issue 18: bf16 RMSNorm's compiled tier compiles the spec "
                             "with emulate_precision_casts instead of backends/cpu/exact_rounding.py")
    parser.add_argument("--dynamo-route", action="store_true",
                        help="also forward_cpu with its compiled tier called through Dynamo (CpuTiers.standalone off)")
    add_timing_args(parser)
    args = parser.parse_args()
    if args.emulated_rounding:
        from customop.backends.cpu import tiering
        tiering.compiled_form = lambda fn: fn
    clock = start_run(args)
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]

    before = args.dynamo_route
    print("| op | dtype | shape | eager math fn (us) | op.forward_native (us) | torch.compile (us) | "
          "forward_cpu (us) | " + ("forward_cpu via Dynamo (us) | " if before else "")
          + "compile x | forward_cpu x | forward_cpu x forward_native |"
          + (" via Dynamo / compile | forward_cpu / compile |" if before else ""))
    print("|---|---|---|---:|---:|---:|---:|" + ("---:|" if before else "") + "---:|---:|---:|"
          + ("---:|---:|" if before else ""))
    with torch.no_grad():
        for dtype_name in args.dtypes.split(","):
            for label, shape, fn, op, fn_args, op_args in cases(DTYPES[dtype_name], shapes, args.extra, args.layer,
                                                                      args.gated):
                # Dynamo caches compiled code per code object, shared by the baseline and
                # forward_cpu: start each case afresh so that no case meets the recompile limit.
                torch._dynamo.reset()
                compiled_fn = torch.compile(fn)
                ops = [op]
                if before:  # the same op (its parameters shared) with the compiled tier through Dynamo
                    ops.append(copy.copy(op))
                    ops[1].cpu_tiers = dataclasses.replace(op.cpu_tiers, standalone=False)
                for rows in (shape[0] + 1, shape[0] + 2):  # the serving loop's steady state
                    compiled_fn(*with_rows(fn_args, shape, rows))
                    for o in ops:
                        o.forward_cpu(*with_rows(op_args, shape, rows))
                times = time_us([lambda: fn(*fn_args), lambda: op.forward_native(*op_args),
                                 lambda: compiled_fn(*fn_args)] + [lambda o=o: o.forward_cpu(*op_args) for o in ops],
                                args.min_time, clock)
                eager, native, comp, ours = times[:4]
                cells = " | ".join(f"{best:.1f} / {median:.1f}" for best, median in times)
                tail = f" {comp[0] / times[4][0]:.2f} | {comp[0] / ours[0]:.2f} |" if before else ""
                print(f"| {label} | {dtype_name} | {'x'.join(map(str, shape))} | {cells} | "
                      f"{eager[0] / comp[0]:.2f} | {eager[0] / ours[0]:.2f} | {native[0] / ours[0]:.2f} |{tail}",
                      flush=True)


if __name__ == "__main__":
    main()
