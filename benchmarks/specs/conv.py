"""Benchmark specs of the patch-embedding convolutions (issue 13): Qwen2-VL's 3x(2,14,14) -> 1280
over 4096 and 16384 patches (``conv3d``), CLIP's 14-pixel patches of 16 images of 336 pixels ->
1024 and SigLIP's 16-pixel patches of 8 images of 384 -> 1152 (``conv2d``).

Implementations (the runner times only those named in ``--impls``):
- ``customop``: ``torch.ops.customop.conv3d``/``conv2d`` (the linear form for a patch projection);
- ``eager``: the spec called directly (the same math without the library op);
- ``conv``: cuDNN's convolution (``F.conv3d``/``F.conv2d``), what vLLM's ``forward_cuda`` ran
  before PyTorch 2.9 disabled cuDNN's 3-D path;
- ``gemm``: a plain GEMM of the same shape on inputs already laid out as patch rows, the bound
  the issue's target (>= 0.95x) is set against;
- ``compile``: ``torch.compile`` of the spec.

    customop bench --ops 'conv*' --impls customop,eager,conv,gemm,compile --out DIR

The runner's GB/s columns count the input read, the weight read and the output written once
(``bytes_moved``); ``flops`` (``2 * patches * out * C * prod(kernel)``) gives TFLOP/s.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from customop.benchmarks.specs import OpSpec, Shape, compiled
from customop.math import conv as native

#: (op, label, input shape, out channels, kernel)
_CASES = (
    ("conv3d", "qwen2-vl 4096p", (4096, 3, 2, 14, 14), 1280, (2, 14, 14)),
    ("conv3d", "qwen2-vl 16384p", (16384, 3, 2, 14, 14), 1280, (2, 14, 14)),
    ("conv2d", "clip 16x336/14", (16, 3, 336, 336), 1024, (14, 14)),
    ("conv2d", "siglip 8x384/16", (8, 3, 384, 384), 1152, (16, 16)),
)


def _shapes(op: str) -> tuple[Shape, ...]:
    out = []
    for name, label, x_shape, channels, kernel in _CASES:
        if name == op:
            patches = x_shape[0] * math.prod(s // k for s, k in zip(x_shape[2:], kernel))
            out.append(Shape(patches, channels, label, {"x": x_shape, "kernel": kernel}, quick="16384" in label or "clip" in label))
    return tuple(out)


def flops(shape: Shape) -> float:
    x, kernel = shape.extra["x"], shape.extra["kernel"]
    return 2.0 * shape.tokens * shape.hidden * x[1] * math.prod(kernel)


def _inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    x_shape, kernel = shape.extra["x"], shape.extra["kernel"]
    if shape.tokens < math.prod(x_shape[:1]) * math.prod(s // k for s, k in zip(x_shape[2:], kernel)):  # a dry run
        x_shape = (1, *x_shape[1:])
    x = torch.randn(x_shape, device=device).to(dtype)
    fan_in = x_shape[1] * math.prod(kernel)
    weight = (torch.randn(shape.hidden, x_shape[1], *kernel, device=device) * fan_in ** -0.5).to(dtype)
    bias = torch.randn(shape.hidden, device=device).to(dtype)
    n, patches = len(kernel), x
    for dim, k in enumerate(kernel):
        patches = patches.unfold(2 + dim, k, k)
    # the patches already laid out as [patches, C * prod(kernel)] rows (the gemm column's input)
    rows = patches.permute(0, *range(2, 2 + n), 1, *range(2 + n, 2 + 2 * n)).reshape(-1, fan_in).contiguous()
    return {"x": x, "weight": weight, "bias": bias, "kernel": kernel, "rows": rows}


def _bytes(shape: Shape, dtype: torch.dtype) -> int:
    x, kernel = shape.extra["x"], shape.extra["kernel"]
    fan_in = x[1] * math.prod(kernel)
    return (shape.tokens * fan_in + shape.hidden * fan_in + shape.tokens * shape.hidden) * dtype.itemsize


def _impls(op: str) -> dict:
    conv_fn = F.conv3d if op == "conv3d" else F.conv2d

    def args(i):
        k = list(i["kernel"])
        return (i["x"], i["weight"], i["bias"], k, [0] * len(k), [1] * len(k), 1, "zeros")

    def customop(i):
        a = args(i)
        return lambda: getattr(torch.ops.customop, op)(*a)

    def eager(i):
        return lambda: native.conv_layer(i["x"], i["weight"], i["bias"], i["kernel"], (0,) * len(i["kernel"]),
                                         (1,) * len(i["kernel"]), 1)

    def conv(i):
        return lambda: conv_fn(i["x"], i["weight"], i["bias"], i["kernel"])

    def gemm(i):
        rows, w, b = i["rows"], i["weight"].reshape(i["weight"].shape[0], -1), i["bias"]
        grid = [s // k for s, k in zip(i["x"].shape[2:], i["kernel"])]
        batch = i["x"].shape[0]
        n = len(grid)
        # the output in the op's layout (a view), so the runner's correctness check compares like with like
        return lambda: F.linear(rows, w, b).view(batch, *grid, -1).permute(0, n + 1, *range(1, n + 1))

    def compile_(i):
        f = compiled(native.patch_linear)
        return lambda: f(i["x"], i["weight"], i["bias"])

    return {"customop": customop, "eager": eager, "conv": conv, "gemm": gemm, "compile": compile_}


SPECS = [OpSpec(name=op, family="conv", shapes=_shapes(op), make_inputs=_inputs, bytes_moved=_bytes, impls=_impls(op))
         for op in ("conv3d", "conv2d")]
