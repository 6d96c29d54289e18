"""Kernel entry points of the conv family: ``torch.ops.customop.conv2d`` and ``conv3d``.

The schemas are a contract with any backend that registers a device kernel; do not change them:
``x`` ``[B, C, *spatial]`` (2 or 3 spatial dims), ``weight`` ``[out, C // groups, *kernel]`` and
``bias`` ``[out]`` (or None) in x's dtype, ``stride``/``padding``/``dilation`` one entry per spatial
dim, ``padding_mode`` one of ``zeros``, ``reflect``, ``replicate``, ``circular``. Returns
``[B, out, *grid]``: for a patch projection (kernel == stride, no padding, dilation 1, one group)
a ``[B, *grid, out]`` product viewed channels-first (the linear form's layout, no copy); for any
other convolution a contiguous tensor.

The reference body below, the spec, runs where no backend registers a kernel (the linear form
is one oneDNN/XLA GEMM; ``F.conv*`` is oneDNN's). The GPU backends register
``backends/triton/conv.py`` (one Triton gather into 16-byte aligned rows, then cuBLAS). A kernel
must return the layout the fake reproduces (shape and strides).
"""

from __future__ import annotations

import torch

from customop.math import conv as _math

Tensor = torch.Tensor

SCHEMAS = {
    name: "(Tensor x, Tensor weight, Tensor? bias, int[] stride, int[] padding, int[] dilation, int groups, "
          "str padding_mode) -> Tensor"
    for name in ("conv2d", "conv3d")
}


def _body(x: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int], padding: list[int],
          dilation: list[int], groups: int, padding_mode: str) -> Tensor:
    stride, padding, dilation = tuple(stride), tuple(padding), tuple(dilation)
    if _math.is_patch_embedding(weight.shape[2:], stride, padding, dilation, groups):
        return _math.patch_linear(x, weight, bias)
    return _math.conv(x, weight, bias, stride, padding, dilation, groups, padding_mode).contiguous()


def _fake(x: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int], padding: list[int],
          dilation: list[int], groups: int, padding_mode: str) -> Tensor:
    kernel = weight.shape[2:]
    n = len(kernel)
    if _math.is_patch_embedding(kernel, tuple(stride), tuple(padding), tuple(dilation), groups):
        grid = [size // k for size, k in zip(x.shape[2:], kernel)]
        return x.new_empty(x.shape[0], *grid, weight.shape[0]).permute(0, n + 1, *range(1, n + 1))
    grid = [(size + 2 * p - d * (k - 1) - 1) // s + 1
            for size, k, s, p, d in zip(x.shape[2:], kernel, stride, padding, dilation)]
    return x.new_empty(x.shape[0], weight.shape[0], *grid)


def _define(name: str) -> None:
    def body(*args):  # one function object per op
        return _body(*args)

    op = torch.library.custom_op(f"customop::{name}", body, mutates_args=(), schema=SCHEMAS[name])
    op.register_fake(_fake)


for _name in SCHEMAS:
    _define(_name)
