"""The state-space kernels' launch sweeps (GPU): ``sweep_decode`` and ``sweep_prefill``, run by
``python -m customop.benchmarks.specs.mamba --sweep-decode`` / ``--sweep-prefill``. A helper
module of ``mamba`` (the runner's spec collection skips names with a leading underscore).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from customop.benchmarks.specs._mamba_forms import ssd_flops
from customop.benchmarks.specs._mamba_inputs import (CHUNK, MODELS, _decode_args, _decode_inputs, _prefill_inputs,
                                                     _shape)
from customop.math import mamba as spec

def _checked_times(label: str, candidates, once, timed, tol: float):
    """Each candidate config's outputs (``once(cfg)``: a tuple of tensors) against the first
    candidate's (the default: the largest normwise relative error, "ok" below ``tol``) and its
    time (``timed(cfg)``, us). Yields (cfg, us, check); a config that fails to compile or launch
    is printed with ``label``, not fatal."""
    reference = None
    for cfg in candidates:
        try:
            got = once(cfg)
            reference = reference or got
            err = max(float((g - r).norm() / r.norm()) for g, r in zip(got, reference))
            check = "ok" if err < tol else f"WRONG {err:.1e}"
            us = timed(cfg)
        except Exception as e:  # reported, not fatal
            print(f"{label}  {cfg.label()} {type(e).__name__}: {str(e)[:80]}", flush=True)
            continue
        yield cfg, us, check


def sweep_decode(batches=(1, 16, 64, 256), dtype: torch.dtype = torch.bfloat16, device: str = "cuda") -> None:
    """Times every ``mamba_scan.decode_candidates()`` config of the decode kernel (the launcher
    itself under ``override_decode_config``, the runner's CUDA-graph timer) on both models at each
    batch, after checking its output and new state against the default config's on the same
    inputs. Prints one row per (model, batch, config): us, the state's GB/s (read + written), that
    as % of a same-size fp32 copy timed the same way and of a 1 GiB copy, the speedup over the
    default, the check; then the best config per row. About a minute on an H200."""
    from customop.backends.triton import mamba_scan
    from customop.benchmarks.runner_timing import time_graph

    dev = torch.device(device)
    src = torch.empty(1 << 28, device=dev)
    dst = torch.empty_like(src)
    big_copy_gbps = 2 * src.numel() * 4 / (time_graph([lambda: dst.copy_(src)]) * 1e-6) / 1e9
    del src, dst
    print(f"copy 1 GiB: {big_copy_gbps:.0f} GB/s", flush=True)
    print(f"{'model':12s} {'batch':>5s}  {'config':20s} {'us':>8s} {'GB/s':>6s} {'%copy':>6s} {'%1GiB':>6s} "
          f"{'vs dflt':>7s}  check", flush=True)
    best = []
    for model in MODELS:
        for b in batches:
            shape = _shape(b, model)
            i = _decode_inputs(shape, dtype, dev)
            args = _decode_args(i)
            numel = b * shape.extra["heads"] * shape.extra["head_dim"] * shape.extra["state"]
            nbytes = 2 * numel * 4
            csrc, cdst = torch.randn(numel, device=dev), torch.empty(numel, device=dev)
            copy_gbps = nbytes / (time_graph([lambda: cdst.copy_(csrc)]) * 1e-6) / 1e9
            del csrc, cdst
            state0 = args[0].clone()

            def once(cfg):
                state = state0.clone()
                with mamba_scan.override_decode_config(cfg):
                    out = mamba_scan.selective_state_update(state, *args[1:])
                return out.float(), state

            def timed(cfg):
                with mamba_scan.override_decode_config(cfg):
                    return time_graph([lambda: mamba_scan.selective_state_update(*args)])

            rows, base_us = [], None  # the first candidate is the default
            for cfg, us, check in _checked_times(f"{model[0]:12s} {b:5d}", mamba_scan.decode_candidates(), once, timed,
                                                 5e-3):
                base_us = base_us or us
                gbps = nbytes / (us * 1e-6) / 1e9
                print(f"{model[0]:12s} {b:5d}  {cfg.label():20s} {us:8.1f} {gbps:6.0f} {100 * gbps / copy_gbps:5.0f}% "
                      f"{100 * gbps / big_copy_gbps:5.0f}% {base_us / us:6.2f}x  {check}", flush=True)
                if check == "ok":
                    rows.append((us, cfg, gbps))
            if rows:
                us, cfg, gbps = min(rows, key=lambda r: r[0])
                best.append(f"{model[0]:12s} {b:5d}  best {cfg.label():20s} {us:8.1f} us  "
                            f"{100 * gbps / copy_gbps:5.0f}% same-size copy  "
                            f"{100 * gbps / big_copy_gbps:5.0f}% 1 GiB copy  {cfg!r}")
    print("\n".join(best), flush=True)


def sweep_prefill(tokens=(4096,), requests=(1,), dtype: torch.dtype = torch.bfloat16,
                  device: str = "cuda", out_json: str | None = None) -> None:
    """Times every ``mamba_ssd.ssd_candidates()`` config of the chunked scan (the launcher under
    ``override_ssd_config``, CUDA-graph timer) on both models, after checking its output and
    final states against the default's; prints us, TFLOP/s over ``ssd_flops``, the speedup over
    the default, then the best config per shape, the best over all shapes (geometric mean of the
    time relative to each shape's best; ``out_json`` gets its fields) and the default's time per
    kernel (profiler)."""
    from customop.backends.triton import mamba_ssd
    from customop.benchmarks.runner_timing import time_graph

    dev = torch.device(device)
    best, times = [], {}
    for model in MODELS:
        for T in tokens:
            for S in requests:
                shape = _shape(T, model, S)
                i = _prefill_inputs(shape, dtype, dev)
                state0 = i["state"].clone()
                flops = ssd_flops(shape)

                def once(cfg, i=i, state0=state0):
                    state = state0.clone()
                    with mamba_ssd.override_ssd_config(cfg):
                        out = mamba_ssd.ssd_chunk_scan(i["x"], i["dt"], i["A"], i["B"], i["C"], i["D"], i["dt_bias"],
                                                       state, i["qsl"], i["slots"], i["init"], CHUNK, True,
                                                       spec.NULL_BLOCK_ID)
                    return out.float(), state

                def timed(cfg, i=i, state0=state0):
                    args = (i["x"], i["dt"], i["A"], i["B"], i["C"], i["D"], i["dt_bias"], state0.clone(), i["qsl"],
                            i["slots"], i["init"], CHUNK, True, spec.NULL_BLOCK_ID)
                    with mamba_ssd.override_ssd_config(cfg):
                        return time_graph([lambda: mamba_ssd.ssd_chunk_scan(*args)])

                rows, base_us = [], None  # the first candidate is the default
                for cfg, us, check in _checked_times(f"{shape.label:20s}", mamba_ssd.ssd_candidates(), once, timed,
                                                     1e-2):
                    base_us = base_us or us
                    print(f"{shape.label:20s} {cfg.label():52s} {us:8.1f} us {flops / us / 1e6:6.1f} TFLOP/s "
                          f"{base_us / us:5.2f}x  {check}", flush=True)
                    if check == "ok":
                        rows.append((us, cfg))
                        times.setdefault(cfg, []).append(us)
                if rows:
                    us, cfg = min(rows, key=lambda r: r[0])
                    best.append(f"{shape.label:20s} best {us:8.1f} us ({base_us / us:.2f}x the default)  {cfg!r}")
                if T == tokens[0] and S == requests[0]:
                    _profile_kernels(once, mamba_ssd.SSDConfig())
    print("\n".join(best), flush=True)
    n_shapes = max(len(v) for v in times.values())
    floor = [min(v[k] for v in times.values() if len(v) == n_shapes) for k in range(n_shapes)]
    score = {cfg: math.prod(us / f for us, f in zip(v, floor)) ** (1 / n_shapes)
             for cfg, v in times.items() if len(v) == n_shapes}
    overall = min(score, key=score.get)
    print(f"best over all shapes ({score[overall]:.3f}x the per-shape bests): {overall!r}", flush=True)
    if out_json:
        import json

        with open(out_json, "w") as f:
            json.dump(dataclasses.asdict(overall), f)


def _profile_kernels(once, cfg) -> None:
    """The CUDA time of each kernel of one call under ``cfg`` (torch.profiler, 5 calls)."""
    from torch.profiler import ProfilerActivity, profile

    once(cfg)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            once(cfg)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12), flush=True)
