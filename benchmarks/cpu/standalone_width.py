"""The standalone route's width-dynamic artifacts against per-width ones (issue 18).

    flock /tmp/customop-bench.lock .venv/bin/python -m benchmarks.cpu.standalone_width --threads 2

For each op, dtype and shape: ``standalone.run`` through a per-width family (``dynamic_hidden=False``:
the artifact traced at this very shape's width, as the route shipped for the norms) and through
a width-dynamic family whose artifacts were built the way ``customop.warmup`` builds them (two or
more rows traced at 16 x 256, one row at 1 x 256 or, where one row reaches the op's threshold, at
the narrowest such row), the two timed in turns within each round; best of the rounds, us per
call. Prints a markdown table; "dynamic / per-width" above 1 means the width-dynamic artifact is
slower.
"""

from __future__ import annotations

import argparse
import time

import torch

from customop.backends.cpu import standalone
from customop.ops import activation as act
from customop.ops.quantization import input_quant_fp8 as qf
from customop.ops.quantization.group_shape import GroupShape
from customop.warmup import warmup_width

_QUANT = dict(num_token_padding=None, column_major_scales=False, tma_aligned_scales=False, use_ue8m0=False,
              fp8_dtype=torch.float8_e4m3fn, fp8_max=448.0, min_scale=1.0 / (448.0 * 512.0))

#: label -> (function, its non-tensor arguments, its keyword arguments, gated, the op's tiers)
OPS = {
    "silu_and_mul": (act.silu_and_mul, (), {}, True, act.SiluAndMul.cpu_tiers),
    "mul_and_silu": (act.mul_and_silu, (), {}, True, act.MulAndSilu.cpu_tiers),
    "gelu_and_mul(tanh)": (act.gelu_and_mul, ("tanh",), {}, True, act.GeluAndMul.cpu_tiers),
    "fatrelu_and_mul": (act.fatrelu_and_mul, (0.1,), {}, True, act.FatreluAndMul.cpu_tiers),
    "swiglustep_and_mul": (act.swiglustep_and_mul, (7.0,), {}, True, act.SwigluStepAndMul.cpu_tiers),
    "silu_and_mul_with_clamp": (act.silu_and_mul_with_clamp, (7.0, 1.702, 1.0), {}, True,
                                act.SiluAndMulWithClamp.cpu_tiers),
    "situ_and_mul": (act.situ_and_mul, (4.0, 25.0), {}, True, act.SituAndMul.cpu_tiers),
    "gelu_and_mul_sparse(0.95)": (act.gelu_and_mul_sparse, (1.6448535919189453, "none"), {}, True,
                                  act.GeluAndMulSparse.cpu_tiers),
    "gelu_new": (act.gelu_new, (), {}, False, act.NewGELU.cpu_tiers),
    "xielu": (act.xielu, "xielu", {}, False, act.XIELU.cpu_tiers),
    "quant per-token": (qf.quant_fp8, (None, None), dict(_QUANT, group_shape=GroupShape(1, -1)), False,
                        qf.QUANT_CPU_TIERS),
    "quant per-group-128": (qf.quant_fp8, (None, None), dict(_QUANT, group_shape=GroupShape(1, 128)), False,
                            qf.QUANT_CPU_TIERS),
}
SHAPES = [(1, 4096), (16, 4096), (64, 4096), (256, 14336)]  # tokens x d (gated ops read 2d)


def _args(label, spec):
    if spec[1] == "xielu":
        op = act.XIELU()
        return tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in op.math_args())
    return spec[1]


def _time(fam, x, args, kwargs, calls):
    t0 = time.perf_counter()
    for _ in range(calls):
        standalone.run(fam, x, args, kwargs)
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--dtypes", default="bfloat16,float32")
    ns = parser.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    print(f"torch {torch.__version__}  threads {torch.get_num_threads()}  best of {ns.rounds} rounds")
    print("| op | dtype | input | per-width us | width-dynamic us | dynamic / per-width |")
    print("|---|---|---|---:|---:|---:|")
    with torch.no_grad():
        for label in ns.ops.split(","):
            spec = OPS[label]
            fn, _, kwargs, gated, tiers = spec
            args = _args(label, spec)
            for dtype in (getattr(torch, d) for d in ns.dtypes.split(",")):
                # fresh families for this op and dtype: the forms differ per op, not per dtype,
                # so the artifacts are dropped between dtypes
                standalone.reset()
                per_width = standalone.Family(fn, {}, dynamic_hidden=False)
                dynamic = standalone.Family(fn, {}, dynamic_hidden=True)
                for rows, width in ((16, 256), (1, warmup_width(tiers, 1, dtype, 256))):  # as customop.warmup
                    standalone.run(dynamic, torch.randn(rows, width).to(dtype), args, kwargs)
                for tokens, d in SHAPES:
                    x = torch.randn(tokens, 2 * d if gated else d).to(dtype)
                    if standalone.run(per_width, x, args, kwargs) is None or \
                            standalone.run(dynamic, x, args, kwargs) is None:
                        print(f"| {label} | {dtype} | {tokens}x{x.shape[-1]} | - | - | (not taken) |")
                        continue
                    calls = max(3, min(2000, int(2e5 // max(x.numel() // 100, 1))))
                    best = [float("inf"), float("inf")]
                    for _ in range(ns.rounds):
                        for i, fam in enumerate((per_width, dynamic)):
                            best[i] = min(best[i], _time(fam, x, args, kwargs, calls))
                    print(f"| {label} | {str(dtype).removeprefix('torch.')} | {tokens}x{x.shape[-1]} | "
                          f"{best[0]:.1f} | {best[1]:.1f} | {best[1] / best[0]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
