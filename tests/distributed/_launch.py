"""Starts N local ranks of a worker module (gloo on 127.0.0.1) and collects their JSON reports.

Each rank is ``python -m <module> --rank R --world-size N --port P --out FILE``, run from the repo
root with ``GLOO_SOCKET_IFNAME=lo`` so that gloo binds the loopback interface only. One job runs
every check (process start-up costs ~2 s; one spawn per test case would multiply that).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A port the kernel just handed out on 127.0.0.1 (closed again; the store re-binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(module: str, world_size: int = 2, timeout: float = 120.0, extra_args: tuple[str, ...] = ()) -> list[dict]:
    """Runs ``module`` as ``world_size`` ranks; returns each rank's report (rank order).

    Raises RuntimeError with every rank's output if a rank writes no report, or the
    job outlives ``timeout`` (a collective mismatch hangs rather than fails; the timeout turns it
    into an error).
    """
    port = free_port()
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               OMP_NUM_THREADS="1", PYTHONPATH=python_path)
    with tempfile.TemporaryDirectory(prefix="customop-tp-") as tmp:
        outs = [Path(tmp) / f"rank{r}.json" for r in range(world_size)]
        procs = [subprocess.Popen(
            [sys.executable, "-m", module, "--rank", str(r), "--world-size", str(world_size), "--port", str(port),
             "--out", str(outs[r]), *extra_args],
            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r in range(world_size)]
        deadline = time.monotonic() + timeout
        logs, timed_out = [], False
        for proc in procs:
            try:
                logs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                timed_out = True
                for p in procs:  # only the processes this job started
                    p.kill()
                logs.append(proc.communicate()[0])
        logs += [p.communicate()[0] for p in procs[len(logs):]]
        # A rank whose checks failed still writes its report (exit 1): the per-check tests show
        # those tracebacks. Only a missing report or a hang is the job's own failure.
        failed = timed_out or not all(o.exists() for o in outs)
        if failed:
            detail = "\n".join(f"--- rank {r} (exit {p.returncode}) ---\n{log[-4000:]}"
                               for r, (p, log) in enumerate(zip(procs, logs)))
            why = f"timed out after {timeout:.0f}s" if timed_out else "a rank failed"
            raise RuntimeError(f"{module}: {why}\n{detail}")
        return [json.loads(o.read_text()) for o in outs]


def run_worker(checks: Callable[[Any], dict[str, Callable[[], None]]]) -> int:
    """The rank side of ``run_ranks``: joins the gloo group from the launcher's arguments, runs
    every check that ``checks(tp_group)`` returns (every rank runs all of them: the same
    collectives in the same order), and writes the ``{check: traceback or None}`` report. A
    failing check is reported to the parent test, which fails that case with the traceback."""
    import argparse
    import datetime
    import traceback

    import torch.distributed as dist

    from customop.distributed import init_tp_group

    parser = argparse.ArgumentParser()
    for arg in ("--rank", "--world-size", "--port"):
        parser.add_argument(arg, type=int)
    parser.add_argument("--out")
    args = parser.parse_args()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world_size, timeout=datetime.timedelta(seconds=60))
    results: dict[str, str | None] = {}
    for name, fn in checks(init_tp_group()).items():
        try:
            fn()
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
    with open(args.out, "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if all(err is None for err in results.values()) else 1
