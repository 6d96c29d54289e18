"""CPU paths of the rotary family: eager native vs torch.compile(native) vs ``forward_cpu``.

    .venv/bin/python -m benchmarks.cpu.rotary [--quick] [--rounds N] [--threads N] [--median]
        [--tokens 256,2048] [--ops apply_rotary_emb] [--dtypes bf16] [--warmup]

``RotaryEmbedding`` (NeoX, full rotary, head 128, 32 query heads and 8 key heads, positions
below 4096) at tokens 1-2048 in fp32 and bf16, plus ``ApplyRotaryEmb`` on the query alone.
``eager`` is the op built disabled (``custom_ops=["none"]``: ``forward_native`` through the
module call); ``forward_cpu`` the op built enabled on the CPU platform (the same module call);
``compile`` a per-shape static ``torch.compile`` of the pure function (Inductor's best case, no
module overhead). ``--warmup``: ``customop.warmup`` the enabled ops first (32 + 8 heads of 128),
as a server does at start-up; without it the first compiled call of each layout builds its
artifact (ApplyRotaryEmb's chunked cos/sin: copied to the contiguous artifact at small sizes
until the row-strided one exists). The table it prints goes into benchmarks/results/cpu_rotary.md and decides
``customop.ops.rotary_embedding.base.ROTARY_CPU_TIERS``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

import customop
from customop.ops.rotary_embedding import ApplyRotaryEmb, RotaryEmbedding, apply_rotary_emb, rotary_embedding
from customop.testing import forced_platform

TOKENS = (1, 2, 4, 8, 16, 256, 2048)  # 2-8: where eager and compiled cross
QUICK_TOKENS = (1, 16, 256)
Q_HEADS, KV_HEADS, HEAD = 32, 8, 128
MAX_POS = 4096


def time_interleaved(fns: dict[str, Callable[[], object]], rounds: int,
                     stat: Callable[[list[float]], float] = min) -> dict[str, float]:
    """Seconds per call: ``stat`` (min by default) over single timed calls, the methods interleaved
    in a rotating order.
    Short calls get more rounds (up to ~0.3 s of calls per method, at most 20x ``rounds``). The
    minimum estimates the uncontended cost on a shared VM, where preemption of one OpenMP thread
    stalls a whole parallel region (medians there swing by 10-100x)."""
    n = rounds
    for fn in fns.values():  # warm up (and compile), then size the rounds
        for _ in range(3):
            fn()
        start = time.perf_counter()
        fn()
        n = max(n, min(20 * rounds, int(0.3 / max(time.perf_counter() - start, 1e-7))))
    samples: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for i in range(n):
        # rotate the order: a method timed right after another sees that one's cache footprint
        for name in names[i % len(names):] + names[: i % len(names)]:
            start = time.perf_counter()
            fns[name]()
            samples[name].append(time.perf_counter() - start)
    return {k: stat(v) for k, v in samples.items()}


def _row(op: str, dtype: torch.dtype, tokens: int, t: dict[str, float], nbytes: int) -> str:
    best = min(t.values())
    return (f"| {op} | {str(dtype).removeprefix('torch.')} | {tokens} | {t['eager'] * 1e6:.1f} | "
            f"{t['compile'] * 1e6:.1f} | {t['forward_cpu'] * 1e6:.1f} | {t['eager'] / t['forward_cpu']:.2f}x | "
            f"{nbytes / best / 1e9:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer shapes (a smoke run)")
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--median", action="store_true", help="report medians instead of minima")
    parser.add_argument("--tokens", type=lambda s: tuple(int(t) for t in s.split(",")), default=None,
                        help="comma-separated token counts (default: all, or --quick's)")
    parser.add_argument("--ops", type=lambda s: set(s.split(",")), default={"rotary_embedding", "apply_rotary_emb"},
                        help="comma-separated: rotary_embedding, apply_rotary_emb (default: both)")
    parser.add_argument("--warmup", action="store_true",
                        help="customop.warmup the enabled ops first (heads 32 + 8, head 128)")
    parser.add_argument("--dtypes", type=lambda s: tuple({"fp32": torch.float32, "bf16": torch.bfloat16}[d]
                                                         for d in s.split(",")),
                        default=(torch.float32, torch.bfloat16), help="comma-separated: fp32, bf16 (default: both)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    stat = statistics.median if args.median else min
    torch.manual_seed(0)
    # Every shape of every method compiles the same code object; keep them all compiled.
    torch._dynamo.config.recompile_limit = 64
    print(f"date {datetime.date.today()}  torch {torch.__version__}  threads {torch.get_num_threads()}  "
          f"cpus {os.cpu_count()}  machine {platform.machine()}  load {os.getloadavg()[0]:.1f}  "
          f"statistic {'median' if args.median else 'min'} of {args.rounds} rounds")
    print("| op | dtype | tokens | eager us | compile us | forward_cpu us | forward_cpu speedup | GB/s best |")
    print("|---|---|---|---|---|---|---|---|")
    with torch.inference_mode(), forced_platform("cpu"):
        for dtype in args.dtypes:
            ops = {}
            for mode in ("none", "all"):  # disabled: forward_native; enabled: forward_cpu
                with customop.use_config(customop.Config(custom_ops=[mode])):
                    ops[mode] = (RotaryEmbedding(HEAD, HEAD, MAX_POS, 10000.0, True, dtype), ApplyRotaryEmb())
            if args.warmup:
                customop.warmup(list(ops["all"]), dtypes=(dtype,), heads=(Q_HEADS, KV_HEADS), head_size=HEAD)
            static_rope = torch.compile(rotary_embedding, dynamic=False)
            static_apply = torch.compile(apply_rotary_emb, dynamic=False)
            cache = ops["all"][0].cos_sin_cache
            for tokens in args.tokens or (QUICK_TOKENS if args.quick else TOKENS):
                pos = torch.randint(0, MAX_POS, (tokens,))
                q = torch.randn(tokens, Q_HEADS * HEAD, dtype=dtype)
                k = torch.randn(tokens, KV_HEADS * HEAD, dtype=dtype)
                if "rotary_embedding" in args.ops:
                    t = time_interleaved({
                        "eager": lambda: ops["none"][0](pos, q, k),
                        "compile": lambda: static_rope(pos, q, k, HEAD, cache, True),
                        "forward_cpu": lambda: ops["all"][0](pos, q, k),
                    }, args.rounds, stat)
                    # read q, k and the cache rows once, write q and k once
                    nbytes = 2 * (q.numel() + k.numel()) * q.element_size() + tokens * HEAD * cache.element_size()
                    print(_row("rotary_embedding", dtype, tokens, t, nbytes), flush=True)

                if "apply_rotary_emb" in args.ops:
                    x = q.view(tokens, Q_HEADS, HEAD)
                    cos, sin = cache[pos].chunk(2, dim=-1)
                    t = time_interleaved({
                        "eager": lambda: ops["none"][1](x, cos, sin),
                        "compile": lambda: static_apply(x, cos, sin, True, False),
                        "forward_cpu": lambda: ops["all"][1](x, cos, sin),
                    }, args.rounds, stat)
                    print(_row("apply_rotary_emb", dtype, tokens, t, 2 * x.numel() * x.element_size()), flush=True)


if __name__ == "__main__":
    main()
