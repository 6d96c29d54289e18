"""Triton kernel of ``customop::rms_norm_gated``, Mamba's grouped gated RMSNorm: the row is
normalised in groups of ``group_size`` lanes, the gate (silu or sigmoid of z) multiplying x
before the norm or the output after it (``norm_before_gate``); the weight multiply in fp32, one
rounding to the output dtype. One program normalises one group of ``block_m`` rows held in
registers (grid: row blocks x groups), or one group of one row in chunks (two passes) when the
group is wider than the tuning table's largest tile. The other norms share one row kernel
(layernorm.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from customop.backends.triton import _tuning
from customop.backends.triton._common import as_rows, device_guard, row_stride, silu_or_sigmoid


@triton.jit
def _rms_norm_gated_kernel(
    x_ptr, z_ptr, out_ptr, w_ptr,
    n_rows, group_size, x_stride, z_stride, out_stride, eps,
    HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, SIGMOID: tl.constexpr,
    SINGLE_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Mamba's grouped gated norm. grid: (row blocks, groups); a program normalises one group of
    # block_m rows; without NORM_BEFORE_GATE the gate multiplies x before the norm.
    col0 = tl.program_id(1) * group_size
    if SINGLE_TILE:
        rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < group_size
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        offs = col0 + cols[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_stride + offs, mask=mask, other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        if HAS_Z:
            g = silu_or_sigmoid(tl.load(z_ptr + rows[:, None] * z_stride + offs, mask=mask, other=0.0,
                              eviction_policy="evict_first").to(tl.float32), SIGMOID)
            if not NORM_BEFORE_GATE:
                x = x * g
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / group_size + eps)
        w = tl.load(w_ptr + col0 + cols, mask=col_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        y = x * rstd[:, None] * w[None, :]
        if HAS_Z and NORM_BEFORE_GATE:
            y = y * g
        tl.store(out_ptr + rows[:, None] * out_stride + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        row = tl.program_id(0).to(tl.int64)
        x_row, z_row, o_row = x_ptr + row * x_stride + col0, z_ptr + row * z_stride + col0, out_ptr + row * out_stride + col0
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, group_size, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < group_size
            x = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            if HAS_Z and not NORM_BEFORE_GATE:
                x = x * silu_or_sigmoid(tl.load(z_row + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32), SIGMOID)
            acc += x * x
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / group_size + eps)
        for start in range(0, group_size, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < group_size
            x = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            if HAS_Z:
                g = silu_or_sigmoid(tl.load(z_row + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32), SIGMOID)
                if not NORM_BEFORE_GATE:
                    x = x * g
            y = x * rstd * tl.load(w_ptr + col0 + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            if HAS_Z and NORM_BEFORE_GATE:
                y = y * g
            tl.store(o_row + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_gated(x: torch.Tensor, weight: torch.Tensor, z: torch.Tensor | None, eps: float,
                   group_size: int, norm_before_gate: bool, sigmoid: bool,
                   config: _tuning.RowConfig | None = None) -> torch.Tensor:
    """Mamba's grouped gated norm (the grouped kernel); inputs without a row view run on copies."""
    hidden = x.shape[-1]
    if group_size <= 0 or hidden % group_size:
        raise ValueError(f"customop::rms_norm_gated: group_size={group_size} must divide the last dim {hidden}")
    out = torch.empty_like(x)
    if x.numel() == 0:
        return out
    xr, outr, zr = as_rows(x), as_rows(out), as_rows(z) if z is not None else None
    direct = xr is not None and outr is not None and (z is None or zr is not None)
    if not direct:
        xr, outr = x.contiguous().view(-1, hidden), torch.empty(x.shape, dtype=x.dtype, device=x.device).view(-1, hidden)
        zr = z.contiguous().view(-1, hidden) if z is not None else None
    n_rows, n_groups = xr.shape[0], hidden // group_size
    cfg = config or _tuning.row_config(x.device, n_rows * n_groups, group_size)
    grid = (triton.cdiv(n_rows, cfg.block_m) if cfg.single_tile else n_rows, n_groups)
    zt = zr if zr is not None else xr
    with device_guard(x.device):
        _rms_norm_gated_kernel[grid](
            xr, zt, outr, weight.contiguous(), n_rows, group_size, row_stride(xr), row_stride(zt), row_stride(outr), eps,
            HAS_Z=z is not None, NORM_BEFORE_GATE=norm_before_gate, SIGMOID=sigmoid, SINGLE_TILE=cfg.single_tile,
            BLOCK_M=cfg.block_m if cfg.single_tile else 1, BLOCK_N=cfg.block_n, **cfg.launch_options)
    if not direct:
        out.copy_(outr.view(out.shape))
    return out


KERNELS = {"customop::rms_norm_gated": rms_norm_gated}

#: the _tuning config kind the kernel reads (the benchmark runner's --sweep): a row reduction
TUNING = {"customop::rms_norm_gated": "rows"}
