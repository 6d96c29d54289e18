"""CPU paths of the MoE experts: the formulations ``forward_cpu`` chooses between
(``customop/ops/moe/cpu.py``), at decode and prefill sizes, plus the routers.

    .venv/bin/python -m benchmarks.cpu.moe [--threads 1] [--rounds 7] [--models small,qwen3]
        [--tokens 1,4,16,64,256] [--dtypes bfloat16,float32] [--routing] [--clock cpu]

Experts, routing given (top-k ids and weights are inputs, as in the GPU spec): ``spec`` (the loop
with fp32 GEMMs: forward_native), ``per_expert`` (the loop with GEMMs in the weights' dtype),
``grouped`` (``torch._grouped_mm``), ``compiled`` (Inductor on ``grouped``, dynamic shapes: one
graph for every token count), ``native_compile`` (``torch.compile`` of the spec, the function
the op's ``forward_native`` runs, static shapes, a fresh Dynamo cache per row: what a user who
compiles ``forward_native`` gets; the spec's expert loop reads ``nonzero``, a graph break inside a
loop, so Dynamo runs that frame eagerly and compiles only what it calls: the last column says
what it made) and ``forward_cpu`` (what the op runs now; ``x native_compile`` is
``native_compile``'s time over ``forward_cpu``'s; measured 2026-12-03, 2 threads: 0.99-5.05x,
parity only for fp32 at E8 x 256 tokens, the same GEMMs on both sides: docs/cpu.md, "The encoder
and MoE benchmarks against torch.compile"). Where IPEX imports (its
venv: torch 2.8, .ci/xpu.sh) two more columns: ``ipex`` (``GatedMLPMOE`` through the XPU backend's
wrapper, ``backends/xpu/ipex_moe.py``, unprepacked as it runs there) and ``ipex_prepack`` (the same
module built with ``use_prepack=True``, on copies of the weights: prepacking repacks them in place).
torch 2.8 has no CPU ``_grouped_mm``: its grouped columns are ``-`` there. Methods are interleaved
inside each round; the best round is reported (noise on this shared VM only adds time). Outputs
are checked against a float64 run of the spec first: a column off by more than 2% is marked
WRONG and is never the row's best. The table goes to benchmarks/results/cpu_moe.md and sets
``cpu.CHOICE``.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import math
import time
from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch._dynamo.utils import counters
from torch.utils.weak import WeakIdKeyDictionary

from customop.benchmarks.cpu.timing import fresh_compile
from customop.math import moe as moe_math
from customop.ops.moe import cpu as moe_cpu

#: label -> (E, top_k, H, I); "small" is a Mixtral-like layer at a quarter of its width (the real
#: one is 2.8 GB of bf16 weights per layer); "qwen3" is Qwen3-30B-A3B's layer as it is (1.2 GB)
MODELS = {"small": (8, 2, 1024, 3584), "qwen3": (128, 8, 2048, 768)}
TOKENS = (1, 4, 16, 64, 256)


CLOCK = time.perf_counter
#: name -> experts function taking (x, w13, w2, topk_weights, topk_ids); filled by ``main`` where
#: IPEX imports
IPEX: dict[str, Callable[..., torch.Tensor]] = {}


def load_ipex() -> tuple[str | None, dict[str, Callable[..., torch.Tensor]]]:
    """(IPEX's version, the IPEX columns), or (None, {}) where IPEX is absent or does not fit this
    torch (importing a mismatched IPEX exits the process, so the versions are compared first)."""
    from customop.backends.xpu import ipex_moe, probe

    env = probe.probe()
    if env.ipex_version is None or probe.major_minor(env.ipex_version) != probe.major_minor(env.torch_version):
        return None, {}
    try:
        import intel_extension_for_pytorch as ipex
    except (ImportError, OSError, RuntimeError, SystemExit):
        return None, {}
    plain_cls = ipex.llm.modules.GatedMLPMOE

    class Prepacked(plain_cls):
        def __init__(self, W13, W2, W3=None, use_prepack=False):  # noqa: N803  (IPEX's names)
            super().__init__(W13.clone(), W2.clone(), W3, use_prepack=True)

    def column(cls: type, own_weights: bool) -> Callable[..., torch.Tensor]:
        kernel = ipex_moe.bind(None, SimpleNamespace(GatedMLPMOE=cls))
        copies = WeakIdKeyDictionary()  # w13 -> this column's (w13, w2)

        def run(x, w13, w2, topk_weights, topk_ids):
            if own_weights:  # the wrapper caches one module per w13: the two columns must not share one
                if w13 not in copies:
                    copies[w13] = (w13.clone(), w2.clone())
                w13, w2 = copies[w13]
            return kernel.run(x, w13, w2, topk_weights, topk_ids, None, None, None, "silu", 1.0, math.inf, 0.0,
                              False)

        return run

    return ipex.__version__, {"ipex": column(plain_cls, False), "ipex_prepack": column(Prepacked, True)}


def time_interleaved(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Best-round seconds per call; each sample lasts at least ~5 ms (several calls if short)."""
    for fn in fns.values():
        fn()
        fn()
    start = CLOCK()
    next(iter(fns.values()))()
    calls = max(1, int(5e-3 / max(CLOCK() - start, 1e-6)))
    samples: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for i in range(rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:
            start = CLOCK()
            for _ in range(calls):
                fns[name]()
            samples[name].append((CLOCK() - start) / calls)
    return {k: min(v) for k, v in samples.items()}


def bench_experts(model: str, tokens: int, dtype: torch.dtype, rounds: int) -> str:
    e, k, h, i = MODELS[model]
    gen = torch.Generator().manual_seed(tokens)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) * h ** -0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen) * i ** -0.5).to(dtype)
    x = torch.randn(tokens, h, generator=gen).to(dtype)
    weights, ids = moe_math.fused_topk(torch.randn(tokens, e, generator=gen), k, True)
    args = (x, w13, w2, weights, ids)
    # Dynamo's fake _grouped_mm takes bf16 only (eager CPU takes every float dtype); torch 2.8 has
    # no CPU _grouped_mm at all
    grouped_ok = moe_cpu.GROUPED_MM_ON_CPU
    fns = {name: (lambda f=f: f(*args)) for name, f in (*moe_cpu.FORMULATIONS.items(), *IPEX.items())
           if (name not in ("grouped", "compiled") or grouped_ok) and (name != "compiled" or dtype == torch.bfloat16)}
    native, made = compile_native(args)
    fns["native_compile"] = lambda: native(*args)
    fns["forward_cpu"] = lambda: moe_cpu.fused_experts(*args)
    # the reference: the spec in float64 on the same inputs
    want = moe_math.fused_experts(*(t.double() if t.is_floating_point() else t for t in args))
    errors = {name: float((fn().double() - want).norm() / want.norm()) for name, fn in fns.items()}
    bad = {n: err for n, err in errors.items() if not err <= 2e-2}  # NaN is wrong too
    t = time_interleaved(fns, rounds if tokens * k * h * i < 1 << 30 else max(3, rounds // 2))
    us = {n: v * 1e6 for n, v in t.items()}
    flops = 2 * 3 * tokens * k * h * i
    best = min((n for n in us if n not in ("native_compile", "forward_cpu") and n not in bad), key=us.get)
    cells = " | ".join(f"{us[n]:.0f}" if n in us else "-" for n in columns())
    wrong = " WRONG: " + ", ".join(f"{n} {err:.1e}" for n, err in bad.items()) if bad else ""
    return (f"| {model} E{e} k{k} H{h} I{i} | {str(dtype).removeprefix('torch.')} | {tokens} | {cells} | {best} | "
            f"{flops / t[best] / 1e9:.1f} | {t['native_compile'] / t['forward_cpu']:.2f} | {made} |{wrong}")


def compile_native(args: tuple) -> tuple[Callable[..., torch.Tensor], str]:
    """``torch.compile`` of the spec (static shapes, a fresh Dynamo cache: this row's graphs only),
    called once, and what Dynamo made of it: how many frames it compiled and whether the spec's
    own frame fell back to eager (a graph break inside its expert loop)."""
    native = fresh_compile(moe_math.fused_experts)
    counters.clear()
    native(*args)
    eager = any("graph break in loop" in reason for reason in counters["unimplemented"])
    frames = counters["frames"]["ok"]
    return native, f"{frames} frames compiled" + (", the spec's loop eager" if eager else "")


def columns() -> tuple[str, ...]:
    return (*moe_cpu.FORMULATIONS, *IPEX, "native_compile", "forward_cpu")


def bench_routing(num_experts: int, tokens: int, rounds: int) -> str:
    logits = torch.randn(tokens, num_experts)
    bias = torch.randn(num_experts)
    groups = 8 if num_experts % 8 == 0 and num_experts >= 16 else 1

    def grouped():
        return moe_math.grouped_topk(logits, 8, True, groups, min(4, groups), "sigmoid", 2.5, bias)

    compiled = torch.compile(moe_math.grouped_topk, dynamic=True)
    t = time_interleaved({"eager": grouped, "compiled": lambda: compiled(logits, 8, True, groups, min(4, groups),
                                                                        "sigmoid", 2.5, bias)}, rounds)
    return f"| grouped_topk E{num_experts} k8 g{groups} | {tokens} | {t['eager'] * 1e6:.1f} | {t['compiled'] * 1e6:.1f} |"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--routing", action="store_true", help="also time the router, eager vs compiled")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: this thread's CPU time (needs --threads 1; immune to other jobs' load)")
    args = parser.parse_args()
    global CLOCK
    if args.clock == "cpu":
        if args.threads != 1:
            parser.error("--clock cpu needs --threads 1 (thread_time counts the calling thread only)")
        CLOCK = time.thread_time
    if args.threads:
        torch.set_num_threads(args.threads)
    ipex_version, columns_ = load_ipex()
    IPEX.update(columns_)
    print(f"date {datetime.date.today()}  torch {torch.__version__}  IPEX {ipex_version or 'absent'}  "
          f"threads {torch.get_num_threads()}  cpu {platform.processor() or platform.machine()}  best of {args.rounds} rounds  clock {args.clock}")
    names = columns()
    print("| layer | dtype | tokens | " + " | ".join(f"{n} us" for n in names)
          + " | best | best GFLOP/s | forward_cpu x native_compile | native_compile made |")
    print("|---|---|---|" + "---|" * len(names) + "---|---|---|---|")
    with torch.inference_mode():
        for model in args.models.split(","):
            for dtype in args.dtypes.split(","):
                for tokens in (int(t) for t in args.tokens.split(",")):
                    print(bench_experts(model, tokens, getattr(torch, dtype), args.rounds), flush=True)
        if args.routing:
            print("\n| router | tokens | eager us | compiled us |\n|---|---|---|---|")
            for num_experts in (8, 64, 256):
                for tokens in (1, 16, 256, 4096):
                    print(bench_routing(num_experts, tokens, args.rounds), flush=True)


if __name__ == "__main__":
    main()
