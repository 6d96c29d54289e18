"""Float64 references of the conv table (``customop/samples/conv.py``): a convolution written out as a
sum over the kernel's offsets, each one a strided slice of the padded input contracted with that
offset's weight slice (no ``F.conv*``, no unfold, no ``customop.math``). Every tier judges its path
with it.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F


def ref_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride, padding, dilation,
             groups: int = 1, padding_mode: str = "zeros") -> torch.Tensor:
    """``x`` ``[B, C, *spatial]``, ``weight`` ``[O, C // groups, *kernel]`` -> float64 ``[B, O, *grid]``."""
    x, weight = x.double(), weight.double()
    n = x.dim() - 2
    if any(padding):
        pads = [p for p in reversed(padding) for _ in range(2)]
        x = F.pad(x, pads, mode="constant" if padding_mode == "zeros" else padding_mode)
    kernel = weight.shape[2:]
    grid = [(size - d * (k - 1) - 1) // s + 1 for size, k, s, d in zip(x.shape[2:], kernel, stride, dilation)]
    out = x.new_zeros(x.shape[0], weight.shape[0], *grid)
    cin, cout = weight.shape[1], weight.shape[0] // groups
    for offset in itertools.product(*(range(k) for k in kernel)):
        window = tuple(slice(o * d, o * d + (g - 1) * s + 1, s) for o, d, g, s in zip(offset, dilation, grid, stride))
        patch = x[(slice(None), slice(None), *window)]  # [B, C, *grid]
        for g in range(groups):
            w = weight[(slice(g * cout, (g + 1) * cout), slice(None), *offset)]  # [O/g, C/g]
            out[:, g * cout:(g + 1) * cout] += torch.einsum("bc...,oc->bo...", patch[:, g * cin:(g + 1) * cin], w)
    if bias is not None:
        out += bias.double().view(1, -1, *([1] * n))
    return out


def reference(op, x: torch.Tensor) -> torch.Tensor:
    """The float64 output of a built ``Conv2dLayer``/``Conv3dLayer`` on ``x``."""
    return ref_conv(x, op.weight, op.bias, op.stride, op.padding, op.dilation, op.groups, op.padding_mode)
