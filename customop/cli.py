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
    print("\ndispatch:")
    report = dispatch_report(config, platform)
    table = [[r.op, r.op_class + (f" -> {r.replaced_by}" if r.replaced_by else ""),
              "on" if r.enabled else "off", r.runs] for r in report]
    print(format_table(["op", "class", "enabled", "runs"], table) if table else "(no ops registered)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="customop", description="LLM layer ops on every accelerator")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="platform, backends, config and the dispatch table").set_defaults(fn=cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
