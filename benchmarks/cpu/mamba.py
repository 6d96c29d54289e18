"""CPU timings of the state-space family, the measurements behind its CPU choices.

    .venv/bin/python -m benchmarks.cpu.mamba [--part norm,ssd,decode,mixer] [--dtypes bf16,fp32]
        [--min-time 0.4] [--threads N] [--clock wall|cpu]

Prints markdown tables of microseconds per call, ``p5 / median`` (the method of
benchmarks/cpu/layernorm.py, whose timer this uses):

- ``norm``: ``mixer2_gated_rms_norm`` eager vs ``torch.compile`` (with eager's casts kept) vs
  ``forward_cpu``: where compiling starts to pay (``NORM_CPU_TIERS``);
- ``ssd``: Mamba-2 prefill of one request per length: the spec's token loop, the CPU steps'
  blocked recurrence and the chunked form: where the chunked form wins (``SSD_CHUNKED_FROM``);
- ``decode``: one decode step of Mamba-2's SSM for a batch: the spec (a loop over requests) vs
  the CPU steps' batched gather / step / scatter;
- ``mixer``: a whole small MambaMixer2 layer, ``forward_native`` vs ``forward_cpu``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time

import torch

from customop.backends.cpu import mamba as cpu
from customop.backends.cpu.compile_cache import EMULATE_CASTS
from customop.benchmarks.cpu.layernorm import time_us
from customop.config import Config, use_config
from customop.math import mamba as spec
from customop.ops.mamba import MambaMetadata, MambaMixer2, Mixer2RMSNormGated

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
H, P, N, G = 8, 32, 32, 1  # a small Mamba-2 head set: 256 channels, state 8 x 32 x 32


def _row(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def _fmt(t) -> str:
    return f"{t[0]:.1f} / {t[1]:.1f}"


def bench_norm(dtypes, min_time, clock):
    print("\n| mixer2_gated_rms_norm | dtype | rows x hidden/groups | eager (us) | compiled (us) | forward_cpu (us) |")
    print("|---|---|---|---:|---:|---:|")
    for dtype in dtypes:
        for rows, hidden, groups in ((1, 4096, 8), (2, 4096, 8), (4, 4096, 8), (8, 4096, 8), (16, 4096, 8),
                                     (64, 4096, 8), (256, 4096, 8)):
            torch._dynamo.reset()
            with use_config(Config(custom_ops=["all"])):
                op = Mixer2RMSNormGated(hidden, groups, params_dtype=dtype)
            x, g = torch.randn(rows, hidden, dtype=dtype), torch.randn(rows, hidden, dtype=dtype)
            args = (x, g, op.weight, 1e-5, hidden // groups)
            comp = torch.compile(spec.mixer2_gated_rms_norm, options=EMULATE_CASTS)
            for r in (rows + 1, rows + 2):
                comp(torch.randn(r, hidden, dtype=dtype), torch.randn(r, hidden, dtype=dtype), *args[2:])
            res = time_us([lambda: spec.mixer2_gated_rms_norm(*args), lambda: comp(*args),
                           lambda: op.forward_cpu(x, g)], min_time, clock)
            print(_row([" ", str(dtype)[6:], f"{rows}x{hidden}/{groups}", *map(_fmt, res)]), flush=True)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="norm,ssd,decode,mixer")
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
    parts = {"norm": bench_norm, "ssd": bench_ssd, "decode": bench_decode, "mixer": bench_mixer}
    with torch.no_grad():
        for part in args.part.split(","):
            parts[part](dtypes, args.min_time, clock)


if __name__ == "__main__":
    main()
