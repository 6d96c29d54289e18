"""CPU paths of QuantFP8: eager native vs ``torch.compile(native)`` vs ``forward_cpu``.

    .venv/bin/python -m benchmarks.cpu.quant [--quick] [--rounds N] [--shapes 1x128,16x4096]
        [--compile-from N] [--no-standalone] [--modes per-token,static-per-tensor]

Dynamic per-token and per-group-128 quantization of bf16 activations to e4m3fn (``--modes`` adds
the static per-tensor and per-channel modes, whose scale the caller passes). ``eager`` is
``QuantFP8.forward_native``; ``compile`` is a separate ``torch.compile`` of the spec function
``quant_fp8`` (default settings: shapes become dynamic after the first recompile);
``forward_cpu`` is what an enabled QuantFP8 runs on this CPU (compiled above
``QUANT_CPU_TIERS`` elements, eager below). The three are interleaved inside each round so
that drift in this shared VM's clock hits them alike; each cell shows the median and the best of
the rounds, with GB/s counted as bytes read (x) + bytes written (q and scales). The table goes
into benchmarks/results/cpu_quant.md. ``--compile-from N`` moves the compile threshold to N
elements; ``--no-standalone`` calls the compiled tier through Dynamo (before issue 18's
standalone route). "eager tier" is forward_cpu with its compiled tier off.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import platform
import statistics
import time

import torch

from customop import Config, use_config
from customop.ops.quantization import GroupShape, QuantFP8, input_quant_fp8, quant_fp8

SHAPES = [(1, 128), (1, 4096), (2, 4096), (4, 4096), (16, 4096), (256, 8192), (4096, 8192)]
QUICK_SHAPES = [(1, 4096), (16, 4096)]
#: mode -> (static, group shape); the default run measures the first two
MODES = {"per-token": (False, GroupShape.PER_TOKEN), "per-group-128": (False, GroupShape(1, 128)),
         "static-per-tensor": (True, GroupShape.PER_TENSOR), "static-per-channel": (True, GroupShape.PER_CHANNEL)}
DEFAULT_MODES = "per-token,per-group-128"


def native(x: torch.Tensor, scale: torch.Tensor | None, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec behind its own code object, so that the ``compile`` column's Dynamo cache entries
    do not share (and crowd) the recompile limit of ``quant_fp8``, which ``forward_cpu`` compiles."""
    return quant_fp8(x, scale, None, **kwargs)


def static_scale(group_shape: GroupShape, hidden: int) -> torch.Tensor:
    """A static scale of the mode's shape: one element per tensor, ``[H]`` per channel."""
    numel = hidden if group_shape.is_per_channel() else 1
    return torch.rand(numel, dtype=torch.float32) * 0.01 + 0.01


def time_interleaved(fns: dict[str, callable], rounds: int) -> dict[str, list[float]]:
    """Seconds per call, one sample per round for each function, the functions interleaved."""
    for fn in fns.values():  # warm up (and compile)
        fn()
        fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            inner = 1
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            if elapsed < 1e-3:  # short calls: average a batch so the clock's resolution does not dominate
                inner = 50
                start = time.perf_counter()
                for _ in range(inner):
                    fn()
                elapsed = time.perf_counter() - start
            samples[name].append(elapsed / inner)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small shapes only (a smoke run)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--shapes", default="", help="tokens x hidden list (default: SHAPES)")
    parser.add_argument("--compile-from", type=float, default=None, help="compile threshold in elements")
    parser.add_argument("--no-standalone", action="store_true", help="the compiled tier through Dynamo")
    parser.add_argument("--modes", default=DEFAULT_MODES, help=f"comma-separated, of {', '.join(MODES)}")
    args = parser.parse_args()
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")] if args.shapes else \
        QUICK_SHAPES if args.quick else SHAPES
    torch.manual_seed(0)
    compiled_native = torch.compile(native)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"date {datetime.date.today()}  torch {torch.__version__}  threads {torch.get_num_threads()}  "
          f"cpu {platform.processor() or platform.machine()} ({os.cpu_count()} cores)  load average {load:.1f}  "
          f"compile from {args.compile_from or input_quant_fp8.QUANT_CPU_TIERS.min_numel} elements  "
          f"standalone {'off' if args.no_standalone else 'on'}  {args.rounds} rounds")
    print("Cells: median us (best round us). A busy shared VM inflates medians; the best round is "
          "closer to the code's own cost.\n")
    print("| mode | tokens x hidden | eager | compile | forward_cpu | eager tier | forward_cpu vs eager | "
          "forward_cpu vs compile | GB/s (best) |")
    print("|---|---|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for mode in args.modes.split(","):
            static, group_shape = MODES[mode]
            with use_config(Config(custom_ops=["all"])):
                op = QuantFP8(static, group_shape)
            if args.compile_from is not None:
                op.cpu_tiers = op.cpu_tiers.compiling_from(args.compile_from)
            if args.no_standalone:
                op.cpu_tiers = dataclasses.replace(op.cpu_tiers, standalone=False)
            with use_config(Config(custom_ops=["all"])):
                eager_op = QuantFP8(static, group_shape)
            eager_op.cpu_tiers = op.cpu_tiers.compiling_from(math.inf)
            for tokens, hidden in shapes:
                x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
                scale = static_scale(group_shape, hidden) if static else None
                rounds = args.rounds if tokens * hidden < 2**24 else max(5, args.rounds // 3)
                t = time_interleaved({
                    "eager": lambda: op.forward_native(x, scale),
                    "compile": lambda: compiled_native(x, scale, op._math),
                    "cpu": lambda: op.forward_cpu(x, scale),
                    "eager_tier": lambda: eager_op.forward_cpu(x, scale),
                }, rounds)
                med = {k: statistics.median(v) for k, v in t.items()}
                best = {k: min(v) for k, v in t.items()}
                cell = {k: f"{med[k] * 1e6:.1f} ({best[k] * 1e6:.1f})" for k in t}
                q, s = op.forward_cpu(x, scale)
                moved = x.numel() * x.element_size() + q.numel() + s.numel() * 4
                print(f"| {mode} | {tokens}x{hidden} | {cell['eager']} | {cell['compile']} | {cell['cpu']} | "
                      f"{cell['eager_tier']} | {med['eager'] / med['cpu']:.2f}x ({best['eager'] / best['cpu']:.2f}x) | "
                      f"{med['compile'] / med['cpu']:.2f}x ({best['compile'] / best['cpu']:.2f}x) | "
                      f"{moved / min(best.values()) / 1e9:.2f} |", flush=True)


if __name__ == "__main__":
    main()
