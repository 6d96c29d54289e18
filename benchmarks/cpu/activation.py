"""CPU paths of the activation family: eager native vs ``torch.compile(native)`` vs ``forward_cpu``.

    .venv/bin/python -m benchmarks.cpu.activation [--quick] [--rounds N] [--ops silu_and_mul,relu2]
        [--compile-from N] [--no-standalone]

For each op, dtype (bf16, fp32) and shape: eager is the pure function of
``customop.ops.activation`` (what ``forward_native`` runs); compile is
``torch.compile(fn, dynamic=False)`` built for that one shape (the best case for compile); and
``forward_cpu`` is the op itself, enabled on the CPU platform (its size threshold, then the
shared dynamic-shape compiled function). The methods are interleaved inside each round so that
drift on this shared VM hits all of them alike. The *best* round is reported, not the median:
other jobs on the VM preempt this one for whole scheduler slices (tens of ms; worse with 2
OpenMP threads, where a parallel region waits for its descheduled partner), noise that only
ever adds time. ``--threads 1`` gives steadier numbers on a busy VM. The table goes into
benchmarks/results/cpu_activation.md and sets each op's ``cpu_tiers``. The "native op"
column is the same op disabled (``forward_native`` through the module: what forward_cpu must not
lose to at small sizes, where both pay nn.Module's call overhead); "eager tier" is forward_cpu
with its compiled tier switched off (what it runs below its threshold). ``--compile-from N``
moves every op's threshold to N elements (measure the compiled tier at small sizes);
``--no-standalone`` calls the compiled tier through Dynamo, as before issue 18's standalone route.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import platform
import time
from collections.abc import Callable

import torch

from customop.benchmarks.cpu.timing import fresh_compile
from customop import Config, use_config
from customop.ops import activation as act

# Widths are the *output* width d; gated ops read 2d. (tokens, d)
SILU_SHAPES = [(1, 4096), (4, 4096), (16, 4096), (64, 4096), (128, 8192), (256, 14336), (4096, 14336)]
OTHER_SHAPES = [(1, 4096), (4, 4096), (16, 4096), (64, 4096), (512, 4096), (256, 14336)]
QUICK_SHAPES = [(1, 1024), (16, 1024), (64, 1024)]

OPS: dict[str, Callable[..., torch.nn.Module]] = {  # (**CustomOp kwargs) -> op
    "silu_and_mul": act.SiluAndMul,
    "mul_and_silu": act.MulAndSilu,
    "gelu_and_mul(tanh)": lambda **kw: act.GeluAndMul("tanh", **kw),
    "gelu_and_mul_sparse(0.95)": lambda **kw: act.GeluAndMulSparse(0.95, **kw),
    "fatrelu_and_mul": lambda **kw: act.FatreluAndMul(0.1, **kw),
    "swigluoai_and_mul": act.SwigluOAIAndMul,
    "swiglustep_and_mul": act.SwigluStepAndMul,
    "silu_and_mul_with_clamp": lambda **kw: act.SiluAndMulWithClamp(7.0, 1.702, 1.0, **kw),
    "situ_and_mul": lambda **kw: act.SituAndMul(4.0, 25.0, **kw),
    "gelu": act.GELU,
    "gelu_tanh": act.GELUTanh,
    "gelu_new": act.NewGELU,
    "gelu_fast": act.FastGELU,
    "quick_gelu": act.QuickGELU,
    "relu2": act.ReLUSquaredActivation,
    "xielu": act.XIELU,
}


def time_interleaved(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Best-round seconds per call. Each sample times enough back-to-back calls to last about 2 ms,
    so that microsecond-scale calls are not lost in timer and scheduler noise."""
    for fn in fns.values():  # warm up (and compile; the second call may recompile as dynamic)
        fn()
        fn()
    start = time.perf_counter()
    next(iter(fns.values()))()
    calls = max(1, int(2e-3 / (time.perf_counter() - start)))
    samples: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for i in range(rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:  # rotate: no method always follows another
            fn = fns[name]
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - start) / calls)
    return {k: min(v) for k, v in samples.items()}


def bench_one(label: str, op: torch.nn.Module, native_op: torch.nn.Module, tokens: int, d: int,
              dtype: torch.dtype, rounds: int, eager_op: torch.nn.Module) -> str:
    fn, args = type(op).math_fn, op.math_args()
    x = torch.randn(tokens, 2 * d if op.gated else d).to(dtype)

    def shape_specialized(x: torch.Tensor, *args: object) -> torch.Tensor:
        # its own code object, so that its cache entries never serve forward_cpu's calls
        return fn(x, *args)

    static = fresh_compile(shape_specialized)  # a fresh recompile budget per shape
    if tokens * d >= 1 << 24:
        rounds = max(3, rounds // 3)
    t = time_interleaved({
        "eager": lambda: fn(x, *args),
        "native_op": lambda: native_op(x),
        "compile": lambda: static(x, *args),
        "forward_cpu": lambda: op(x),
        "eager_tier": lambda: eager_op(x),
    }, rounds)
    path = "compiled" if op.cpu_tiers.runs_compiled(x.numel(), x.dtype) else "eager"
    us = {k: v * 1e6 for k, v in t.items()}
    return (f"| {label} | {str(dtype).removeprefix('torch.')} | {tokens}x{tuple(x.shape)[-1]} | "
            f"{us['eager']:.1f} | {us['native_op']:.1f} | {us['compile']:.1f} | "
            f"{us['forward_cpu']:.1f} ({path}) | {us['eager_tier']:.1f} | {t['native_op'] / t['forward_cpu']:.2f}x | "
            f"{t['compile'] / t['forward_cpu']:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small shapes only (a smoke run)")
    parser.add_argument("--shapes", default="", help="tokens x d list, e.g. 1x4096,16x4096 (default: per op)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--ops", default="", help="comma-separated labels (default: all)")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--compile-from", type=float, default=None,
                        help="every op's compile threshold, in elements (default: the ops' own)")
    parser.add_argument("--no-standalone", action="store_true",
                        help="the compiled tier through Dynamo (CpuTiers.standalone off)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    wanted = [o for o in args.ops.split(",") if o] or list(OPS)
    print(f"date {datetime.date.today()}  torch {torch.__version__}  threads {torch.get_num_threads()}  "
          f"cpu {platform.processor() or platform.machine()}  best of {args.rounds} rounds  "
          f"compile from {args.compile_from or 'the ops own thresholds'}  "
          f"standalone {'off' if args.no_standalone else 'as declared'}")
    print("| op | dtype | input | eager fn us | native op us | compile us | forward_cpu us (path) | "
          "eager tier us | forward_cpu vs native op | forward_cpu vs compile |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for label in wanted:
            with use_config(Config(custom_ops=["all"])):
                op = OPS[label]()
                eager_op = OPS[label]()  # its own module: a copy would keep op's bound forward
            eager_op.cpu_tiers = op.cpu_tiers.compiling_from(math.inf)
            if args.compile_from is not None:
                op.cpu_tiers = op.cpu_tiers.compiling_from(args.compile_from)
            if args.no_standalone:
                op.cpu_tiers = dataclasses.replace(op.cpu_tiers, standalone=False)
            with use_config(Config(custom_ops=["none"])):
                native_op = OPS[label](compile_native=False)
            shapes = QUICK_SHAPES if args.quick else SILU_SHAPES if label == "silu_and_mul" else OTHER_SHAPES
            if args.shapes:
                shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
            for dtype_name in args.dtypes.split(","):
                for tokens, d in shapes:
                    print(bench_one(label, op, native_op, tokens, d, getattr(torch, dtype_name), args.rounds,
                                    eager_op),
                          flush=True)


if __name__ == "__main__":
    main()
