"""Benchmark specs of the state-space family (issue 14's plan: bf16 activations, fp32 state):

- ``selective_state_update``: Mamba-2's decode step at batch 1 / 16 / 64 / 256, on Mamba-2-2.7B's
  SSM (80 heads x 64, state 128, 1 group) and a Nemotron-H-like one (128 heads x 64, 8 groups).
  The floor is the state read and written once per request (``bytes_moved``).
  ``python -m customop.benchmarks.specs.mamba --sweep-decode`` (GPU) times the decode kernel's
  candidate launch configs (``mamba_scan.decode_candidates``) and prints a table.
- ``ssd_chunk_scan``: Mamba-2 prefill of 1k / 4k / 16k tokens in 1 and 8 requests (chunk 256),
  fresh states; timed against the chunked form in plain torch (the minimal SSD of equal-length
  requests, eager and compiled) and ``compile_chunks``: the same chunked math one chunk at a time,
  ``torch.compile`` of one chunk's step (a small graph, compiled once per model and request count)
  looped over the chunks in Python. Both write their running sums as triangular products
  (``running_sum``: Inductor of torch 2.11 fails on ``torch.cumsum`` there).
  ``--sweep-prefill`` (GPU) times the scan's candidate launch configs
  (``mamba_ssd.ssd_candidates``) and, for the default, each of its kernels.
  ``--tflops RESULTS_JSON`` prints each implementation's rate over the scan's matmul FLOPs
  (``ssd_flops``), to set against the dense bf16 matmul rate.
- ``causal_conv1d_fn`` / ``causal_conv1d_update``: the conv over Mamba-2-2.7B's ``xBC``
  (5376 channels, K = 4) in prefill and decode.
- ``mixer2_gated_rms_norm``: tokens x 5120 (1 group) and x 8192 (8 groups).

The eager and compiled baselines are the same math written without the batch's host-side layout
(equal-length requests, every slot real), so that ``torch.compile(fullgraph=True)`` and CUDA
graphs take them; the runner checks the kernel's outputs against them first.
"""

from __future__ import annotations

from typing import Any

import torch

from customop.benchmarks.specs import OpSpec, Shape, compiled
# the module's names before its split into helpers (tests and docs use them from here)
from customop.benchmarks.specs._mamba_forms import (_ssd_chunk_step, conv_prefill, conv_update,  # noqa: F401
                                                    decode_update, running_sum, ssd_chunk_loop, ssd_flops, ssd_minimal)
from customop.benchmarks.specs._mamba_inputs import (CHUNK, MODELS, _decode_args, _decode_inputs,  # noqa: F401
                                                     _ints, _prefill_inputs, _shape)
from customop.benchmarks.specs._mamba_sweep import (_checked_times, _profile_kernels, sweep_decode,  # noqa: F401
                                                    sweep_prefill)
from customop.math import mamba as spec


# ---- decode: the SSM state update ----------------------------------------------------------------


def _decode_bytes(shape: Shape, dtype: torch.dtype) -> int:
    e = shape.extra
    state = shape.tokens * e["heads"] * e["head_dim"] * e["state"] * 4
    return 2 * state + shape.tokens * (2 * shape.hidden + e["heads"] + 2 * e["groups"] * e["state"]) * dtype.itemsize


def _decode_impls():
    def customop(i):
        args = _decode_args(i)
        return lambda: torch.ops.customop.selective_state_update(*args)

    def eager(i):
        return lambda: decode_update(*(i[k] for k in ("state", "x", "dt", "A", "B", "C", "D", "dt_bias", "slots")))

    def compile_(i):
        f = compiled(decode_update)
        return lambda: f(*(i[k] for k in ("state", "x", "dt", "A", "B", "C", "D", "dt_bias", "slots")))

    return {"customop": customop, "eager": eager, "compile": compile_}


# ---- prefill: the chunked SSD scan ----------------------------------------------------------------


def tflops_table(rows: list[dict]) -> str:
    """TFLOP/s (``ssd_flops``) per implementation for the ``ssd_chunk_scan`` rows of a runner's
    results.json."""
    by_label = {s.label: s for spec_ in SPECS if spec_.name == "ssd_chunk_scan" for s in spec_.shapes}
    rows = [r for r in rows if r["op"] == "ssd_chunk_scan" and r["shape"].removesuffix("[dry]") in by_label]
    names = sorted({n for r in rows for n in r["impls"]})
    lines = ["| shape | GFLOP | " + " | ".join(names) + " |", "|---" * (len(names) + 2) + "|"]
    for r in rows:
        f = ssd_flops(by_label[r["shape"].removesuffix("[dry]")])
        cells = [f"{f / (r['impls'][n]['us'] * 1e6):.1f}" if "us" in r["impls"].get(n, {}) else "-" for n in names]
        lines.append(f"| {r['shape']} | {f / 1e9:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _prefill_bytes(shape: Shape, dtype: torch.dtype) -> int:
    e = shape.extra
    per_token = 2 * shape.hidden + e["heads"] + 2 * e["groups"] * e["state"]
    return shape.tokens * per_token * dtype.itemsize + e["requests"] * shape.hidden * e["state"] * 4


def _prefill_impls():
    def customop(i):
        args = (i["x"], i["dt"], i["A"], i["B"], i["C"], i["D"], i["dt_bias"], i["state"], i["qsl"], i["slots"],
                i["init"], CHUNK, True, spec.NULL_BLOCK_ID)
        return lambda: torch.ops.customop.ssd_chunk_scan(*args)

    def baseline(fn):
        def factory(i):
            return lambda: fn(i["x"], i["dt"], i["A"], i["B"], i["C"], i["D"], i["dt_bias"], i["slots"].shape[0])

        return factory

    def compile_(i):
        return baseline(compiled(ssd_minimal))(i)

    def compile_chunks(i):  # one chunk's graph compiled (seconds), looped over the chunks in Python
        step = compiled(_ssd_chunk_step)
        return lambda: ssd_chunk_loop(i["x"], i["dt"], i["A"], i["B"], i["C"], i["D"], i["dt_bias"],
                                      i["slots"].shape[0], step=step)

    return {"customop": customop, "eager": baseline(ssd_minimal), "compile": compile_,
            "compile_chunks": compile_chunks}


# ---- the conv and the norm --------------------------------------------------------------------------

CONV_DIM, K = 5376, 4  # Mamba-2-2.7B's xBC: 5120 + 2 x 128


def _conv_inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    T, S = shape.tokens, min(shape.extra["requests"], shape.tokens)
    return {"x": torch.randn(T, CONV_DIM, device=device).to(dtype), "w": torch.randn(CONV_DIM, K, device=device)
            .to(dtype), "b": torch.randn(CONV_DIM, device=device).to(dtype),
            "state": torch.randn(T + 1, K - 1, CONV_DIM, device=device).to(dtype),
            "qsl": torch.arange(0, T + 1, T // S, dtype=torch.int32, device=device)[:S + 1].clamp(max=T),
            "slots": torch.arange(1, T + 1, dtype=torch.int32, device=device)}


def _conv_specs():
    def prefill_custom(i):
        S = i["qsl"].shape[0] - 1
        init = torch.zeros(S, dtype=torch.bool, device=i["x"].device)
        args = (i["x"], i["w"], i["b"], i["state"].transpose(1, 2), i["qsl"], i["slots"][:S], init, True, 0)
        return lambda: torch.ops.customop.causal_conv1d_fn(*args)

    def prefill_base(fn):
        return lambda i: (lambda: fn(i["x"], i["w"], i["b"], i["qsl"].shape[0] - 1))

    def update_custom(i):
        args = (i["x"], i["state"].transpose(1, 2), i["w"], i["b"], i["slots"], True, 0)
        return lambda: torch.ops.customop.causal_conv1d_update(*args)

    def update_base(fn):
        return lambda i: (lambda: fn(i["x"], i["state"], i["w"], i["b"], i["slots"]))

    prefill = tuple(Shape(t, CONV_DIM, f"{t}/{s}", {"requests": s}, quick=(t == 4096 and s == 1))
                    for t in (1024, 4096, 16384) for s in (1, 8))
    decode = tuple(Shape(b, CONV_DIM, f"decode {b}", {"requests": b}, quick=b in (1, 256)) for b in (1, 16, 64, 256))
    return [
        OpSpec("causal_conv1d_fn", "mamba", prefill, _conv_inputs,
               lambda s, d: 2 * s.tokens * CONV_DIM * d.itemsize,
               {"customop": prefill_custom, "eager": prefill_base(conv_prefill),
                "compile": lambda i: prefill_base(compiled(conv_prefill))(i)}, mutates=("state",)),
        OpSpec("causal_conv1d_update", "mamba", decode, _conv_inputs,
               lambda s, d: 4 * s.tokens * CONV_DIM * d.itemsize,
               {"customop": update_custom, "eager": update_base(conv_update),
                "compile": lambda i: update_base(compiled(conv_update))(i)}, mutates=("state",)),
    ]


def _norm_inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    return {"x": torch.randn(shape.tokens, shape.hidden, device=device).to(dtype),
            "gate": torch.randn(shape.tokens, shape.hidden, device=device).to(dtype),
            "w": (1 + 0.1 * torch.randn(shape.hidden, device=device)).to(dtype)}


def _norm_spec():
    def args(i, shape_groups):
        return i["x"], i["gate"], i["w"], 1e-5, i["x"].shape[1] // shape_groups

    def groups(i):
        return 8 if i["x"].shape[1] == 8192 else 1

    shapes = tuple(Shape(t, h, quick=(t in (1, 4096) and h == 8192)) for h in (5120, 8192)
                   for t in (1, 16, 256, 4096, 32768))
    return OpSpec("mixer2_gated_rms_norm", "mamba", shapes, _norm_inputs,
                  lambda s, d: 3 * s.tokens * s.hidden * d.itemsize,
                  {"customop": lambda i: (lambda a=args(i, groups(i)): torch.ops.customop.mixer2_gated_rms_norm(*a)),
                   "eager": lambda i: (lambda a=args(i, groups(i)): spec.mixer2_gated_rms_norm(*a)),
                   "compile": lambda i: (lambda f=compiled(spec.mixer2_gated_rms_norm), a=args(i, groups(i)): f(*a))})


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="state-space benchmark helpers (the timing itself: customop bench)")
    parser.add_argument("--sweep-decode", action="store_true", help="time the decode kernel's candidate configs")
    parser.add_argument("--batches", default="1,16,64,256", help="decode batches of the sweep")
    parser.add_argument("--sweep-prefill", action="store_true", help="time the chunked scan's candidate configs")
    parser.add_argument("--sweep-out", default=None, help="--sweep-prefill: JSON file for the best config's fields")
    parser.add_argument("--tflops", metavar="RESULTS_JSON",
                        help="print the chunked scan's TFLOP/s from a runner's results")
    args = parser.parse_args(argv)
    if args.tflops:
        import json

        with open(args.tflops) as f:
            data = json.load(f)
        print(tflops_table(data["results"] if isinstance(data, dict) else data))
    if args.sweep_decode:
        from customop.backend_loader import load_backend

        load_backend("cuda")
        sweep_decode(tuple(int(b) for b in args.batches.split(",")))
    if args.sweep_prefill:
        from customop.backend_loader import load_backend

        load_backend("cuda")
        sweep_prefill(out_json=args.sweep_out)
    return 0


SPECS = [
    OpSpec("selective_state_update", "mamba", tuple(_shape(b, m, quick=b in (1, 256)) for m in MODELS
                                                   for b in (1, 16, 64, 256)),
           _decode_inputs, _decode_bytes, _decode_impls(), mutates=("state",)),
    OpSpec("ssd_chunk_scan", "mamba", tuple(_shape(t, m, r, quick=(t == 4096 and r == 1)) for m in MODELS
                                            for t in (1024, 4096, 16384) for r in (1, 8)),
           _prefill_inputs, _prefill_bytes, _prefill_impls(), mutates=("state",)),
    *_conv_specs(),
    _norm_spec(),
]


if __name__ == "__main__":
    import sys

    sys.exit(main())
