"""Benchmark specs of MLA decode (``mla_decode``, the latent attention of DeepSeek MLA's absorbed
decode): DeepSeek-V3 shapes (128 heads, kv_lora_rank 512, rope 64, blocks of 64), bf16, batch 1,
16 and 64 at contexts 4096 and 32768, every row the full context, blocks shuffled (issue 13).

Implementations:
- ``customop``: ``torch.ops.customop.mla_decode`` (the Triton split-context kernel on GPUs), the
  context bound given as a host int as the layer gives it;
- ``eager``: the absorbed math as a serving stack writes it in PyTorch, batched over rows of
  equal length: one gather of the rows through the block table, then a bf16 bmm for the scores
  (fp32 accumulation, bf16 result), softmax in fp32, the probabilities cast back to bf16 and a bf16
  bmm with ``kv_c`` (tensor cores throughout; the runner's correctness reference);
- ``compile``: ``torch.compile`` of ``eager`` (the issue's anchor: 246 us at 64 x 4096, 42 us at
  1 x 32768 on the H200);
- ``spec``: the op's reference, ``paged_latent_decode`` (fp32, a loop over rows).

Decode is bound by the latent cache read: ``bytes_moved`` counts each row of the cache once
(``batch * context * (L + R) * 2``) plus q and the output, so the runner's GB/s column over the
copy bandwidth is the fraction of the floor reached (target: >= 70% at 64 x 4096 and 1 x 32768).
At 64 x 4096 the multiplies are ~73 GFLOP (128 heads x (576 + 512) MACs per cached token), so
the kernel must also keep the tensor cores busy.

``python -m customop.benchmarks.specs.mla --sweep`` (on the GPU) times a few tile configurations
of the Triton kernel (``backends/triton/mla.py``'s ``Config``, through its ``override``), the
launcher's own choice (``choose``) and ``compile`` on every shape (or on ``--shapes 1x1024,8x1024``:
batch x context), checks each output against an fp32 reference, and prints one table.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from typing import Any

import torch

from customop.benchmarks.specs import OpSpec, Shape, compiled
from customop.math import mla as native

HEADS, LATENT, ROPE, BLOCK = 128, 512, 64, 64
SCALE = (128 + ROPE) ** -0.5


def shape_of(batch: int, context: int) -> Shape:
    return Shape(batch, HEADS * LATENT, f"b{batch} ctx{context}", {"context": context},
                 quick=(batch, context) in ((64, 4096), (1, 32768)))


SHAPES = tuple(shape_of(batch, context) for batch in (1, 16, 64) for context in (4096, 32768))


def _inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    batch, context = shape.tokens, shape.extra["context"]
    if device.type == "cpu":
        context = min(context, 2 * BLOCK + 3)  # the runner's dry run (interpreter): check the pipeline, not sizes
    width = -(-context // BLOCK)
    cache = torch.randn(batch * width, BLOCK, LATENT + ROPE, device=device).to(dtype)
    table = torch.randperm(batch * width, device=device).view(batch, width).int()
    return {"q_latent": torch.randn(batch, HEADS, LATENT, device=device).to(dtype),
            "q_pe": torch.randn(batch, HEADS, ROPE, device=device).to(dtype),
            "cache": cache, "table": table, "context": context,
            "lens": torch.full((batch,), context, dtype=torch.int32, device=device)}


def _bytes(shape: Shape, dtype: torch.dtype) -> int:
    batch, context = shape.tokens, shape.extra["context"]
    return (batch * context * (LATENT + ROPE) + batch * HEADS * (2 * LATENT + ROPE)) * dtype.itemsize


def _customop(i):
    args = (i["q_latent"], i["q_pe"], i["cache"], i["table"], i["lens"], i["context"], SCALE)
    return lambda: torch.ops.customop.mla_decode(*args)


def batched_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, table: torch.Tensor,
                   context: int) -> torch.Tensor:
    """``latent_attention`` for rows that all see ``context`` positions, batched, in the input
    dtype as a serving stack runs it: bmm (scores rounded to the input dtype), fp32 softmax,
    the probabilities rounded back, bmm."""
    pos = torch.arange(context, device=cache.device)
    rows = cache[table[:, pos // BLOCK].long(), pos % BLOCK]  # [B, context, L + R]
    query = torch.cat((q_latent, q_pe), dim=-1)
    scores = torch.bmm(query, rows.transpose(1, 2))  # [B, N, context]
    probs = (scores.float() * SCALE).softmax(-1).to(q_latent.dtype)
    return torch.bmm(probs, rows[..., :LATENT])


def fp32_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, table: torch.Tensor,
                context: int) -> torch.Tensor:
    """The same in fp32 throughout (the sweep's reference), the output in fp32."""
    pos = torch.arange(context, device=cache.device)
    rows = cache[table[:, pos // BLOCK].long(), pos % BLOCK].float()
    query = torch.cat((q_latent, q_pe), dim=-1).float()
    scores = torch.bmm(query, rows.transpose(1, 2)) * SCALE
    return torch.bmm(scores.softmax(-1), rows[..., :LATENT])


def _eager(i):
    return lambda: batched_decode(i["q_latent"], i["q_pe"], i["cache"], i["table"], i["context"])


def _compile(i):
    fn = compiled(batched_decode)
    return lambda: fn(i["q_latent"], i["q_pe"], i["cache"], i["table"], i["context"])


def _spec(i):
    return lambda: native.paged_latent_decode(i["q_latent"], i["q_pe"], i["cache"], i["table"], i["lens"], SCALE)


SPECS = [
    OpSpec(name="mla_decode", family="mla", shapes=SHAPES, make_inputs=_inputs, bytes_moved=_bytes,
           impls={"customop": _customop, "eager": _eager, "compile": _compile, "spec": _spec},
           dtypes=(torch.bfloat16,)),
]


# ---- the tile sweep (on the GPU) ------------------------------------------------------------------

#: normwise error vs. fp32 above which a config is flagged WRONG (the kernel's own rounding: P to
#: bf16 and the output once, a few 2**-8)
SWEEP_TOLERANCE = 4 * 2.0 ** -8


def candidates() -> list:
    """The Hopper tiles first (``choose`` swaps HALVES in for short splits), then a few
    alternatives (heads 64/32/16 a program, positions 16/32/64 a tile, 4/8 warps, 2/3 stages,
    half/double the splits, splits of at least 128 or 256 positions instead of 64, two value
    halves a head block on one or two warpgroups): ~15 configs, each one compile."""
    from customop.backends.triton import mla as kernel

    c = kernel.Config
    default = kernel.tiles(torch.bfloat16, HEADS, BLOCK, hopper=True)
    alts = [c(64, 32, 8, 2, 2.0), c(64, 32, 8, 2, 0.5), c(64, 16, 8, 3), c(64, 64, 8, 2), c(64, 32, 8, 3),
            c(32, 32, 8, 3), c(32, 32, 4, 2), c(16, 32, 8, 1, 2.0), c(64, 64, 8, 2, 1.0, 128),
            c(64, 64, 8, 2, 1.0, 256), kernel.HALVES, c(64, 64, 8, 2, v_splits=2), c(64, 64, 4, 2, 2.0, v_splits=2),
            c(64, 32, 4, 2, 1.0, 32, v_splits=2)]
    return [default] + [a for a in alts if a != default]


def sweep(shapes=None, device: torch.device | None = None) -> str:
    """Times every candidate per shape (CUDA graphs, the runner's timer) and returns the table:
    shape, config, splits, us, % of the latent-read floor (bytes / copy bandwidth), normwise
    error vs. fp32, and a flag (WRONG over SWEEP_TOLERANCE, * the fastest correct per shape)."""
    from customop.backend_loader import load_backend
    from customop.backends.triton import mla as kernel
    from customop.benchmarks.runner import measure_copy_bandwidth
    from customop.benchmarks.runner_timing import time_graph

    device = device or torch.device("cuda")
    load_backend(device.type)
    copy_gbps = measure_copy_bandwidth()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    lines = [f"copy {copy_gbps:.0f} GB/s; {name}",
             f"{'shape':<14} {'config':<32} {'splits':>6} {'us':>9} {'% floor':>8} {'err':>9}  flag"]
    for shape in shapes or SHAPES:
        i = _inputs(shape, torch.bfloat16, device)
        floor_us = _bytes(shape, torch.bfloat16) / (copy_gbps * 1e9) * 1e6
        want = fp32_decode(i["q_latent"], i["q_pe"], i["cache"], i["table"], i["context"])
        chosen, chosen_splits = kernel.choose(torch.bfloat16, shape.tokens, HEADS, LATENT, i["context"], BLOCK, device)
        # (label, splits, the scope it runs in, its builder): every candidate under override, the
        # launcher's own choice, and compile (a baseline, never starred)
        runs = [(str(cfg), kernel.num_splits(shape.tokens, HEADS, i["context"], device, cfg),
                 functools.partial(kernel.override, cfg), _customop) for cfg in candidates()]
        runs += [(f"choose: {chosen}", chosen_splits, contextlib.nullcontext, _customop),
                 ("compile", "-", contextlib.nullcontext, _compile)]
        rows = []
        for label, splits, scope, build in runs:
            try:
                with scope():
                    fn = build(i)
                    got = fn().float()
                    us = time_graph([fn])
                err = float((got - want).norm() / want.norm())
            except Exception as exc:  # a config that does not compile or launch is reported
                rows.append([shape.label, label, splits, None, None, None,
                             f"failed: {type(exc).__name__} {str(exc).splitlines()[0][:60] if str(exc) else ''}"])
                continue
            rows.append([shape.label, label, splits, us, 100 * floor_us / us, err,
                         "WRONG" if not err <= SWEEP_TOLERANCE else ""])
        good = [r for r in rows if r[1] != "compile" and r[3] is not None and r[6] == ""]
        if good:
            min(good, key=lambda r: r[3])[6] = "*"
        done = [f"{label:<14} {cfg:<32} {splits:>6} {'-':>9} {'-':>8} {'-':>9}  {flag}" if us is None else
                f"{label:<14} {cfg:<32} {splits:>6} {us:>9.2f} {pct:>7.1f}% {err:>9.2e}  {flag}"
                for label, cfg, splits, us, pct, err, flag in rows]
        print("\n".join(done), file=sys.stderr, flush=True)  # progress; the whole table at the end
        lines += done
        del i, want
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="MLA decode benchmark helpers (the timing itself: "
                                                 "python -m customop.benchmarks.runner --ops mla_decode)")
    parser.add_argument("--sweep", action="store_true", help="time candidate tile configs on this GPU")
    parser.add_argument("--quick", action="store_true", help="only the quick shapes (64 x 4096, 1 x 32768)")
    parser.add_argument("--shapes", default="", help="batch x context pairs instead, e.g. 1x1024,8x1024")
    args = parser.parse_args(argv)
    if args.sweep:
        shapes = [s for s in SHAPES if s.quick] if args.quick else None
        if args.shapes:
            pairs = args.shapes.split(",")
            # compile specializes per shape: room for every pair's graph
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(pairs))
            shapes = [shape_of(*(int(n) for n in pair.split("x"))) for pair in pairs]
        print(sweep(shapes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
