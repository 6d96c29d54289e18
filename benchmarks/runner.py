"""GPU benchmark runner: every op spec (benchmarks/specs/) against eager native,
torch.compile(native) and Liger, on the current CUDA device. Usage and method: benchmarks/README.md.

    python -m customop.benchmarks.runner --out DIR [--ops PATTERNS] [--quick] [--sweep]

Timing (every implementation the same way): decode sizes (<= 16 tokens) are 20 calls in one CUDA
graph on L2-hot inputs; larger ones (by default, ``--timer graph``) the same graph over enough
input copies that their traffic is 3x the L2, so the calls stream from HBM, and as many output
sets (each call's outputs live until its input set comes round again, so fresh outputs reach HBM
as an in-place op's writes do). Replays are queued behind a device sleep. Why not triton's
do_bench: its timed region starts when the device reaches the start event, and on the H200's
host the Python launch path of these ops (100-240 us per call, measured) is longer than
do_bench's 256 MB L2 flush before it, so the device idles inside the timed region and the numbers
were the host's, in phases (the same kernel measured 30 us and 170 us minutes apart). ``--timer queued`` keeps the flush and queues the calls behind a
sleep sized from the measured launch cost (on the H200 still polluted when the host slows down
mid-run); ``--timer do_bench`` is the old method. Each row also times a device copy moving the
op's bytes the same way ("% same-size copy"): a reference for what that traffic costs at that
size, not a bound (Inductor's silu_and_mul beat torch's copy, 81.9 against 84.3 us).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import fnmatch
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from customop.benchmarks import specs as specs_pkg
from customop.benchmarks.runner_output import compact, sweep_report, targets, timer_report, write_outputs
from customop.benchmarks.runner_timing import GRAPH_CALLS, time_do_bench, time_graph, time_queued, warm_up_graph_timer
from customop.benchmarks.specs import OpSpec, Shape

IMPL_ORDER = ("customop", "eager", "compile", "liger")
NOT_PEERS = ("customop", "eager", "customop_fresh")  # customop_fresh: specs/layernorm.py _in_place
#: references that skip part of the op's work (specs/conv.py's ``gemm``: the GEMM on patch rows
#: laid out beforehand, without the gather): reported as ``x_bound``, never the best peer
BOUNDS = ("gemm",)
DEFAULT_TOLERANCE = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3, torch.float32: 1e-4}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


#: --dry-run: the whole pipeline on CPU tensors with the Triton interpreter (checks, tables,
#: files); times are single wall-clock calls and mean nothing
_DRY_RUN = False
#: beyond 256 tokens: "graph" (default: CUDA graphs over rotating inputs, as for 16 < tokens <=
#: 256), "queued" (L2 flushed, queued behind a device sleep) or "do_bench" (triton's, which counts
#: host launch gaps): see time_graph, time_queued, time_do_bench
_TIMER = "graph"
#: --timer-check: also time customop and compile with triton's do_bench (``us_do_bench``)
_TIMER_CHECK = False
#: graph timer: each input set gets its own outputs (time_graph's ``keep_outputs``); False
#: (--reuse-outputs) lets every call's fresh outputs share one L2-resident buffer, the method up
#: to 2026-12-03
_KEEP_OUTPUTS = True
#: --rounds: each implementation is timed this many times, interleaved with the others; its
#: ``us`` is the median, ``us_rounds`` every round (kept when there is more than one)
_ROUNDS = 1


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- timing ----------------------------------------------------------------------------------


def measure_copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy (bytes read + written over the median time)."""
    if _DRY_RUN:
        src = torch.randn(1 << 22)
        t = time.perf_counter()
        src.clone()
        return 2 * src.numel() * 4 / (time.perf_counter() - t) / 1e9
    import triton

    src = torch.randn(1 << 28, device="cuda")  # 2**28 fp32 = 1 GiB
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    del src, dst
    return 2 * (1 << 30) / (ms * 1e-3) / 1e9


def time_large(fn, entry: dict | None = None) -> float:
    """--timer do_bench, or queued (also the fallback of the graph timer when capture fails)."""
    return time_do_bench(fn) if _TIMER == "do_bench" else time_queued(fn, entry)


def same_size_copy_us(nbytes: int, mode: str, sets: int) -> float:
    """A device-to-device copy (torch's) moving ``nbytes`` (half read, half written), over as
    many buffer pairs and timed as the op's row is: what that traffic costs at this size, launch,
    ramp-up and tail included (a reference, not a bound)."""
    pairs = [(torch.empty(max(nbytes // 8, 1), dtype=torch.int32, device="cuda").fill_(1),
              torch.empty(max(nbytes // 8, 1), dtype=torch.int32, device="cuda")) for _ in range(sets)]
    fns = [lambda src=src, dst=dst: dst.copy_(src) for src, dst in pairs]
    us = _time(fns, mode, {})
    del fns, pairs
    return us


def _sync() -> None:
    if not _DRY_RUN:
        torch.cuda.synchronize()


# ---- correctness -----------------------------------------------------------------------------


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def normwise_error(got: Any, want: Any) -> float:
    """max over outputs of ||got - want|| / ||want|| (fp64 norms); inf on NaN or shape mismatch."""
    g, w = _tensors(got), _tensors(want)
    if len(g) != len(w):
        return float("inf")
    worst = 0.0
    for a, b in zip(g, w):
        if a.shape != b.shape:
            return float("inf")
        a64, b64 = a.float().double(), b.float().double()
        if a64.isnan().any() and not b64.isnan().any():
            return float("inf")
        worst = max(worst, float((a64 - b64).norm() / b64.norm().clamp_min(1e-30)))
    return worst


def _fresh(inputs: dict, keys: tuple[str, ...]) -> dict:
    return {k: (v.clone() if k in keys and isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}


def _copies(inputs: dict, n: int) -> list[dict]:
    return [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()} for _ in range(n)]


# ---- one case ---------------------------------------------------------------------------------


def run_case(spec: OpSpec, shape: Shape, dtype: torch.dtype, impl_names: list[str], l2_bytes: int,
             copy_gbps: float, sweep: list[tuple[str, dict]] | None = None) -> dict:
    inputs = spec.make_inputs(shape, dtype, torch.device("cpu" if _DRY_RUN else "cuda"))
    nbytes = spec.bytes_moved(shape, dtype)
    row: dict[str, Any] = {"op": spec.name, "family": spec.family, "shape": shape.label, "tokens": shape.tokens,
                           "hidden": shape.hidden, "bytes": nbytes, "impls": {}}
    tol = spec.tolerance or DEFAULT_TOLERANCE[dtype]
    compare = spec.compare or normwise_error
    ref = spec.impls["eager"](_fresh(inputs, spec.mutates))()
    _sync()
    decode = shape.tokens <= 16
    mode = "graph" if shape.tokens <= 256 or _TIMER == "graph" else "do_bench"
    # beyond decode sizes, rotate over input copies whose traffic is 3x the L2, so the timed calls
    # miss it (decode sizes stay L2-hot, as in a real decode step)
    sets = 1 if decode or mode == "do_bench" else min(GRAPH_CALLS, max(1, -(-3 * l2_bytes // max(nbytes, 1))))
    timed: dict[str, list] = {}  # implementation -> its calls over the input sets, once checked
    for name in impl_names:
        factory = spec.impls.get(name)
        entry: dict[str, Any] = {}
        row["impls"][name] = entry
        if factory is None:
            entry["skipped"] = "no such implementation"
            continue
        try:
            fn = factory(_fresh(inputs, spec.mutates))
            if fn is None:
                entry["skipped"] = "not applicable"
                continue
            out = fn()
            _sync()
            entry["error"] = err = compare(out, ref)
            entry["ok"] = bool(err <= tol)
            del out
            timed[name] = [fn] + [f for f in (factory(c) for c in _copies(inputs, sets - 1)) if f is not None]
        except Exception as exc:  # one implementation failing must not stop the run
            _failed(spec, shape, name, entry, exc)
    # the rounds: every implementation once per round, the order reversed every other round, so
    # that a drift of the device (clocks, a neighbour's load) reaches each one alike
    for k in range(_ROUNDS):
        for name in (list(timed) if k % 2 == 0 else list(reversed(timed))):
            entry = row["impls"][name]
            if "failed" in entry:
                continue
            try:
                entry.setdefault("us_rounds", []).append(_time(timed[name], mode, entry))
            except Exception as exc:
                _failed(spec, shape, name, entry, exc)
    for name, fns in timed.items():
        entry = row["impls"][name]
        if "failed" in entry:
            continue
        rounds = entry.pop("us_rounds") if _ROUNDS == 1 else entry["us_rounds"]
        entry["us"] = statistics.median(rounds)
        if _TIMER_CHECK and shape.tokens > 256 and not _DRY_RUN and name in ("customop", "compile"):
            entry["us_do_bench"] = time_do_bench(fns[0])
        entry["gbps"] = nbytes / (entry["us"] * 1e-6) / 1e9
        entry["pct_copy"] = 100.0 * entry["gbps"] / copy_gbps
    del timed
    if not decode and not _DRY_RUN:
        row["copy_same_us"] = copy_us = same_size_copy_us(nbytes, mode, sets)
        row["copy_same_gbps"] = nbytes / (copy_us * 1e-6) / 1e9
    if sweep:
        row["sweep"] = _sweep(spec, inputs, mode, sets, sweep)
    row["mode"] = mode if sets == 1 else f"{mode}, {sets} input sets"
    _summarise(row)
    del inputs, ref
    return row


def _failed(spec: OpSpec, shape: Shape, name: str, entry: dict, exc: Exception) -> None:
    entry["failed"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    log(f"{spec.name} {shape.label} {name}: {entry['failed']}")


def _time(fns: list, mode: str, entry: dict) -> float:
    if _DRY_RUN:
        t = time.perf_counter()
        fns[0]()
        return (time.perf_counter() - t) * 1e6
    if mode == "graph" and _waits_for_device(fns[0]):
        entry["note"] = f"waits for the device, not capturable; {'do_bench' if _TIMER == 'do_bench' else 'queued'}"
    elif mode == "graph":
        try:
            return time_graph(fns, keep_outputs=_KEEP_OUTPUTS)
        except Exception as exc:  # e.g. an implementation that syncs: time it eagerly, say so
            entry["note"] = f"graph capture failed ({type(exc).__name__}); {'do_bench' if _TIMER == 'do_bench' else 'queued'}"
            torch.cuda.synchronize()
    return time_large(fns[0], entry)


def _waits_for_device(fn) -> bool:
    """Whether an eager call blocks the host on the device (``.item()``, ``nonzero``, ...), which a
    CUDA graph cannot capture. Asked before capturing, because a capture that fails mid-way leaves
    torch's default CUDA generator in capture state, and every later random draw in the process
    then raises ("Offset increment outside graph capture")."""
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError:
        return True
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return False


def _sweep(spec: OpSpec, inputs: dict, mode: str, sets: int, sweep: list[tuple[str, dict]]) -> list[dict]:
    from customop.backends.triton import _tuning

    factory = spec.impls["customop"]
    results = []
    for kind, fields in sweep:
        with _tuning.override(kind, **fields):
            try:
                fns = [factory(c) for c in _copies(inputs, sets)]
                us = _time(fns, mode, {})
                results.append({"kind": kind, **fields, "us": us})
            except Exception as exc:
                results.append({"kind": kind, **fields, "failed": f"{type(exc).__name__}"})
    return results


def _summarise(row: dict) -> None:
    mine = row["impls"].get("customop", {})
    timed = {n: e["us"] for n, e in row["impls"].items() if n not in NOT_PEERS and "us" in e and e.get("ok", True)}
    peers = {n: us for n, us in timed.items() if n not in BOUNDS}
    bounds = {n: us for n, us in timed.items() if n in BOUNDS}
    if "us" in mine and peers:
        best = min(peers, key=peers.get)
        row["best_peer"], row["speedup"] = best, peers[best] / mine["us"]
        if "us_rounds" in mine:  # --rounds: the best peer of each round against customop's
            per_round = zip(mine["us_rounds"], *(row["impls"][n]["us_rounds"] for n in peers))
            row["speedup_rounds"] = [min(theirs) / ours for ours, *theirs in per_round]
    if "us" in mine and bounds:
        bound = min(bounds, key=bounds.get)
        row["bound"], row["x_bound"] = bound, bounds[bound] / mine["us"]


def _environment(args: argparse.Namespace, copy_gbps: float) -> dict:
    import triton

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:
        commit = ""
    try:  # an unpacked wheel carries its dist-info, so this works for --liger-wheel too
        from importlib.metadata import version

        liger = version("liger_kernel")
    except Exception:
        liger = None
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": commit or None,
            "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
            "device": "cpu (dry run)" if _DRY_RUN else torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "liger": liger, "python": platform.python_version(), "dtype": args.dtype, "copy_gbps": copy_gbps,
            "timer": args.timer, "outputs": "reused" if args.reuse_outputs else "one set per input set",
            "rounds": args.rounds}


# ---- main -------------------------------------------------------------------------------------


def select(all_specs: list[OpSpec], patterns: str) -> list[OpSpec]:
    if not patterns:
        return all_specs
    pats = [p.strip() for p in patterns.split(",") if p.strip()]

    def first_match(s: OpSpec) -> int | None:
        return next((k for k, p in enumerate(pats) if fnmatch.fnmatch(s.name, p) or fnmatch.fnmatch(s.family, p)
                     or s.name.split("[")[0] == p), None)

    # in the order of the patterns (a budget-limited run does the first ones first)
    matched = [(k, n, s) for n, s in enumerate(all_specs) if (k := first_match(s)) is not None]
    return [s for _, _, s in sorted(matched, key=lambda m: m[:2])]


def _sweep_plan(spec: OpSpec) -> list[tuple[str, dict]] | None:
    import importlib
    import pkgutil

    from customop.backends import triton as triton_backend
    from customop.backends.triton import _tuning

    op = "customop::" + spec.name.split("[")[0]
    for info in pkgutil.iter_modules(triton_backend.__path__):
        module = importlib.import_module(f"{triton_backend.__name__}.{info.name}")
        kind = getattr(module, "TUNING", {}).get(op)
        if kind:  # a config kind, or (kind, the alternatives that apply to this op)
            kind, alternatives = kind if isinstance(kind, tuple) else (kind, _tuning.SWEEP[kind])
            return [(kind, fields) for fields in alternatives]
    return None


def _shape_plan(plan: list[tuple[str, dict]] | None, shape: Shape) -> list[tuple[str, dict]] | None:
    """The alternatives of ``plan`` that apply to ``shape`` (``_tuning.sweep_alternatives``: the
    "_tokens" / "_width" bounds some carry), without their filter keys."""
    if not plan:
        return plan
    from customop.backends.triton import _tuning

    return [(kind, fields) for kind, alt in plan
            for fields in _tuning.sweep_alternatives((alt,), shape.tokens, shape.hidden)]


def spec_impls(spec: OpSpec, requested: list[str]) -> list[str]:
    """The implementations timed for a spec: the requested ones, or every one it has (the common
    columns first, then its own peers, e.g. ``torch._grouped_mm`` for MoE)."""
    if requested:
        return requested
    return [*IMPL_ORDER, *(n for n in spec.impls if n not in IMPL_ORDER)]


def main(argv: list[str] | None = None) -> int:
    # `customop bench` hands its arguments here unchanged (customop/cli.py)
    parser = argparse.ArgumentParser(prog="customop bench", description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--ops", default="", help="comma-separated names / fnmatch patterns (spec name or family)")
    parser.add_argument("--quick", action="store_true", help="tokens {1, 4096} at the largest hidden only")
    parser.add_argument("--tokens", default="", help="comma-separated token counts: only the shapes with these")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="default bf16")
    parser.add_argument("--impls", default="",
                        help="a subset of " + ",".join(IMPL_ORDER) + " and the specs' own peers (e.g. grouped_mm, "
                             "varlen_attn); default: every implementation each spec has")
    parser.add_argument("--out", default="", help="folder for results.json, results.md, bandwidth.png")
    parser.add_argument("--liger-wheel", default=None,
                        help="a Liger wheel to unpack when liger_kernel is not installed "
                             "(default: .whl/liger_kernel-*.whl)")
    parser.add_argument("--sweep", action="store_true", help="also time each tuning alternative of the Triton kernels")
    parser.add_argument("--budget-s", type=float, default=330.0,
                        help="start no new shape after this many seconds (results so far are kept)")
    parser.add_argument("--timer", default="graph", choices=("graph", "queued", "do_bench"),
                        help="tokens > 256: graph (default; CUDA graphs over rotating inputs), queued (L2 flushed, "
                             "host launch cost excluded) or triton's do_bench (counts host launch gaps)")
    parser.add_argument("--reuse-outputs", action="store_true",
                        help="graph timer: let every call's fresh outputs share one buffer (the method up to "
                             "2026-12-03; in-place ops then pay for their writes reaching HBM and the rest do not)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time every implementation this many times, interleaved; report each one's median "
                             "and the per-round speedups' range (a single run ranks within the run-to-run spread)")
    parser.add_argument("--timer-check", action="store_true",
                        help="also time customop and compile (tokens > 256) with triton's do_bench, to compare")
    parser.add_argument("--list", action="store_true", help="print the chosen specs and their shapes (no GPU needed)")
    parser.add_argument("--dry-run", action="store_true",
                        help="run the pipeline on CPU (Triton interpreter, tokens <= 4): checks the specs, not speed")
    args = parser.parse_args(argv)

    global _DRY_RUN, _TIMER, _TIMER_CHECK, _KEEP_OUTPUTS, _ROUNDS
    _DRY_RUN, _TIMER, _TIMER_CHECK = args.dry_run, args.timer, args.timer_check
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    _ROUNDS = args.rounds
    _KEEP_OUTPUTS = not args.reuse_outputs
    if _DRY_RUN and os.environ.get("TRITON_INTERPRET") != "1":
        # The interpreter must be chosen before triton is first imported (`import customop`
        # already imports it through torch), so the dry run restarts itself with it set.
        argv = sys.argv[1:] if argv is None else argv
        return subprocess.call([sys.executable, "-m", "customop.benchmarks.runner", *argv],
                               env=dict(os.environ, TRITON_INTERPRET="1"))
    all_specs = specs_pkg.load_specs()
    chosen = select(all_specs, args.ops)
    if args.list:
        for s in chosen:
            print(f"{s.name:28s} {s.family:12s} {len(s.shapes)} shapes: {', '.join(sh.label for sh in s.shapes)}")
        return 0
    if not _DRY_RUN and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("runner: TRITON_INTERPRET is set; refusing to time the interpreter", file=sys.stderr)
        return 2
    if not _DRY_RUN and not torch.cuda.is_available():
        print("runner: no CUDA device (--dry-run checks the specs on CPU; --list shows them)", file=sys.stderr)
        return 2
    if not chosen:
        print(f"runner: no spec matches {args.ops!r}; known: {[s.name for s in all_specs]}", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    tokens = {int(t) for t in args.tokens.split(",") if t.strip()}
    requested = [n.strip() for n in args.impls.split(",") if n.strip()]
    impl_names = list(requested)  # the columns of the outputs: grows with the specs' own peers
    specs_pkg.use_liger_wheel(args.liger_wheel)
    for knob in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, knob):  # one static compile per shape and op
            setattr(torch._dynamo.config, knob, 4096)
    from customop.backend_loader import load_backend

    import customop.ops  # noqa: F401
    if _DRY_RUN:
        from customop.backends import triton as triton_backend

        triton_backend.register_for("cpu")
    else:
        load_backend("cuda")

    t0 = time.perf_counter()
    copy_gbps = measure_copy_bandwidth()
    if not _DRY_RUN:
        warm_up_graph_timer()  # the first graph timing of a process reads fast: not a row's
    env = _environment(args, copy_gbps)
    log(f"{env['device']}, torch {env['torch']}, triton {env['triton']}, liger {env['liger']}; copy {copy_gbps:.0f} GB/s")
    l2 = 64 << 20 if _DRY_RUN else getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
    rows: list[dict] = []
    skipped: list[str] = []
    for spec in chosen:
        if dtype not in spec.dtypes:
            continue
        plan = _sweep_plan(spec) if args.sweep else None
        for shape in spec.shapes:
            if args.quick and not shape.quick or tokens and shape.tokens not in tokens:
                continue
            if time.perf_counter() - t0 > args.budget_s:
                skipped.append(f"{spec.name} {shape.label}")
                continue
            t1 = time.perf_counter()
            if _DRY_RUN:
                shape = dataclasses.replace(shape, tokens=min(shape.tokens, 4), label=f"{shape.label}[dry]")
            names = spec_impls(spec, requested)
            impl_names += [n for n in names if n not in impl_names]
            row = run_case(spec, shape, dtype, names, l2, copy_gbps, _shape_plan(plan, shape))
            rows.append(row)
            mine = row["impls"].get("customop", {})
            log(f"{spec.name:26s} {shape.label:14s} customop {mine.get('us', float('nan')):8.1f} us "
                f"{mine.get('pct_copy', 0):4.0f}% copy  speedup {row.get('speedup', float('nan')):.2f}x "
                f"({time.perf_counter() - t1:.1f} s)")
            # after every row: a run stopped from outside (a device lease's time limit) keeps its rows
            write_outputs(args.out, env, rows, impl_names, copy_gbps, skipped, final=False)
    write_outputs(args.out, env, rows, impl_names, copy_gbps, skipped, final=True)
    if args.sweep:
        print(sweep_report(rows))
    if _TIMER_CHECK:
        print(timer_report(rows))
    text = compact(rows, copy_gbps) + "\n" + targets(rows)  # the targets last: the end of the log
    if skipped:
        text += f"\n\nNot run (over --budget-s {args.budget_s:.0f} s): {', '.join(skipped)}"
    print(text + (f"\n\nEvery column: {args.out}/results.md" if args.out else ""))
    log(f"done in {time.perf_counter() - t0:.0f} s")
    bad = [r for r in rows if not r["impls"].get("customop", {}).get("ok", True) or "failed" in r["impls"].get("customop", {})]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
