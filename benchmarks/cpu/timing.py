"""What every CPU benchmark shares: the timing options, the environment line of a run, the timer,
and checking every path against a float64 reference before timing it."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
import time
from collections.abc import Callable

import torch


def add_timing_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--min-time", type=float, default=0.4, help="seconds per measurement")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: all cores)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: this thread's CPU time (only meaningful with --threads 1)")


def start_run(args: argparse.Namespace) -> Callable[[], int]:
    """Applies ``--threads``, prints the run's environment line, returns the ``--clock``."""
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"date {datetime.date.today()}, torch {torch.__version__}, {platform.machine()}, "
          f"{os.cpu_count()} cores, {torch.get_num_threads()} threads, {args.clock} clock, "
          f"load average {os.getloadavg()[0]:.2f}")
    print()
    return time.thread_time_ns if args.clock == "cpu" else time.perf_counter_ns


def time_us(fns: list[Callable[[], object]], min_time: float,
            clock: Callable[[], int] = time.perf_counter_ns) -> list[tuple[float, float]]:
    """(5th percentile, median) time of one call of each of ``fns`` in microseconds by ``clock``,
    the functions taking turns in a shuffled order, over at least ``min_time`` seconds."""
    for fn in fns:
        for _ in range(3):
            fn()  # warm-up: compiles, allocator caches
    times: list[list[float]] = [[] for _ in fns]
    order = list(range(len(fns)))
    shuffle = random.Random(0).shuffle
    deadline = time.perf_counter() + min_time
    while len(times[0]) < 10 or (time.perf_counter() < deadline and len(times[0]) < 5000):
        shuffle(order)
        for i in order:
            start = clock()
            fns[i]()
            times[i].append((clock() - start) / 1e3)
    return [(statistics.quantiles(t, n=20, method="inclusive")[0], statistics.median(t)) for t in times]


#: normwise relative error against the float64 spec a path may have: fp32 to rounding, 16-bit within
#: four unit roundoffs (the bound the ops' tests hold their layers to)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 4 * 2.0 ** -8, torch.float16: 4 * 2.0 ** -11}


def fresh_compile(fn: Callable[..., object]) -> Callable[..., object]:
    """``torch.compile(fn)`` with static shapes on an empty Dynamo cache: each case gets its own
    graph, and many cases never reach Dynamo's recompile limit."""
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False)


def check_paths(paths: dict[str, Callable[[], torch.Tensor]], want: torch.Tensor, tolerance: float,
                what: str) -> list[str]:
    """Checks each path's output against ``want`` (float64) by normwise relative error, raising
    past ``tolerance``; returns the errors formatted for a table cell."""
    errors = []
    for name, path in paths.items():
        err = float((path().double() - want).norm() / want.norm())
        assert err <= tolerance, f"{what} {name}: normwise error {err:.1e} against float64"
        errors.append(f"{err:.0e}")
    return errors


def checked_times(paths: dict[str, Callable[[], torch.Tensor]], want: torch.Tensor, tolerance: float, what: str,
                  min_time: float, clock: Callable[[], int]) -> tuple[dict[str, tuple[float, float]], list[str]]:
    """``check_paths``, then every path timed together (``time_us``): ``({name: (p5, median) us},
    the errors)``."""
    errors = check_paths(paths, want, tolerance, what)
    return dict(zip(paths, time_us(list(paths.values()), min_time, clock))), errors


def ms_cells(times: dict[str, tuple[float, float]], names: list[str]) -> str:
    """``p5 / median`` in ms for each of ``names``, as markdown cells."""
    return " | ".join(f"{times[n][0] / 1e3:.2f} / {times[n][1] / 1e3:.2f}" for n in names)
