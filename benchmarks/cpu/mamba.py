"""CPU timings of the state-space family, the measurements behind its CPU choices.

    .venv/bin/python -m benchmarks.cpu.mamba [--part norm,ssd,decode,mixer,layers] [--dtypes bf16,fp32]
        [--layers mamba_mixer,mamba_mixer2,short_conv] [--min-time 0.4] [--threads N] [--clock wall|cpu]

Prints markdown tables of microseconds per call, ``p5 / median`` (the method of
benchmarks/cpu/layernorm.py, whose timer this uses):

- ``norm``: ``mixer2_gated_rms_norm`` eager vs ``torch.compile`` (with eager's casts kept by
  ``emulate_precision_casts``, rows dynamic: what the tier compiles for fp16/fp32; for bf16 x and
  weight it compiles ``backends/cpu/exact_rounding.py``'s form, bitwise the same, which
  ``forward_cpu``'s column includes) vs ``forward_cpu``: where compiling starts to pay
  (``NORM_CPU_TIERS``); and ``torch.compile(op.forward_native)`` (static shapes, Inductor's
  defaults), every column checked against a float64 run of the spec first;
- ``ssd``: Mamba-2 prefill of one request per length: the spec's token loop, the CPU steps'
  blocked recurrence and the chunked form: where the chunked form wins (``SSD_CHUNKED_FROM``);
- ``decode``: one decode step of Mamba-2's SSM for a batch: the spec (a loop over requests) vs
  the CPU steps' batched gather / step / scatter;
- ``mixer``: a whole small MambaMixer2 layer, ``forward_native`` vs ``forward_cpu``;
- ``layers``: ``MambaMixer``, ``MambaMixer2`` and ``ShortConv`` (small layers, decode 16 and
  prefill 2 x 128) against ``torch.compile(forward_native)`` (static shapes): with
  ``fullgraph=True`` Dynamo rejects the spec (it reads the batch layout on the host:
  ``iter_requests``' ``.tolist()``; the column says ``-`` and the table's footnote prints the
  exception's first line), so the compiled column is Inductor's default, graph breaks allowed
  (the pure pieces between the host reads compile: the projections, the gated norm, the
  per-token arithmetic). Every column is checked against a float64 run of the spec first.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import types
import os
import platform
import time

import torch

from customop.backends.cpu import mamba as cpu
from customop.backends.cpu.compile_cache import EMULATE_CASTS
from customop.benchmarks.cpu.timing import TOLERANCE, check_paths, time_us
from customop.config import Config, use_config
from customop.math import mamba as spec
from customop.ops.mamba import MambaMetadata, MambaMixer, MambaMixer2, Mixer2RMSNormGated, ShortConv

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
H, P, N, G = 8, 32, 32, 1  # a small Mamba-2 head set: 256 channels, state 8 x 32 x 32
#: normwise relative error against the float64 spec a path may have: the norm to rounding (fp32) or
#: four unit roundoffs (16-bit); a whole layer (a recurrence and three GEMMs, inputs rounded to the
#: cache dtype where the spec rounds them) four times that
NORM_TOLERANCE = TOLERANCE
LAYER_TOLERANCE = {d: 4 * t for d, t in NORM_TOLERANCE.items()}


def _checked(paths: dict, want: torch.Tensor, tolerance: float, what: str) -> str:
    return ", ".join(check_paths(paths, want, tolerance, what))


def _row(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def _fmt(t) -> str:
    return f"{t[0]:.1f} / {t[1]:.1f}"


def bench_norm(dtypes, min_time, clock):
    print("\n| mixer2_gated_rms_norm | dtype | rows x hidden/groups | eager (us) | compiled (us) | forward_cpu (us) | "
          "compile(forward_native) (us) | forward_cpu x compile | error vs float64 (eager, compiled, forward_cpu, "
          "compile) |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for dtype in dtypes:
        for rows, hidden, groups in ((1, 4096, 8), (2, 4096, 8), (4, 4096, 8), (8, 4096, 8), (16, 4096, 8),
                                     (64, 4096, 8), (256, 4096, 8)):
            torch._dynamo.reset()
            with use_config(Config(custom_ops=["all"])):
                op = Mixer2RMSNormGated(hidden, groups, params_dtype=dtype)
            op.weight.normal_(1.0, 0.2)
            x, g = torch.randn(rows, hidden, dtype=dtype), torch.randn(rows, hidden, dtype=dtype)
            args = (x, g, op.weight, op.variance_epsilon, hidden // groups)  # the op's own eps
            comp = torch.compile(spec.mixer2_gated_rms_norm, options=EMULATE_CASTS)
            for r in (rows + 1, rows + 2):
                comp(torch.randn(r, hidden, dtype=dtype), torch.randn(r, hidden, dtype=dtype), *args[2:])
            native = torch.compile(op.forward_native, dynamic=False)
            paths = {"eager": lambda: spec.mixer2_gated_rms_norm(*args), "compiled": lambda: comp(*args),
                     "forward_cpu": lambda: op.forward_cpu(x, g), "compile": lambda: native(x, g)}
            want = spec.mixer2_gated_rms_norm(x.double(), g.double(), op.weight.double(), *args[3:])
            errors = _checked(paths, want, NORM_TOLERANCE[dtype], f"norm {rows}x{hidden} {dtype}")
            res = time_us(list(paths.values()), min_time, clock)
            print(_row([" ", str(dtype)[6:], f"{rows}x{hidden}/{groups}", *map(_fmt, res),
                        f"{res[3][1] / res[2][1]:.2f}", errors]), flush=True)


def _ssd_inputs(T, dtype, n_requests=1):
    x, dt = torch.randn(T, H, P, dtype=dtype), torch.randn(T, H, dtype=dtype)
    A, D, bias = -torch.rand(H) - 0.5, torch.randn(H, dtype=dtype), torch.randn(H, dtype=dtype)
    B, C = torch.randn(T, G, N, dtype=dtype), torch.randn(T, G, N, dtype=dtype)
    states = torch.randn(n_requests + 1, H, P, N)
    lens = [T // n_requests] * n_requests
    meta = MambaMetadata.build((), lens, list(range(1, n_requests + 1)), [True] * n_requests)
    return (x, dt, A, B, C, D, bias, states, meta.query_start_loc_p, meta.state_indices_tensor_p,
            meta.has_initial_states_p)


def bench_ssd(dtypes, min_time, clock):
    print(f"\n| Mamba-2 prefill, 1 request, H={H} P={P} N={N} | dtype | tokens | spec recurrence (us) | "
          "CPU recurrence (us) | chunked, chunk 256 (us) | chunked, chunk 32 (us) |")
    print("|---|---|---|---:|---:|---:|---:|")
    for dtype in dtypes:
        for T in (1, 4, 8, 16, 32, 64, 128, 512, 2048):
            a = _ssd_inputs(T, dtype)
            head = spec.ssd_head_form(a[1], a[2], a[5], a[6], P, N)
            fns = [lambda: spec.ssd_recurrent(*a[:7], a[7].clone(), *a[8:]),
                   lambda: cpu.selective_scan_varlen(a[0], head[0], head[1], a[3], a[4], head[2], None, head[3],
                                                     a[7].clone(), *a[8:], True),
                   lambda: spec.ssd_chunk_scan(*a[:7], a[7].clone(), *a[8:], 256),
                   lambda: spec.ssd_chunk_scan(*a[:7], a[7].clone(), *a[8:], 32)]
            if T > 128:
                fns[0] = fns[1]  # the spec's token loop takes seconds here: not measured
            if T > 512:
                fns[2] = fns[3]  # nor the 256-token chunks (their L x L temporaries)
            res = time_us(fns, min_time, clock)
            cells = [_fmt(r) for r in res]
            cells[0], cells[2] = cells[0] if T <= 128 else "-", cells[2] if T <= 512 else "-"
            print(_row([" ", str(dtype)[6:], str(T), *cells]), flush=True)


def bench_decode(dtypes, min_time, clock):
    print(f"\n| Mamba-2 decode step, H={H} P={P} N={N} | dtype | batch | spec (us) | CPU batched (us) |")
    print("|---|---|---|---:|---:|")
    for dtype in dtypes:
        for batch in (1, 16, 64):
            x, dt = torch.randn(batch, H, P, dtype=dtype), torch.randn(batch, H, dtype=dtype)
            B, C = torch.randn(batch, G, N, dtype=dtype), torch.randn(batch, G, N, dtype=dtype)
            dt4, A4, D4, b4 = spec.ssd_head_form(dt, -torch.rand(H), torch.randn(H, dtype=dtype),
                                                 torch.randn(H, dtype=dtype), P, N)
            states, slots = torch.randn(batch + 1, H, P, N), torch.arange(1, batch + 1)
            args = (x, dt4, A4, B, C, D4, None, b4, slots, True)
            res = time_us([lambda: spec.selective_state_update(states, *args),
                           lambda: cpu.selective_state_update(states, *args)], min_time, clock)
            print(_row([" ", str(dtype)[6:], str(batch), *map(_fmt, res)]), flush=True)


def bench_mixer(dtypes, min_time, clock):
    print("\n| MambaMixer2 (hidden 256, 8 heads x 32, N 32) | dtype | batch | forward_native (us) | "
          "forward_cpu (us) |")
    print("|---|---|---|---:|---:|")
    for dtype in dtypes:
        with use_config(Config(custom_ops=["all"])):
            op = MambaMixer2(256, N, 4, H * P, True, False, 1, H, P, params_dtype=dtype)
        for label, decodes, lens in (("decode 16", 16, ()), ("prefill 2x128", 0, (128, 128))):
            meta = MambaMetadata.build(list(range(1, decodes + 1)), lens,
                                       list(range(decodes + 1, decodes + 1 + len(lens))), [False] * len(lens))
            slots = decodes + len(lens) + 1
            (cw, cd), ssm_shape = op.get_state_shape()[0], op.get_state_shape()[1]
            h = torch.randn(meta.num_actual_tokens, 256, dtype=dtype)
            conv, ssm = torch.randn(slots, cw, cd, dtype=dtype), torch.randn(slots, *ssm_shape)
            res = time_us([lambda: op.forward_native(h, conv.clone(), ssm.clone(), meta),
                           lambda: op.forward_cpu(h, conv.clone(), ssm.clone(), meta)], min_time, clock)
            print(_row([" ", str(dtype)[6:], label, *map(_fmt, res)]), flush=True)


LAYERS = ("mamba_mixer", "mamba_mixer2", "short_conv")


def build_layer(name: str, dtype: torch.dtype):
    """A small layer of the family with random weights (hidden 256)."""
    with use_config(Config(custom_ops=["all"])):
        if name == "mamba_mixer":  # Mamba-1: 512 channels, state 16, dt rank 16, conv 4
            op = MambaMixer(256, 16, 4, 512, 16, True, False, False, params_dtype=dtype)
        elif name == "mamba_mixer2":  # 8 heads x 32, N 32, one group, conv 4
            op = MambaMixer2(256, N, 4, H * P, True, False, 1, H, P, params_dtype=dtype)
        else:  # LFM2's gated short conv, L_cache 3
            op = ShortConv(types.SimpleNamespace(conv_L_cache=3, conv_bias=True), 256, 0, params_dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    for param_name, p in op.named_parameters():
        if param_name == "A":
            p.copy_(-torch.rand(p.shape, generator=gen) - 0.5)
        elif param_name.endswith("weight") and p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5 + (1.0 if "norm" in param_name else 0.0))
    return op


def bench_layers(dtypes, min_time, clock, names=LAYERS):
    print("\n| layer (hidden 256) | dtype | batch | forward_native (us) | compile, fullgraph (us) | "
          "compile, graph breaks (us) | forward_cpu (us) | forward_cpu x native | forward_cpu x compile | "
          "error vs float64 (native, compile, forward_cpu) |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    failures = {}
    for name in names:
        for dtype in dtypes:
            op = build_layer(name, dtype)
            reference = copy.deepcopy(op).to(torch.float64)
            for label, decodes, lens in (("decode 16", 16, ()), ("prefill 2x128", 0, (128, 128))):
                meta = MambaMetadata.build(list(range(1, decodes + 1)), lens,
                                           list(range(decodes + 1, decodes + 1 + len(lens))), [False] * len(lens))
                slots = decodes + len(lens) + 1
                gen = torch.Generator().manual_seed(1)
                h = torch.randn(meta.num_actual_tokens, 256, generator=gen).to(dtype)
                shapes = op.get_state_shape()
                # the conv cache in the layer's dtype, the SSM state in fp32 (as a serving cache)
                caches = [torch.randn(slots, *shape, generator=gen).to(dtype if i == 0 else torch.float32)
                          for i, shape in enumerate(shapes)]
                want = reference.forward_native(h.double(), *(c.double() for c in caches), meta)
                torch._dynamo.reset()  # a fresh graph per case: static shapes, no recompile limit
                try:
                    torch.compile(op.forward_native, dynamic=False, fullgraph=True)(h, *(c.clone() for c in caches),
                                                                                    meta)
                    fullgraph = "compiled"
                except Exception as e:  # noqa: BLE001 - Dynamo's Unsupported and friends: report, go on
                    failures.setdefault(f"{type(e).__name__}: {str(e).splitlines()[0]}", []).append(
                        f"{name} {str(dtype)[6:]} {label}")
                    fullgraph = "-"
                torch._dynamo.reset()
                compiled = torch.compile(op.forward_native, dynamic=False)
                paths = {"native": lambda: op.forward_native(h, *(c.clone() for c in caches), meta),
                         "compile": lambda: compiled(h, *(c.clone() for c in caches), meta),
                         "forward_cpu": lambda: op.forward_cpu(h, *(c.clone() for c in caches), meta)}
                errors = _checked(paths, want, LAYER_TOLERANCE[dtype], f"{name} {label} {dtype}")
                res = dict(zip(paths, time_us(list(paths.values()), min_time, clock)))
                cells = [_fmt(res["native"]), fullgraph, _fmt(res["compile"]), _fmt(res["forward_cpu"])]
                print(_row([name, str(dtype)[6:], label, *cells, f"{res['native'][1] / res['forward_cpu'][1]:.2f}",
                            f"{res['compile'][1] / res['forward_cpu'][1]:.2f}", errors]), flush=True)
    for error, where in failures.items():
        print(f"\nfullgraph=True failed ({', '.join(where)}): {error}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="norm,ssd,decode,mixer,layers")
    parser.add_argument("--layers", default=",".join(LAYERS), help="the layers part's layers")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--min-time", type=float, default=0.4, help="seconds per measurement")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: all cores)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time_ns if args.clock == "cpu" else time.perf_counter_ns
    dtypes = [DTYPES[d] for d in args.dtypes.split(",")]
    print(f"date {datetime.date.today()}, torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} cores, "
          f"{torch.get_num_threads()} threads, {args.clock} clock, load average {os.getloadavg()[0]:.2f}")
    parts = {"norm": bench_norm, "ssd": bench_ssd, "decode": bench_decode, "mixer": bench_mixer,
             "layers": lambda *a: bench_layers(*a, names=args.layers.split(","))}
    with torch.no_grad():
        for part in args.part.split(","):
            parts[part](dtypes, args.min_time, clock)


if __name__ == "__main__":
    main()
