"""CPU GEMM paths for the linear layers: F.linear vs oneDNN ``mkldnn._linear_pointwise``.

    .venv/bin/python -m benchmarks.cpu.linear [--quick] [--shapes MxKxN,...] [--dtypes fp32,bf16,fp16] [--bias]
        [--threads N] [--rounds R] [--clock wall|cpu]

Times eager ``F.linear`` (the native path), ``torch.compile(F.linear)`` and oneDNN's
``torch.ops.mkldnn._linear_pointwise`` on dense (unpacked) weights, fp32 and bf16, at a few
(tokens, in, out) shapes, and the layer itself at tp 1: ``torch.compile`` of a
``ColumnParallelLinear``'s ``forward_native`` (static shapes) against its ``forward_cpu`` (the
other parallel layers run the same GEMM choice, ``cpu_linear``). Every column is first checked
against a float64 run of the spec on the same inputs (normwise relative error: fp32 within 1e-5,
bf16 within four unit roundoffs). The methods are interleaved inside each round so that drift in
this shared VM's clock hits all of them alike; the median of the rounds is reported. The table it
prints goes into benchmarks/results/cpu_linear.md and decides ``customop.ops.linear.cpu_linear``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from customop.benchmarks.cpu.timing import TOLERANCE, check_paths
from customop.config import Config, use_config
from customop.ops.linear import ColumnParallelLinear

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

SHAPES = [(1, 4096, 4096), (16, 4096, 4096), (128, 4096, 4096), (256, 4096, 4096), (256, 4096, 14336),
          (16, 1024, 1024), (256, 1024, 1024)]
#: the paths in the table's column order (the error cell lists them so; "-" where one did not run)
COLUMNS = ("eager", "compile", "onednn", "compile_layer", "forward_cpu")
QUICK_SHAPES = [(1, 1024, 1024), (16, 1024, 1024), (256, 1024, 1024)]


def onednn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def _onednn_runs(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether oneDNN's linear takes these operands: CPUs without AVX-512 have no bf16 inner
    product ("could not create a primitive descriptor"); the column is then left out."""
    try:
        onednn(x[:1], w, b)
    except RuntimeError:
        return False
    return True


def time_interleaved(fns: dict[str, callable], rounds: int, clock=time.perf_counter) -> dict[str, float]:
    for fn in fns.values():  # warm up (and compile)
        fn()
        fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = clock()
            fn()
            samples[name].append(clock() - start)
    return {k: statistics.median(v) for k, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small shapes only (a smoke run)")
    parser.add_argument("--shapes", default=None, help="tokens x in x out, e.g. 16x4096x4096,1x1024x1024")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--bias", action="store_true", help="the layer and the GEMMs with a bias")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: this thread's CPU time (needs --threads 1); robust when other jobs share the "
                             "cores, since time spent descheduled is not counted")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        parser.error("--clock cpu measures one thread; add --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.manual_seed(0)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"date {datetime.date.today()}  torch {torch.__version__}  threads {torch.get_num_threads()}  "
          f"cpu {platform.processor() or platform.machine()}  clock {args.clock}  load average at start {load:.1f}")
    print("| dtype | tokens x in x out | F.linear ms | compile(F.linear) ms | oneDNN ms | oneDNN speedup "
          "| compile(forward_native) ms | forward_cpu ms | forward_cpu x compile | GFLOP/s best | error vs float64 "
          "(F.linear, compile(F.linear), oneDNN, compile(forward_native), forward_cpu) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    shapes = ([tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")] if args.shapes
              else QUICK_SHAPES if args.quick else SHAPES)
    with torch.inference_mode():
        for dtype in (DTYPES[d] for d in args.dtypes.split(",")):
            for m, k, n in shapes:
                x = torch.randn(m, k, dtype=dtype)
                w = (torch.randn(n, k) * k ** -0.5).to(dtype)
                b = torch.randn(n).to(dtype) if args.bias else None
                with use_config(Config(custom_ops=["all"])):
                    layer = ColumnParallelLinear(k, n, bias=args.bias, params_dtype=dtype, return_bias=False)
                layer.weight.data = w
                if args.bias:
                    layer.bias.data = b
                want = F.linear(x.double(), w.double(), None if b is None else b.double())
                torch._dynamo.reset()  # a fresh static-shape compile per shape (no recompile limit)
                compiled_linear = torch.compile(F.linear, dynamic=False)
                compiled_layer = torch.compile(layer.forward_native, dynamic=False)
                fns = {
                    "eager": lambda: F.linear(x, w, b),
                    "compile": lambda: compiled_linear(x, w, b),
                    "onednn": lambda: onednn(x, w, b),
                    "compile_layer": lambda: compiled_layer(x),
                    "forward_cpu": lambda: layer.forward_cpu(x),
                }
                if not _onednn_runs(x, w, b):
                    del fns["onednn"]
                errors = dict(zip(fns, check_paths(fns, want, TOLERANCE[dtype], f"{m}x{k}x{n} {dtype}")))
                rounds = args.rounds if m * k * n < 2**30 else max(3, args.rounds // 2)
                t = time_interleaved(fns, rounds, clock)
                best = min(t.values())
                onednn_cells = (f"{t['onednn'] * 1e3:.2f} | {t['eager'] / t['onednn']:.2f}x" if "onednn" in t
                                else "- | -")
                print(f"| {str(dtype).removeprefix('torch.')} | {m}x{k}x{n} | {t['eager'] * 1e3:.2f} | "
                      f"{t['compile'] * 1e3:.2f} | {onednn_cells} | "
                      f"{t['compile_layer'] * 1e3:.2f} | {t['forward_cpu'] * 1e3:.2f} | "
                      f"{t['compile_layer'] / t['forward_cpu']:.2f} | {2 * m * k * n / best / 1e9:.1f} | "
                      f"{', '.join(errors.get(name, '-') for name in COLUMNS)} |", flush=True)

if __name__ == "__main__":
    main()
