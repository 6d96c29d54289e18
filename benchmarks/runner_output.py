"""The GPU runner's output: markdown tables, the issue-4 targets summary, the tuning-sweep table,
a bandwidth plot, and the results files (benchmarks/README.md)."""

from __future__ import annotations

import json
import os
import sys
import time


def _fmt_us(e: dict) -> str:
    if "us" not in e:
        return "FAILED" if "failed" in e else "-"
    flag = "" if e.get("ok", True) else " (WRONG)"
    return f"{e['us']:.1f} ({e['gbps']:.0f}){flag}"


def markdown(rows: list[dict], impl_names: list[str], copy_gbps: float) -> str:
    lines = []
    for op in dict.fromkeys(r["op"] for r in rows):
        lines += [f"\n### {op}\n", "| shape | " + " | ".join(f"{n} us (GB/s)" for n in impl_names)
                  + " | customop % copy | % same-size copy | speedup vs best peer | timing |",
                  "|---|" + "---|" * len(impl_names) + "---|---|---|---|"]
        for r in (r for r in rows if r["op"] == op):
            mine = r["impls"].get("customop", {})
            pct = f"{mine['pct_copy']:.0f}%" if "pct_copy" in mine else "-"
            speed = f"{r['speedup']:.2f}x ({r['best_peer']})" if "speedup" in r else "-"
            if "x_bound" in r:
                speed += f"; {r['x_bound']:.2f}x the {r['bound']} bound"
            lines.append(f"| {r['shape']} | " + " | ".join(_fmt_us(r["impls"].get(n, {})) for n in impl_names)
                         + f" | {pct} | {_same_size(r)} | {speed} | {r['mode']} |")
    lines.append(f"\nCopy ceiling: {copy_gbps:.0f} GB/s (1 GiB device-to-device, read + write). "
                 "% same-size copy: customop's GB/s over a device copy moving the op's bytes, timed the same way "
                 "(copy us in parentheses).")
    return "\n".join(lines)


def _same_size(r: dict) -> str:
    mine = r["impls"].get("customop", {})
    if "copy_same_gbps" not in r or "gbps" not in mine:
        return "-"
    return f"{100 * mine['gbps'] / r['copy_same_gbps']:.0f}% ({r['copy_same_us']:.1f})"


def compact(rows: list[dict], copy_gbps: float) -> str:
    """One short line per op and shape (what the console shows; results.md has every column)."""
    lines = [f"\n| op | shape | customop us | % copy | % same-size copy (copy us) | best peer us | speedup |"
             f"  (copy {copy_gbps:.0f} GB/s)", "|---|---|---|---|---|---|---|"]
    for r in rows:
        mine = r["impls"].get("customop", {})
        us = f"{mine['us']:.1f}" if "us" in mine else ("FAILED" if "failed" in mine else "-")
        if not mine.get("ok", True):
            us += " WRONG"
        peer = f"{r['impls'][r['best_peer']]['us']:.1f} {r['best_peer']}" if "best_peer" in r else "-"
        pct = f"{mine['pct_copy']:.0f}" if "pct_copy" in mine else "-"
        speed = f"{r['speedup']:.2f}x{_round_range(r)}" if "speedup" in r else "-"
        lines.append(f"| {r['op']} | {r['shape']} | {us} | {pct} | {_same_size(r)} | {peer} | {speed} |")
    return "\n".join(lines)


def _round_range(r: dict) -> str:
    """`` (lo-hi)``: the range of the per-round speedups (``--rounds``), or nothing."""
    rounds = r.get("speedup_rounds")
    return f" ({min(rounds):.2f}-{max(rounds):.2f})" if rounds and len(rounds) > 1 else ""


def targets(rows: list[dict]) -> str:
    """Issue 4's targets, per op: >= 1.10x the best peer, >= 95% of copy at >= 4096 tokens,
    decode (<= 16 tokens) at or below the best peer."""
    out = ["\n### Targets (customop vs peers)\n", "| op | min speedup (shape) | below 1.10x | >=4096 tok below 95% copy | decode slower than best peer | wrong |",
           "|---|---|---|---|---|---|"]
    for op in dict.fromkeys(r["op"] for r in rows):
        rs = [r for r in rows if r["op"] == op]
        sp = [r for r in rs if "speedup" in r]
        worst = min(sp, key=lambda r: r["speedup"]) if sp else None
        slow = [r["shape"] for r in sp if r["speedup"] < 1.10]
        bw = [f"{r['shape']} ({r['impls']['customop']['pct_copy']:.0f}%; same-size copy {_same_size(r)})" for r in rs
              if r["tokens"] >= 4096 and r["impls"].get("customop", {}).get("pct_copy", 100) < 95]
        dec = [r["shape"] for r in sp if r["tokens"] <= 16 and r["speedup"] < 1.0]
        wrong = [r["shape"] for r in rs if not r["impls"].get("customop", {}).get("ok", True)
                 or "failed" in r["impls"].get("customop", {})]
        worst_text = f"{worst['speedup']:.2f}x{_round_range(worst)} ({worst['shape']})" if worst else "-"
        cells = [worst_text] + [", ".join(items) or "-" for items in (slow, bw, dec, wrong)]
        out.append(f"| {op} | " + " | ".join(cells) + " |")
    sp = [r for r in rows if "speedup" in r]
    below = [r for r in sp if r["speedup"] < 1.0]
    out.append(f"\nRows below 1.00x the best peer: {len(below)} of {len(sp)}")
    if any(len(r.get("speedup_rounds", ())) > 1 for r in sp):
        every = [f"{r['op']} {r['shape']}" for r in below if max(r.get("speedup_rounds", [r["speedup"]])) < 1.0]
        out[-1] += f"; below in every round: {len(every)}" + (f" ({', '.join(every)})" if every else "")
    return "\n".join(out)


def plot(rows: list[dict], impl_names: list[str], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ops = list(dict.fromkeys(r["op"] for r in rows))
    cols = 4
    fig, axes = plt.subplots(-(-len(ops) // cols), cols, figsize=(5 * cols, 3.6 * -(-len(ops) // cols)), squeeze=False)
    for ax, op in zip(axes.flat, ops):
        rs = [r for r in rows if r["op"] == op]
        for name in impl_names:
            pts = [(i, r["impls"][name]["gbps"]) for i, r in enumerate(rs) if "gbps" in r["impls"].get(name, {})]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.set_xticks(range(len(rs)), [r["shape"] for r in rs], rotation=60, fontsize=7)
        ax.set_title(op, fontsize=9)
        ax.set_ylabel("GB/s")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(ops):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def sweep_report(rows: list[dict]) -> str:
    out = ["\n### Tuning sweep\n", "Per shape: the table's pick and the fastest alternative, each with its speedup over the "
           "best peer (peer us / ours; >= 1.00 is the target).\n",
           "| op | shape | table pick us | pick vs peer | best alternative | us | best vs pick | best vs peer | best peer us |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        alts = [s for s in r.get("sweep", []) if "us" in s]
        if not alts:
            continue
        best = min(alts, key=lambda s: s["us"])
        pick = r["impls"].get("customop", {}).get("us", float("nan"))
        fields = ", ".join(f"{k}={v}" for k, v in best.items() if k not in ("us", "kind"))
        peer_us = r["impls"][r["best_peer"]]["us"] if "best_peer" in r else float("nan")
        peer = f"{peer_us:.2f} {r['best_peer']}" if "best_peer" in r else "-"
        out.append(f"| {r['op']} | {r['shape']} | {pick:.2f} | {peer_us / pick:.2f}x | {best['kind']}: {fields} | "
                   f"{best['us']:.2f} | {pick / best['us']:.2f}x | {peer_us / best['us']:.2f}x | {peer} |")
    out += ["\nEvery alternative (fields replaced in the table's pick: us; compare with the pick's us above):\n"]
    for r in rows:
        alts = r.get("sweep", [])
        if alts:
            cells = "; ".join(" ".join(f"{k}={v}" for k, v in s.items() if k not in ("us", "kind", "failed"))
                              + (f": {s['us']:.2f}" if "us" in s else f": FAILED {s.get('failed', '')}") for s in alts)
            out.append(f"- {r['op']} {r['shape']} [{alts[0]['kind']}]: {cells}")
    return "\n".join(out)


def timer_report(rows: list[dict]) -> str:
    """--timer-check: the queued timer against triton's do_bench, with the host launch cost."""
    out = ["\n### Timer check (tokens > 256)\n", "| op | shape | impl | runner us | do_bench us | host us per call |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        for name, e in r["impls"].items():
            if "us_do_bench" in e:
                out.append(f"| {r['op']} | {r['shape']} | {name} | {e['us']:.1f} | {e['us_do_bench']:.1f} | "
                           f"{e.get('host_us', float('nan')):.0f} |")
    return "\n".join(out)


def write_outputs(out_dir: str, env: dict, rows: list[dict], impl_names: list[str], copy_gbps: float,
                  skipped: list[str], final: bool) -> None:
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"environment": env, "results": rows, "not_run": skipped}, f, indent=1)
    if final:
        with open(os.path.join(out_dir, "results.md"), "w") as f:
            f.write(f"# customop GPU benchmarks\n\n{json.dumps(env)}\n" + markdown(rows, impl_names, copy_gbps)
                    + "\n" + targets(rows) + ("\n" + sweep_report(rows) if any("sweep" in r for r in rows) else "") + "\n")
        if plot(rows, impl_names, os.path.join(out_dir, "bandwidth.png")):
            print(f"[bench {time.strftime('%H:%M:%S')}] wrote {out_dir}/results.json, results.md, bandwidth.png",
                  file=sys.stderr, flush=True)
