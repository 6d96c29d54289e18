"""Benchmark specs of the fp8 quant kernels at tokens {1, 16, 256, 4096, 32768} x hidden {4096,
8192}, e4m3fn: static per-tensor, dynamic per-tensor, dynamic per-token, per-token-group (128,
column-major ue8m0 scales: the DeepGEMM layout) and the fused rms_norm + per-token quant.

Bytes: x read once, q written once (1 byte per element), scales written, the weight of the fused
op read once. Dynamic per-tensor must see the whole tensor before writing anything, so its kernel
reads x twice (the second pass partly from L2): its GB/s are counted on the one-read minimum.
Peers: ``torch.compile`` of the native spec (Inductor fuses rms_norm into the quant too). Liger
has no fp8 quant.

Outputs are compared by the runner's normwise error after ``.float()``: torch's CUDA division
by a Python float multiplies by the reciprocal, so the eager reference's scales can differ from
the kernel's IEEE ``amax / fp8_max`` in the last bit (tests/gpu/test_quant_cuda.py checks exact
bits against an explicit true-division reference).
"""

from __future__ import annotations

from typing import Any

import torch

from customop.benchmarks.specs import HIDDEN, OpSpec, Shape, token_shapes
from customop.benchmarks.specs.activation import impls
from customop.math import quant as qm

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
GROUP = 128
EPS = 1e-6
SHAPES = token_shapes(hidden=HIDDEN)


def _inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    return {"x": torch.randn(shape.tokens, shape.hidden, device=device).to(dtype),
            "weight": (1 + 0.1 * torch.randn(shape.hidden, device=device)).to(dtype),
            "scale": torch.tensor([0.01], device=device)}


def _bytes(extra_per_token: int = 0, weight: bool = False, per_group: bool = False):
    def count(shape: Shape, dtype: torch.dtype) -> int:
        t, h = shape.tokens, shape.hidden
        n = t * h * (dtype.itemsize + 1) + t * extra_per_token
        if per_group:
            n += t * (h // GROUP) * 4
        return n + (h * dtype.itemsize if weight else 0)

    return count


SPECS = [
    OpSpec(name="static_scaled_fp8_quant", family="quant", shapes=SHAPES, make_inputs=_inputs,
           bytes_moved=_bytes(),
           impls=impls("static_scaled_fp8_quant", qm.scaled_fp8_quant, lambda i: (i["x"], i["scale"], FP8, FP8_MAX))),
    OpSpec(name="dynamic_scaled_fp8_quant", family="quant", shapes=SHAPES, make_inputs=_inputs,
           bytes_moved=_bytes(),
           impls=impls("dynamic_scaled_fp8_quant", qm.dynamic_scaled_fp8_quant,
                       lambda i: (i["x"], FP8, FP8_MAX, MIN_SCALE))),
    OpSpec(name="dynamic_per_token_scaled_fp8_quant", family="quant", shapes=SHAPES, make_inputs=_inputs,
           bytes_moved=_bytes(extra_per_token=4),
           impls=impls("dynamic_per_token_scaled_fp8_quant", qm.dynamic_per_token_scaled_fp8_quant,
                       lambda i: (i["x"], None, FP8, FP8_MAX, MIN_SCALE))),
    OpSpec(name="per_token_group_fp8_quant", family="quant", shapes=SHAPES, make_inputs=_inputs,
           bytes_moved=_bytes(per_group=True),
           impls=impls("per_token_group_fp8_quant", qm.per_token_group_fp8_quant,
                       lambda i: (i["x"], GROUP, True, True, FP8, FP8_MAX, MIN_SCALE))),
    OpSpec(name="rms_norm_dynamic_per_token_fp8_quant", family="quant", shapes=SHAPES, make_inputs=_inputs,
           bytes_moved=_bytes(extra_per_token=4, weight=True),
           impls=impls("rms_norm_dynamic_per_token_fp8_quant", qm.rms_norm_dynamic_per_token_fp8_quant,
                       lambda i: (i["x"], i["weight"], EPS, None, FP8, FP8_MAX, MIN_SCALE)),
           # An implementation whose normalised value differs by one bf16 ulp (another summation
           # order; Inductor also skips the intermediate roundings) moves a few percent of the fp8
           # values by one step (6-12%): ~1e-2 normwise, measured 1.5e-2 for Inductor on the CPU.
           tolerance=5e-2),
]
