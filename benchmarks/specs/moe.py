"""Benchmark specs of the MoE experts, routing given (the top-k ids and fp32 weights are inputs):
both GEMMs, the activation and the top-k sum, bf16, for Mixtral-8x7B (E8 k2 H4096 I14336) and
Qwen3-30B-A3B (E128 k8 H2048 I768) at T in {1, 16, 256, 4096, 16384}.

Implementations: ``customop`` (``torch.ops.customop.fused_experts``: the Triton route, or
``torch._grouped_mm`` where ``moe_tuning``'s table says so), ``eager`` (the loop over experts
with bf16 GEMMs: ``customop.ops.moe.cpu.per_expert``, device-neutral; the correctness reference),
``grouped_mm`` (the same pipeline on ``torch._grouped_mm``) and ``liger`` (Liger's fused MoE).
The routing is a fixed random top-k of random logits (softmax, renormalised), so experts get
uneven, realistic loads.

The runner reports GB/s over ``bytes_moved`` = the weights of the experts actually used plus the
activations (the decode floor); FLOPs live in ``Shape.extra["flops"]`` (``6 T K H I``). After a
run, ``python -m customop.benchmarks.specs.moe --report OUT/results.json`` prints TFLOP/s per
implementation, the % of the weight-read floor (bytes / the run's copy bandwidth) and the path
the customop launcher chose; ``--tune`` (on the GPU) times ``moe_tuning.candidates`` per shape and
prints ``TABLE`` rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from customop.benchmarks.specs import OpSpec, Shape, liger_module
from customop.math import moe as moe_math
from customop.ops.moe import cpu as moe_cpu

#: label -> (E, top_k, H, I)
MODELS = {"mixtral-8x7b": (8, 2, 4096, 14336), "qwen3-30b-a3b": (128, 8, 2048, 768)}
TOKENS = (1, 16, 256, 4096, 16384)


def _shapes(model: str) -> tuple[Shape, ...]:
    e, k, h, i = MODELS[model]
    return tuple(Shape(t, h, f"{model} T{t}", {"model": model, "experts": e, "top_k": k, "inter": i,
                                               "flops": 6 * t * k * h * i}, quick=t in (1, 4096))
                 for t in TOKENS)


def _inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    e, k, i, h, t = shape.extra["experts"], shape.extra["top_k"], shape.extra["inter"], shape.hidden, shape.tokens
    gen = torch.Generator(device=device).manual_seed(t)
    w13 = (torch.randn(e, 2 * i, h, device=device, generator=gen) * h ** -0.5).to(dtype)
    w2 = (torch.randn(e, h, i, device=device, generator=gen) * i ** -0.5).to(dtype)
    x = torch.randn(t, h, device=device, generator=gen).to(dtype)
    weights, ids = moe_math.fused_topk(torch.randn(t, e, device=device, generator=gen), k, True)
    return {"x": x, "w13": w13, "w2": w2, "topk_weights": weights, "topk_ids": ids}


def experts_used(shape: Shape) -> float:
    """Expected number of distinct experts T tokens touch, with uniform top-k routing."""
    e, k, t = shape.extra["experts"], shape.extra["top_k"], shape.tokens
    return e * (1.0 - (1.0 - k / e) ** t)


def _bytes(shape: Shape, dtype: torch.dtype) -> int:
    h, i = shape.hidden, shape.extra["inter"]
    weights = experts_used(shape) * 3 * h * i * dtype.itemsize
    return int(weights + 2 * shape.tokens * h * dtype.itemsize)


def _args(i: dict) -> tuple:
    return (i["x"], i["w13"], i["w2"], i["topk_weights"], i["topk_ids"])


def _customop(i: dict):
    a = _args(i)
    return lambda: torch.ops.customop.fused_experts(*a, None, None, None, "silu", 1.0, float("inf"), 0.0, False)


def _eager(i: dict):
    a = _args(i)
    return lambda: moe_cpu.per_expert(*a)


def _grouped_mm(i: dict):
    if not hasattr(torch, "_grouped_mm") or i["x"].dtype != torch.bfloat16:
        return None
    a = _args(i)
    return lambda: moe_math.fused_experts_grouped(*a)


def _liger(i: dict):
    module = liger_module("fused_moe")
    if module is None or not hasattr(module, "LigerFusedMoEFunction"):
        return None
    x, w13, w2, w, ids = _args(i)
    fn = module.LigerFusedMoEFunction.apply
    return lambda: fn(x, w13, w2, ids, w.to(x.dtype))


SPECS = [OpSpec(name=f"fused_experts[{model}]", family="moe", shapes=_shapes(model), make_inputs=_inputs,
                bytes_moved=_bytes, dtypes=(torch.bfloat16, torch.float16),
                impls={"customop": _customop, "eager": _eager, "grouped_mm": _grouped_mm, "liger": _liger})
         for model in MODELS]


# ---- after a run: TFLOP/s and the floor -----------------------------------------------------------


def report(results_json: str) -> str:
    """TFLOP/s of every implementation and customop's % of the weight-read floor, per row."""
    with open(results_json) as f:
        data = json.load(f)
    copy_gbps = data["environment"]["copy_gbps"]
    shapes = {s.label: s for spec in SPECS for s in spec.shapes}
    lines = ["| shape | " + " | ".join(f"{n} TFLOP/s" for n in ("customop", "eager", "grouped_mm", "liger"))
             + " | customop us | floor us | customop / floor | path |", "|---|" + "---|" * 8]
    for row in data["results"]:
        shape = shapes.get(row["shape"])
        if shape is None:
            continue
        flops = shape.extra["flops"]
        cells = []
        for name in ("customop", "eager", "grouped_mm", "liger"):
            e = row["impls"].get(name, {})
            cells.append(f"{flops / (e['us'] * 1e-6) / 1e12:.1f}" + ("" if e.get("ok", True) else " WRONG")
                         if "us" in e else "-")
        mine = row["impls"].get("customop", {}).get("us")
        floor = row["bytes"] / (copy_gbps * 1e9) * 1e6
        ratio = f"{mine / floor:.2f}x" if mine else "-"
        lines.append(f"| {row['shape']} | " + " | ".join(cells) + f" | {mine or 0:.1f} | {floor:.1f} | {ratio} | "
                     f"{_path(shape, torch.bfloat16)} |")
    return "\n".join(lines)


def _path(shape: Shape, dtype: torch.dtype) -> str:
    from customop.backends.triton import moe_tuning

    e, k, i = shape.extra["experts"], shape.extra["top_k"], shape.extra["inter"]
    cfg = moe_tuning.config(torch.device("cuda"), shape.tokens, e, i, shape.hidden, k, dtype)
    return f"{cfg.path} m{cfg.block_m}"


def _tuned_shapes(models: tuple[str, ...], tokens: tuple[int, ...]) -> list[tuple[OpSpec, list[Shape]]]:
    return [(spec, [s for s in spec.shapes if not tokens or s.tokens in tokens]) for spec in SPECS
            if not models or spec.name.split("[")[1].rstrip("]") in models]


def _compile_share(job: tuple[int, int, tuple[str, ...], tuple[int, ...], str]) -> int:
    """One worker of ``tune``'s compile pass: runs every ``jobs``-th candidate once, so that the
    Triton cache on disk holds its binaries when the timing pass (one process) gets to it."""
    worker, jobs, models, tokens, dtype_name = job
    from customop.backend_loader import load_backend
    from customop.backends.triton import moe_tuning

    load_backend("cuda")
    dtype, done, index = getattr(torch, dtype_name), 0, 0
    for _spec, shapes in _tuned_shapes(models, tokens):
        for shape in shapes:
            inputs = None
            for cfg in moe_tuning.candidates(shape.tokens, shape.extra["experts"], shape.extra["top_k"]):
                index += 1
                if index % jobs != worker:
                    continue
                inputs = inputs or _inputs(shape, dtype, torch.device("cuda"))
                with moe_tuning.override(cfg):
                    try:
                        _customop(inputs)()
                        done += 1
                    except Exception:  # the timing pass reports it
                        pass
            del inputs
            torch.cuda.empty_cache()
    torch.cuda.synchronize()
    return done


def tune(dtype: torch.dtype = torch.bfloat16, models: tuple[str, ...] = (), tokens: tuple[int, ...] = (),
         jobs: int = 1) -> str:
    """Times every candidate configuration per shape on the current GPU (CUDA graphs, the
    runner's timer) and returns the best as ``moe_tuning.TABLE`` rows. ``models`` / ``tokens``
    limit the sweep. Triton compiles dominate (~1.5 minutes a shape in one process): ``jobs > 1``
    first compiles the candidates in that many processes (the Triton cache on disk is shared), then
    times them in this one, one at a time, so no two timings overlap."""
    from customop.backend_loader import load_backend
    from customop.backends.triton import moe_tuning
    from customop.benchmarks.runner_timing import time_graph

    if jobs > 1:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            work = [(w, jobs, models, tokens, str(dtype).removeprefix("torch.")) for w in range(jobs)]
            print(f"[tune] compile pass: {sum(pool.map(_compile_share, work))} candidates run", file=sys.stderr)
    load_backend("cuda")
    out = []
    for spec, shapes in _tuned_shapes(models, tokens):
        rows = []
        for shape in shapes:
            inputs = _inputs(shape, dtype, torch.device("cuda"))
            timed, failed = [], []
            cands = moe_tuning.candidates(shape.tokens, shape.extra["experts"], shape.extra["top_k"])
            for cfg in cands:
                with moe_tuning.override(cfg):
                    try:
                        timed.append((time_graph([_customop(inputs)]), cfg))
                    except Exception as err:  # a config that fails to compile or launch is skipped
                        failed.append(" ".join(f"{type(err).__name__}: {err}".split())[:160])
                        print(f"[tune] {shape.label} {cfg}: {type(err).__name__}", file=sys.stderr)
            if not timed:  # no row: this token count takes the next row's config (default_config without one)
                why = f"untuned: all {len(cands)} candidates failed"
                why += f", the first with {failed[0]}" if failed else ""
                print(f"[tune] {shape.label}: {why}", file=sys.stderr)
                rows.append(f"        # T{shape.tokens}: {why}")
                continue
            us, best = min(timed, key=lambda p: p[0])
            print(f"[tune] {shape.label}: {us:.1f} us {best}", file=sys.stderr)
            rows.append(f"        ({shape.tokens}, {best!r}),")
        e, k, h, i = MODELS[spec.name.split("[")[1].rstrip("]")]
        key = f"(\"cuda\", {e}, {i}, {h}, {k}, \"{str(dtype).removeprefix('torch.')}\")"
        if not any(r.lstrip().startswith("(") for r in rows):  # no entry: the shape keeps default_config
            out.append(f"    # {key}: no tuned row\n" + "\n".join(r.replace("        ", "    ", 1) for r in rows))
            continue
        out.append(f"    {key}: (\n" + "\n".join(rows) + "\n    ),")
    return "TABLE.update({\n" + "\n".join(out) + "\n})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="MoE benchmark helpers (the timing itself: customop bench --ops moe)")
    parser.add_argument("--report", metavar="RESULTS_JSON", help="TFLOP/s and floor table of a runner output")
    parser.add_argument("--tune", action="store_true", help="time the candidate configs on this GPU")
    parser.add_argument("--models", default="", help=f"--tune only these (comma-separated of {', '.join(MODELS)})")
    parser.add_argument("--tokens", default="", help="--tune only these token counts (comma-separated)")
    parser.add_argument("--jobs", type=int, default=1, help="--tune: compile the candidates in this many processes first")
    args = parser.parse_args(argv)
    if args.report:
        print(report(args.report))
    if args.tune:
        print(tune(models=tuple(m for m in args.models.split(",") if m),
                   tokens=tuple(int(t) for t in args.tokens.split(",") if t), jobs=args.jobs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
