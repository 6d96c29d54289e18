"""Triton kernel of ``customop::mixer2_gated_rms_norm`` (the state-space family's grouped gated norm).

Not the norms family's ``customop::rms_norm_gated`` kernel: that one multiplies the normalised
value by the weight in fp32 and rounds once, while vLLM's ``Mixer2RMSNormGated`` (the spec here)
rounds to x's dtype first and then multiplies by the weight in the promoted dtype, which differs
by one ulp in bf16/fp16; and it has no weight-less "gate only" form. Here one program normalises
one group of ``BLOCK_M`` rows held in registers: x and the gate are read once, the output written
once. The product by the weight is exact in fp32 (two bf16/fp16 mantissas fit), so rounding it
to the output dtype reproduces torch's multiply bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from customop.backends.triton._common import as_rows, device_guard, next_pow2, row_stride, silu

#: lanes of a group (up to) held per program; wider groups are normalised in two passes
MAX_TILE = 8192


@triton.jit
def _mixer2_norm_kernel(x_ptr, gate_ptr, w_ptr, out_ptr, n_rows, group_size, x_stride, g_stride, o_stride, eps,
                        HAS_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        SINGLE_TILE: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    col0 = tl.program_id(1) * group_size
    row_ok = rows < n_rows
    X_DTYPE = x_ptr.dtype.element_ty
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_WEIGHT and not SINGLE_TILE:  # pass 1 over wide groups: the sum of squares only
        for start in range(0, group_size, BLOCK_N):
            cols = col0 + start + tl.arange(0, BLOCK_N)
            mask = row_ok[:, None] & (cols < col0 + group_size)[None, :]
            x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            z = tl.load(gate_ptr + rows[:, None] * g_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            g = x * silu(z)
            ss += tl.sum(g * g, axis=1)
    for start in range(0, group_size, BLOCK_N):
        cols = col0 + start + tl.arange(0, BLOCK_N)
        col_ok = cols < col0 + group_size
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        z = tl.load(gate_ptr + rows[:, None] * g_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g = x * silu(z)
        if HAS_WEIGHT:
            if SINGLE_TILE:
                ss = tl.sum(g * g, axis=1)
            y = (g * tl.rsqrt(ss / group_size + eps)[:, None]).to(X_DTYPE).to(tl.float32)
            y = y * tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        else:
            y = g
        tl.store(out_ptr + rows[:, None] * o_stride + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def mixer2_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None, eps: float,
                          group_size: int) -> torch.Tensor:
    hidden = x.shape[-1]
    if group_size <= 0 or hidden % group_size:
        raise ValueError(f"customop::mixer2_gated_rms_norm: group_size={group_size} must divide the last dim {hidden}")
    dtype = x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if x.numel() == 0:
        return out
    xr, gr = as_rows(x), as_rows(gate)
    if xr is None or gr is None:
        xr, gr = x.contiguous().view(-1, hidden), gate.contiguous().view(-1, hidden)
    outr = out.view(-1, hidden)
    n_rows = xr.shape[0]
    block_n = min(next_pow2(group_size), MAX_TILE)
    block_m = max(1, min(16, 4096 // block_n, next_pow2(n_rows)))  # about 4K lanes per program
    with device_guard(x.device):
        _mixer2_norm_kernel[(triton.cdiv(n_rows, block_m), hidden // group_size)](
            xr, gr, weight if weight is not None else xr, outr, n_rows, group_size, row_stride(xr), row_stride(gr),
            row_stride(outr), eps, HAS_WEIGHT=weight is not None, BLOCK_M=block_m, BLOCK_N=block_n,
            SINGLE_TILE=block_n >= group_size, num_warps=4 if block_m * block_n <= 2048 else 8)
    return out


KERNELS = {"customop::mixer2_gated_rms_norm": mixer2_gated_rms_norm}
