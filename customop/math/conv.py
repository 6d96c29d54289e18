"""The conv family's math: the patch-embedding convolutions ``conv2d`` / ``conv3d`` (vLLM's
``Conv2dLayer`` / ``Conv3dLayer``) as pure functions.

A vision encoder cuts its image (or video clip) into non-overlapping patches and projects each
one: a convolution whose kernel equals its stride, without padding, dilation or groups. Such a
convolution is one matrix product: every output position reads exactly one patch, so the input
unfolds into ``[patches, C * prod(kernel)]`` rows (a view when the patches are already laid out
contiguously, as Qwen2-VL's pixel values are) and one ``F.linear`` with the weight flattened the
same way gives the output. Spatial remainders that do not fill a patch are dropped, as a stride-K
convolution drops them. Any other convolution is ``F.conv2d`` / ``F.conv3d``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F


def is_patch_embedding(kernel_size: tuple[int, ...], stride: tuple[int, ...], padding: tuple[int, ...],
                       dilation: tuple[int, ...], groups: int) -> bool:
    """Whether the convolution is a patch projection, i.e. equals its linear form exactly. (vLLM's
    rule omits the dilation; a dilated kernel == stride convolution is not one.)"""
    return (tuple(kernel_size) == tuple(stride) and not any(padding) and all(d == 1 for d in dilation)
            and groups == 1)


def patch_rows(x: torch.Tensor, kernel: tuple[int, ...]) -> torch.Tensor:
    """The unfold of the linear form: ``x`` ``[B, C, *spatial]`` -> ``[B * prod(grid), C * prod(kernel)]``,
    one row per patch in the weight's ``(C, *kernel)`` order (a view when the patches already lie
    contiguously, a copy otherwise)."""
    n = len(kernel)
    batch, channels = x.shape[:2]
    grid = [size // k for size, k in zip(x.shape[2:], kernel)]
    # drop the remainders, split each spatial dim into (grid, kernel): [B, C, g0, k0, g1, k1, ...]
    # (reshapes, not Tensor.unfold: torch_xla 2.9 has no unfold kernel)
    x = x[(slice(None), slice(None), *(slice(0, g * k) for g, k in zip(grid, kernel)))]
    x = x.reshape(batch, channels, *(d for g, k in zip(grid, kernel) for d in (g, k)))
    # [B, *grid, C, *kernel] -> one row per patch, in the weight's (C, *kernel) order
    x = x.permute(0, *range(2, 2 + 2 * n, 2), 1, *range(3, 3 + 2 * n, 2))
    return x.reshape(-1, channels * math.prod(kernel))


def patch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 rows: torch.Tensor | None = None, linear: Callable[..., torch.Tensor] = F.linear) -> torch.Tensor:
    """A kernel == stride convolution as one GEMM. ``x`` ``[B, C, *spatial]``, ``weight``
    ``[out, C, *kernel]``; returns ``[B, out, *(spatial // kernel)]`` (a permuted view of the
    ``[B, *grid, out]`` product). ``rows``: ``patch_rows(x, kernel)`` when the caller has built
    them another way, and ``linear``: ``F.linear``'s stand-in (``forward_cpu`` passes both: its
    gathered rows and ``customop.ops.linear.cpu_linear``)."""
    kernel = weight.shape[2:]
    n = len(kernel)
    grid = [size // k for size, k in zip(x.shape[2:], kernel)]
    if rows is None:
        rows = patch_rows(x, kernel)
    out = linear(rows, weight.reshape(weight.shape[0], -1), bias)
    # the out size named, not -1: a batch of no images has nothing to infer it from
    return out.view(x.shape[0], *grid, weight.shape[0]).permute(0, n + 1, *range(1, n + 1))


def conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: tuple[int, ...],
         padding: tuple[int, ...], dilation: tuple[int, ...], groups: int, padding_mode: str = "zeros") -> torch.Tensor:
    """``F.conv2d`` / ``F.conv3d`` (by ``x``'s rank); a non-zero ``padding_mode`` pads first, as
    ``nn.Conv2d`` does."""
    fn = F.conv2d if x.dim() == 4 else F.conv3d
    if padding_mode != "zeros" and any(padding):
        pads = [p for p in reversed(padding) for _ in range(2)]
        x, padding = F.pad(x, pads, mode=padding_mode), (0,) * len(padding)
    return fn(x, weight, bias, stride, padding, dilation, groups)


def conv_layer(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: tuple[int, ...],
               padding: tuple[int, ...], dilation: tuple[int, ...], groups: int, padding_mode: str = "zeros") -> torch.Tensor:
    """The spec of ``conv2d`` / ``conv3d`` (vLLM's ``forward_native``): the linear form for a
    patch projection, the convolution otherwise."""
    if is_patch_embedding(weight.shape[2:], stride, padding, dilation, groups):
        return patch_linear(x, weight, bias)
    return conv(x, weight, bias, stride, padding, dilation, groups, padding_mode)
