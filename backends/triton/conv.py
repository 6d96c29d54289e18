"""Patch-embedding convolutions on GPUs: ``customop::conv2d`` and ``customop::conv3d``.

A patch projection (kernel == stride, no padding, dilation 1, one group) is one GEMM over
``[patches, C * prod(kernel)]`` rows (``customop/math/conv.py``). The spec builds those rows with
torch's copy of an 8-D permuted view, then cuBLAS reads them. Here one Triton kernel gathers each
patch into a row of a buffer whose length is padded to a multiple of 8 elements (zeros in the
padding, and the flattened weight padded the same way): cuBLAS's fastest kernels need 16-byte
aligned rows, and CLIP's 3 x 14 x 14 = 588 is not. The product is the same sum; only the GEMM's
tiling and so the fp32 rounding order may differ. On the H200 (2026-12-01, bf16) this took CLIP's
16 x 336-pixel images from 105 to 39 us (torch.compile: 93) and SigLIP's 8 x 384 from 28 to 19
us (compile: 19; the GEMM alone on pre-laid rows: 14). Inputs whose rows are already a view
(one contiguous patch per sample) and every other convolution run the spec (``F.conv2d``/
``F.conv3d``: cuDNN).

The kernel sees every input as 3-D (a 2-D image is a depth-1 clip with a depth-1 kernel), so one
kernel serves both ops. Program ``(rows block, columns block)``: a column ``k`` of a row is
``(c, kd, kh, kw)`` of the weight's order, a row ``p`` is ``(b, gd, gh, gw)`` of the output grid;
offsets are int64 (a video batch passes 2^31 elements).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from customop.backends.triton._common import device_guard
from customop.math import conv as _math

#: row length multiple: 8 elements of 16 bits = 16 bytes
ALIGN = 8
BLOCK_P = 32
BLOCK_K = 64


@triton.jit
def _gather_patches_kernel(x_ptr, rows_ptr, n_patches, K, row_len, GD, GH, GW,
                           sx_b, sx_c, sx_d, sx_h, sx_w,
                           KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                           BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr):
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    p_ok, k_ok = p < n_patches, k < K
    # the patch's place in the output grid
    gw = p % GW
    gh = (p // GW) % GH
    gd = (p // (GW * GH)) % GD
    b = (p // (GW * GH * GD)).to(tl.int64)
    # the column's place in the weight's (C, KD, KH, KW) order
    kw = k % KW
    kh = (k // KW) % KH
    kd = (k // (KW * KH)) % KD
    c = (k // (KW * KH * KD)).to(tl.int64)
    src = (b[:, None] * sx_b + c[None, :] * sx_c
           + (gd[:, None] * KD + kd[None, :]).to(tl.int64) * sx_d
           + (gh[:, None] * KH + kh[None, :]).to(tl.int64) * sx_h
           + (gw[:, None] * KW + kw[None, :]).to(tl.int64) * sx_w)
    values = tl.load(x_ptr + src, mask=p_ok[:, None] & k_ok[None, :], other=0.0)
    # columns K..row_len are the zero padding: written by the blocks that cover them
    dst = rows_ptr + p.to(tl.int64)[:, None] * row_len + k[None, :]
    tl.store(dst, values, mask=p_ok[:, None] & (k < row_len)[None, :])


def patch_rows(x: torch.Tensor, kernel: tuple[int, ...]) -> torch.Tensor:
    """``[patches, round_up(C * prod(kernel), ALIGN)]`` rows of ``x`` ``[B, C, *spatial]`` (2 or 3
    spatial dims), zero-padded at the end of each row; spatial remainders are dropped."""
    if x.dim() == 4:  # an image is a depth-1 clip
        x, kernel = x.unsqueeze(2), (1, *kernel)
    kd, kh, kw = kernel
    batch, channels = x.shape[:2]
    gd, gh, gw = (size // k for size, k in zip(x.shape[2:], kernel))
    n_patches, K = batch * gd * gh * gw, channels * kd * kh * kw
    row_len = -(-K // ALIGN) * ALIGN
    rows = torch.empty((n_patches, row_len), dtype=x.dtype, device=x.device)
    if n_patches == 0:
        return rows
    grid = (triton.cdiv(n_patches, BLOCK_P), triton.cdiv(row_len, BLOCK_K))
    with device_guard(x.device):
        _gather_patches_kernel[grid](x, rows, n_patches, K, row_len, gd, gh, gw, *x.stride(),
                                     KD=kd, KH=kh, KW=kw, BLOCK_P=BLOCK_P, BLOCK_K=BLOCK_K, num_warps=4)
    return rows


def _rows_are_a_view(x: torch.Tensor, kernel: tuple[int, ...]) -> bool:
    """Each sample is exactly one patch, stored contiguously (Qwen2-VL's pixel values): the spec's
    rows are then a free view, and gathering them would only add a copy (measured on the H200:
    29.7 against 23.0 us at 4096 patches)."""
    return tuple(x.shape[2:]) == kernel and x.is_contiguous()


def _patch_projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    kernel = tuple(weight.shape[2:])
    n = len(kernel)
    if _rows_are_a_view(x, kernel):
        return _math.patch_linear(x, weight, bias)
    rows = patch_rows(x, kernel)
    flat = weight.reshape(weight.shape[0], -1)
    if flat.shape[1] != rows.shape[1]:
        flat = F.pad(flat, (0, rows.shape[1] - flat.shape[1]))
    grid = [size // k for size, k in zip(x.shape[2:], kernel)]
    out = F.linear(rows, flat, bias)
    # the spec's layout: [B, *grid, out] viewed channels-first
    return out.view(x.shape[0], *grid, weight.shape[0]).permute(0, n + 1, *range(1, n + 1))


def conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: list[int], padding: list[int],
         dilation: list[int], groups: int, padding_mode: str) -> torch.Tensor:
    """The ``customop::conv2d`` / ``conv3d`` kernel (schemas in customop/ops/_library/conv.py)."""
    stride, padding, dilation = tuple(stride), tuple(padding), tuple(dilation)
    if _math.is_patch_embedding(weight.shape[2:], stride, padding, dilation, groups) \
            and math.prod(x.shape) > 0 and x.dtype in (torch.float16, torch.bfloat16, torch.float32):
        return _patch_projection(x, weight, bias)
    return _math.conv(x, weight, bias, stride, padding, dilation, groups, padding_mode).contiguous()


KERNELS = {"customop::conv2d": conv, "customop::conv3d": conv}
