"""The ``customop`` console script (also ``python -m customop``)."""

from __future__ import annotations

import argparse
import os
import sys

import torch

import customop
from customop.backend_loader import BACKENDS
from customop.config import get_config
from customop.platforms import current_platform
from customop.report import dispatch_report, format_table, moe_routes

#: Weight holders (``has_forward = False``): no forward to run; the ops whose samples use them check them.
_CHECKED_THROUGH = {"parallel_lm_head": "logits_processor"}


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
    heading, routes = moe_routes(config, platform)
    print(f"\nmoe routes ({heading}):")
    if routes:
        print(format_table(["shape", "tokens", "experts route"], routes))
    return 0


def _progress(done: int, total: int, label: str) -> None:
    """A one-line progress bar on stderr (no dependency); only on a terminal, since redrawing it
    with \\r in a log file makes one long line."""
    if not sys.stderr.isatty():
        return
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<28}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _op_names(requested: list[str] | None) -> list[str]:
    """--ops: op or class names, space- or comma-separated; every registered op by default."""
    from customop.custom_op import CustomOp

    if requested is None:
        return customop.list_ops()
    names = []
    for key in (k.strip() for item in requested for k in item.split(",")):
        if not key:
            continue
        try:
            names.append(CustomOp.resolve_op_name(key))
        except KeyError as err:
            raise KeyError(f"{err.args[0]}; known ops: {', '.join(customop.list_ops())}") from None
    return list(dict.fromkeys(names))


def _check_op(name: str, device: str) -> list[tuple[list[str], str]]:
    """The table rows for one op, each with its outcome: pass, fail or skip."""
    from customop.custom_op import CustomOp
    from customop.testing import op_samples, run_conformance

    op_cls = CustomOp.op_registry[name]
    if getattr(op_cls, "has_forward", True) is False:
        via = _CHECKED_THROUGH.get(name, "the ops that use it")
        return [([name, "-", "-", "-", f"skip (a weight holder with no forward; checked through {via})"], "skip")]
    if op_samples(name) is None:
        return [([name, "-", "-", "-", "FAIL (no samples registered)"], "fail")]
    rows = []
    try:
        for label, dtype, method, err, failure in run_conformance(op_cls, device=device):
            rows.append(([name + (f" [{label}]" if label else ""), method, str(dtype).replace("torch.", ""),
                          f"{err:.3g}", "pass" if failure is None else f"FAIL {failure}"[:160]],
                         "pass" if failure is None else "fail"))
    except Exception as err:  # building the op or its samples failed: one op's row, not the whole run
        rows.append(([name, "-", "-", "-", f"FAIL {type(err).__name__}: {err}"[:160]], "fail"))
    return rows or [([name, "-", "-", "-", "FAIL (its samples built no case)"], "fail")]


def cmd_check(args: argparse.Namespace) -> int:
    """Runs every registered op's resolved path here against its forward_native."""
    names = _op_names(args.ops)
    platform = current_platform()
    rows, counts = [], {"pass": 0, "fail": 0, "skip": 0}
    for i, name in enumerate(names):
        _progress(i, len(names), name)
        for row, outcome in _check_op(name, args.device):
            rows.append(row)
            counts[outcome] += 1
    _progress(len(names), len(names), "done")
    print(f"platform: {platform.name}, device: {args.device}")
    if rows:
        print(format_table(["op", "path", "dtype", "max err", "result"], rows))
    print(f"\n{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped")
    if counts["pass"] + counts["fail"] == 0:
        why = " (every op chosen is skipped here)" if counts["skip"] else ""
        print(f"customop check: nothing was checked{why}", file=sys.stderr)
        return 1
    return 1 if counts["fail"] else 0


def cmd_bench(args: argparse.Namespace) -> int:
    from customop.benchmarks import runner

    return runner.main(args.rest) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="customop", description="LLM layer ops on every accelerator")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="platform, backends, config and the dispatch table").set_defaults(fn=cmd_info)
    check = sub.add_parser("check", help="run every op's path here against its forward_native")
    check.add_argument("--ops", nargs="+", help="only these ops: op or class names, space- or comma-separated")
    check.add_argument("--device", default=None, help="tensor device (default: the platform's)")
    check.set_defaults(fn=cmd_check)
    # bench's options, --help included, belong to the benchmark runner: main() hands them on.
    sub.add_parser("bench", add_help=False, help="GPU benchmarks vs eager, torch.compile and peers "
                   "(customop bench --help; benchmarks/README.md)").set_defaults(fn=cmd_bench)
    return parser


def _error_line(err: BaseException) -> str:
    """The library's message (it names the fix) on one line, with the CUSTOMOP_* variables it
    does not name: most of these errors come from the environment."""
    text = " ".join(str(err.args[0] if isinstance(err, KeyError) and err.args else err).split())
    env = [f"{k}={v!r}" for k, v in sorted(os.environ.items()) if k.startswith("CUSTOMOP_") and k not in text]
    return f"customop: error: {text}" + (f" (environment: {', '.join(env)})" if env else "")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # parse_known_args: a REMAINDER positional would not take arguments that start with "--"
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    try:
        if getattr(args, "device", "unset") is None:
            platform = current_platform()
            args.device = platform.device_type if platform.device_type in ("cuda", "xpu", "xla") else "cpu"
        return args.fn(args)
    except (ValueError, RuntimeError, KeyError, ImportError) as err:  # config, platform and backend errors
        print(_error_line(err), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
