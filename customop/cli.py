"""The ``customop`` console script."""

from __future__ import annotations

import argparse
import sys

import torch

import customop
from customop.backend_loader import BACKENDS
from customop.config import get_config
from customop.platforms import current_platform
from customop.report import dispatch_report, format_table


def cmd_info(_args: argparse.Namespace) -> int:
    platform = current_platform()
    config = get_config()
    print(f"customop {customop.__version__}  torch {torch.__version__}")
    print(f"platform: {platform.name} (forward method: {platform.forward_method}, dist backend: {platform.dist_backend})")
    if reason := platform.backend_unavailable():
        print(f"  warning: {reason}")
    print(f"config: custom_ops={config.custom_ops} backend={config.backend} mode={config.mode.name} "
          f"-> base mode {'all' if config.default_on else 'none'}")
    print("\nbackends:")
    rows = []
    for spec in BACKENDS.values():
        ok, why = spec.status()
        rows.append([spec.name, "yes" if ok else "no", why])
    print(format_table(["backend", "importable", "why"], rows))
    if platform.is_xpu():
        from customop.backend_loader import load_backend

        print("\nxpu providers:\n" + load_backend("xpu").describe())
    print("\ndispatch:")
    report = dispatch_report(config, platform)
    table = [[r.op, r.op_class + (f" -> {r.replaced_by}" if r.replaced_by else ""),
              "on" if r.enabled else "off", r.runs] for r in report]
    print(format_table(["op", "class", "enabled", "runs"], table) if table else "(no ops registered)")
    return 0


def _progress(done: int, total: int, label: str) -> None:
    """A one-line progress bar on stderr (no dependency)."""
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<28}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def cmd_check(args: argparse.Namespace) -> int:
    """Runs every registered op's resolved path here against its forward_native."""
    from customop.custom_op import CustomOp
    from customop.testing import op_samples, run_conformance

    names = [n for n in customop.list_ops() if not args.ops or n in args.ops]
    platform = current_platform()
    rows, failed = [], 0
    for i, name in enumerate(names):
        _progress(i, len(names), name)
        if getattr(CustomOp.op_registry[name], "has_forward", True) is False:
            rows.append([name, "-", "-", "-", "skip (no forward: a weight holder)"])
            continue
        if op_samples(name) is None:
            rows.append([name, "-", "-", "-", "FAIL (no samples registered)"])
            failed += 1
            continue
        op_cls = CustomOp.op_registry[name]
        for label, dtype, method, err, failure in run_conformance(op_cls, device=args.device):
            ok = failure is None
            failed += not ok
            rows.append([name + (f" [{label}]" if label else ""), method, str(dtype).replace("torch.", ""),
                         f"{err:.3g}", "pass" if ok else f"FAIL {failure}"[:160]])
    _progress(len(names), len(names), "done")
    print(f"platform: {platform.name}, device: {args.device}")
    print(format_table(["op", "path", "dtype", "max err", "result"], rows))
    print(f"\n{len(rows) - failed} passed, {failed} failed")
    return 1 if failed else 0


def cmd_bench(args: argparse.Namespace) -> int:
    from customop.benchmarks import runner

    return runner.main(args.rest) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="customop", description="LLM layer ops on every accelerator")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="platform, backends, config and the dispatch table").set_defaults(fn=cmd_info)
    check = sub.add_parser("check", help="run every op's path here against its forward_native")
    check.add_argument("--ops", nargs="*", help="only these op names")
    check.add_argument("--device", default=None, help="tensor device (default: the platform's)")
    check.set_defaults(fn=cmd_check)
    bench = sub.add_parser("bench", help="GPU benchmarks vs eager, torch.compile and peers (see benchmarks/README.md)")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark runner")
    bench.set_defaults(fn=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "device", "unset") is None:
        platform = current_platform()
        args.device = platform.device_type if platform.device_type in ("cuda", "xpu", "xla") else "cpu"
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
