"""Compares the customop column of two runner outputs (``results.json``), shape by shape.

Used to show that a change made no op slower: run the runner on the old tree (``--impls customop``
is enough) and on the new one in the same session, then::

    python -m customop.benchmarks.compare OLD/results.json NEW/results.json [--tolerance 0.03]

Prints one markdown row per (op, shape) with old us, new us and new/old, marks rows slower than
``1 + tolerance`` and exits 1 if any is (timing noise on the H200's graph timer is ~1-2%).
"""

from __future__ import annotations

import argparse
import json
import sys


def _times(path: str) -> dict[tuple[str, str], float]:
    with open(path) as f:
        rows = json.load(f)["results"]
    return {(r["op"], r["shape"]): r["impls"]["customop"]["us"] for r in rows
            if r.get("impls", {}).get("customop", {}).get("us") is not None}


def compare(old: dict[tuple[str, str], float], new: dict[tuple[str, str], float],
            tolerance: float) -> tuple[list[str], int, int]:
    """Markdown rows, the number of rows slower than ``1 + tolerance``, the number compared."""
    lines = ["| op | shape | old us | new us | new/old |", "|---|---|---|---|---|"]
    slower = 0
    for key in sorted(old.keys() & new.keys()):
        ratio = new[key] / old[key]
        flag = " **slower**" if ratio > 1 + tolerance else ""
        slower += bool(flag)
        lines.append(f"| {key[0]} | {key[1]} | {old[key]:.2f} | {new[key]:.2f} | {ratio:.3f}{flag} |")
    for key in sorted(old.keys() ^ new.keys()):
        lines.append(f"| {key[0]} | {key[1]} | {old.get(key, '-')} | {new.get(key, '-')} | only one run |")
    return lines, slower, len(old.keys() & new.keys())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--tolerance", type=float, default=0.03, help="relative slowdown still counted as noise")
    args = parser.parse_args(argv)
    lines, slower, compared = compare(_times(args.old), _times(args.new), args.tolerance)
    print("\n".join(lines))
    print(f"\n{slower} of {compared} compared rows slower than {1 + args.tolerance:.2f}x")
    return 1 if slower else 0


if __name__ == "__main__":
    sys.exit(main())
