"""What every CPU benchmark shares: the timing options and the environment line of a run."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
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
