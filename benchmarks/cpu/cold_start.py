"""First-call latency of the CPU path's compiled tier: cold, with a filled Inductor cache, and after
``customop.warmup``.

    .venv/bin/python -m benchmarks.cpu.cold_start [--ops rms_norm,silu_and_mul] [--dtype bf16]

Every measurement runs in a fresh Python process (what a restarted server pays), with
``TORCHINDUCTOR_CACHE_DIR`` pointing at a directory this script creates:

- ``cold``: an empty cache directory; the first call compiles from scratch.
- ``warm cache``: the directory the cold run filled; Dynamo still traces, but Inductor's FX graph
  cache and AOTAutograd's cache skip code generation and the C++ build.
- ``warmup()``: a cold process that calls ``customop.warmup(op)`` first (timed, with its own empty
  cache directory); the first request then compiles nothing.

For each, three calls at different token counts above the op's compile threshold: the first (what
the first request pays), a second and a third size (a new batch size: no compile, as the graph is
dynamic in the tokens). Times are wall-clock milliseconds of one call each; compiles dominate, so
single calls are enough (the steady-state per-call times are in benchmarks/results/cpu_*.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

#: (op, hidden, token counts): sizes above each op's compile threshold in bf16 and fp32
#: (RMSNorm: 4096 / 32768 elements; SiluAndMul: 2M).
OPS = {
    "rms_norm": (4096, (16, 48, 200)),
    "silu_and_mul": (2 * 8192, (256, 320, 512)),
}
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _child(op_name: str, dtype_name: str, warm: bool) -> dict:
    """Runs in the fresh process: import, optional warm-up, three first calls; returns timings."""
    t0 = time.perf_counter()
    import torch

    import customop
    from customop.ops.activation import SiluAndMul
    from customop.ops.layernorm import RMSNorm

    import_s = time.perf_counter() - t0
    dtype = getattr(torch, dtype_name)
    hidden, sizes = OPS[op_name]
    with customop.use_config(customop.Config(custom_ops=["all"])):
        op = RMSNorm(hidden, dtype=dtype) if op_name == "rms_norm" else SiluAndMul()
    out = {"import_s": import_s}
    if warm:
        t0 = time.perf_counter()
        customop.warmup(op, dtypes=(dtype,))
        out["warmup_s"] = time.perf_counter() - t0
    inputs = [torch.randn(n, hidden, dtype=dtype) for n in sizes]
    calls = []
    for x in inputs:
        t0 = time.perf_counter()
        op(x)
        calls.append((time.perf_counter() - t0) * 1e3)
    out["calls_ms"] = calls
    return out


def _run_child(op_name: str, dtype_name: str, cache_dir: str, warm: bool) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    code = (f"import json, benchmarks.cpu.cold_start as c; "
            f"print(json.dumps(c._child({op_name!r}, {dtype_name!r}, {warm!r})))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default="rms_norm,silu_and_mul")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = parser.parse_args()
    dtype_name = DTYPES[args.dtype]
    print(f"date {datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.2f}, python {platform.python_version()}")
    print()
    print("| op | dtype | tokens x hidden | run | import (s) | warmup() (s) | 1st call (ms) | 2nd size (ms) "
          "| 3rd size (ms) |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    for op_name in args.ops.split(","):
        hidden, sizes = OPS[op_name]
        shapes = " / ".join(f"{n}x{hidden}" for n in sizes)
        with tempfile.TemporaryDirectory() as filled, tempfile.TemporaryDirectory() as fresh:
            runs = [("cold (empty cache dir)", _run_child(op_name, dtype_name, filled, False)),
                    ("warm cache dir", _run_child(op_name, dtype_name, filled, False)),
                    ("warmup() first, empty cache dir", _run_child(op_name, dtype_name, fresh, True))]
        for label, r in runs:
            warm = f"{r['warmup_s']:.1f}" if "warmup_s" in r else "-"
            c = r["calls_ms"]
            print(f"| {op_name} | {args.dtype} | {shapes} | {label} | {r['import_s']:.1f} | {warm} | "
                  f"{c[0]:.1f} | {c[1]:.1f} | {c[2]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
