"""The dispatcher's cost per call: a trivial op through CustomOp vs calling its function directly.

    python -m customop.benchmarks.dispatch_overhead [--calls N]

The op returns its input unchanged, so the difference is pure Python dispatch: nn.Module.__call__
plus CustomOp.forward plus the resolved bound method. Goal: under 1 us per call on CI's CPU.
"""

from __future__ import annotations

import argparse
import platform as host
import statistics
import timeit

import torch

from customop import Config, CustomOp, use_config


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


class Identity(CustomOp):
    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return identity(x)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        return identity(x)


def per_call_ns(fn, x, calls: int, repeats: int = 7) -> float:
    times = timeit.repeat(lambda: fn(x), number=calls, repeat=repeats)
    return statistics.median(times) / calls * 1e9


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000)
    args = parser.parse_args(argv)
    x = torch.zeros(1)
    with use_config(Config(custom_ops=["all"])):
        op = Identity()
    direct = per_call_ns(identity, x, args.calls)
    through_op = per_call_ns(op, x, args.calls)
    module_call = per_call_ns(torch.nn.Identity(), x, args.calls)
    print(f"host: {host.processor() or host.machine()}, python {host.python_version()}, torch {torch.__version__}")
    print("| path | ns per call |\n|---|---|")
    print(f"| direct function call | {direct:.0f} |")
    print(f"| torch.nn.Identity() (nn.Module.__call__ alone) | {module_call:.0f} |")
    print(f"| CustomOp (enabled, forward_cpu) | {through_op:.0f} |")
    print(f"\ndispatch overhead: {through_op - direct:.0f} ns per call")


if __name__ == "__main__":
    main()
