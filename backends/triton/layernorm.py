"""Triton kernels of the norms: rms_norm, fused_add_rms_norm (in place), gemma_rms_norm,
gemma_fused_add_rms_norm (in place), rms_norm_gated, fused_rms_norm_gated and
fused_add_rms_norm_gated (the gated kernel with the gate after the norm, optionally a residual
added first and an absent weight), layer_norm, nemotron_layer_norm and
fused_add_nemotron_layer_norm (in place; the layer-norm kernel).

Each program owns ``block_m`` whole rows (or row groups) and keeps them in registers: x (and the
residual) are read once, the outputs written once, all math in fp32 with one cast per output.
A tuning config may ask for a persistent grid instead (programs loop over row blocks, the next
block's loads in flight during this one's math). Rows wider than the tuning table's largest tile
take a looped variant (two passes over the row; the second is mostly served by L2). Numerics follow the spec (customop/ops/layernorm.py):
plain rms_norm rounds the normalised value to the weight's dtype before multiplying by the weight
in that dtype; Gemma multiplies by ``1 + w`` in fp32; the fused variants normalise the fp32 sum
and store the residual in x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from customop.backends.triton import _tuning
from customop.backends.triton._common import as_rows, device_guard, row_stride, silu

# ---- kernels ----------------------------------------------------------------------------------


@triton.jit
def _scale_rows(x, rstd, w, W_DTYPE: tl.constexpr, HAS_WEIGHT: tl.constexpr, GEMMA: tl.constexpr):
    """x * rstd, then the weight: in W's dtype (Llama) or as (1 + w) in fp32 (Gemma)."""
    y = x * rstd
    if HAS_WEIGHT:
        if GEMMA:
            y = y * (1.0 + w.to(tl.float32))
        else:
            y = (y.to(W_DTYPE).to(tl.float32) * w.to(tl.float32)).to(W_DTYPE).to(tl.float32)
    return y


@triton.jit
def _load(ptrs, mask, MASKED: tl.constexpr, POLICY: tl.constexpr):
    if MASKED:
        return tl.load(ptrs, mask=mask, other=0.0, eviction_policy=POLICY)
    else:
        return tl.load(ptrs, eviction_policy=POLICY)


@triton.jit
def _store(ptrs, value, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptrs, value, mask=mask)
    else:
        tl.store(ptrs, value)


@triton.jit
def _rms_block(
    x_ptr, res_ptr, out_ptr, w_ptr, block, n_rows, n_cols, x_stride, res_stride, out_stride, eps,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, GEMMA: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, MASK_M: tl.constexpr, MASK_N: tl.constexpr, INT64: tl.constexpr,
    W_FIRST: tl.constexpr, POLICY: tl.constexpr,
):
    """One block of BLOCK_M whole rows. MASK_M / MASK_N: bounds checks on rows / columns (off
    when the block is known to be inside); INT64: 64-bit row offsets (the host picks 32-bit when
    every offset fits); W_FIRST: the weight load is issued before x's, so that its latency
    overlaps theirs (after the reduction, it would wait behind the reduction's barrier and, in
    the fused add, behind the residual's store)."""
    W_DTYPE = w_ptr.dtype.element_ty
    MASKED: tl.constexpr = MASK_M or MASK_N
    cols = tl.arange(0, BLOCK_N)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    if INT64:
        rows = rows.to(tl.int64)
    if MASK_M and MASK_N:
        mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    elif MASK_M:
        mask = tl.broadcast_to((rows < n_rows)[:, None], (BLOCK_M, BLOCK_N))
    else:  # only the columns, or unused
        mask = tl.broadcast_to((cols < n_cols)[None, :], (BLOCK_M, BLOCK_N))
    w = 0.0
    if HAS_WEIGHT and W_FIRST:
        w = _load(w_ptr + cols, cols < n_cols, MASK_N, "evict_last")[None, :]
    x = _load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask, MASKED, POLICY).to(tl.float32)
    if HAS_RESIDUAL:
        r_ptrs = res_ptr + rows[:, None] * res_stride + cols[None, :]
        x += _load(r_ptrs, mask, MASKED, POLICY).to(tl.float32)
        _store(r_ptrs, x.to(x_ptr.dtype.element_ty).to(res_ptr.dtype.element_ty), mask, MASKED)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    if HAS_WEIGHT and not W_FIRST:
        w = _load(w_ptr + cols, cols < n_cols, MASK_N, "evict_last")[None, :]
    y = _scale_rows(x, rstd[:, None], w, W_DTYPE, HAS_WEIGHT, GEMMA)
    _store(out_ptr + rows[:, None] * out_stride + cols[None, :], y.to(out_ptr.dtype.element_ty), mask, MASKED)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, out_ptr, w_ptr,
    n_rows, n_cols, x_stride, res_stride, out_stride, eps,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, GEMMA: tl.constexpr,
    SINGLE_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
    PERSISTENT: tl.constexpr = False, ROW_MASK: tl.constexpr = 2, EVEN_N: tl.constexpr = False,
    INT64: tl.constexpr = True, W_FIRST: tl.constexpr = False, POLICY: tl.constexpr = "evict_first",
):
    """ROW_MASK: 0 (BLOCK_M divides n_rows: no row bounds checks), 1 (checks in the last block
    only), 2 (checks in every block); EVEN_N: BLOCK_N == n_cols (no column checks). PERSISTENT:
    fewer programs than row blocks, each looping over blocks with the next block's loads in
    flight (STAGES = 2); otherwise one block per program, straight-line code."""
    if SINGLE_TILE:
        pid = tl.program_id(0)
        n_full = n_rows // BLOCK_M
        if PERSISTENT:
            n_loop = n_full if ROW_MASK < 2 else tl.cdiv(n_rows, BLOCK_M)
            for block in tl.range(pid, n_loop, tl.num_programs(0), num_stages=STAGES):
                _rms_block(x_ptr, res_ptr, out_ptr, w_ptr, block, n_rows, n_cols, x_stride, res_stride, out_stride,
                           eps, HAS_RESIDUAL, HAS_WEIGHT, GEMMA, BLOCK_M, BLOCK_N, ROW_MASK == 2, not EVEN_N,
                           INT64, W_FIRST, POLICY)
            if ROW_MASK == 1:
                if pid == n_full % tl.num_programs(0):
                    _rms_block(x_ptr, res_ptr, out_ptr, w_ptr, n_full, n_rows, n_cols, x_stride, res_stride,
                               out_stride, eps, HAS_RESIDUAL, HAS_WEIGHT, GEMMA, BLOCK_M, BLOCK_N, True, not EVEN_N,
                               INT64, W_FIRST, POLICY)
        elif ROW_MASK == 1:
            if pid < n_full:
                _rms_block(x_ptr, res_ptr, out_ptr, w_ptr, pid, n_rows, n_cols, x_stride, res_stride, out_stride,
                           eps, HAS_RESIDUAL, HAS_WEIGHT, GEMMA, BLOCK_M, BLOCK_N, False, not EVEN_N,
                           INT64, W_FIRST, POLICY)
            else:
                _rms_block(x_ptr, res_ptr, out_ptr, w_ptr, pid, n_rows, n_cols, x_stride, res_stride, out_stride,
                           eps, HAS_RESIDUAL, HAS_WEIGHT, GEMMA, BLOCK_M, BLOCK_N, True, not EVEN_N,
                           INT64, W_FIRST, POLICY)
        else:
            _rms_block(x_ptr, res_ptr, out_ptr, w_ptr, pid, n_rows, n_cols, x_stride, res_stride, out_stride,
                       eps, HAS_RESIDUAL, HAS_WEIGHT, GEMMA, BLOCK_M, BLOCK_N, ROW_MASK == 2, not EVEN_N,
                       INT64, W_FIRST, POLICY)
    else:
        W_DTYPE = w_ptr.dtype.element_ty
        # One row per program. Pass 1 sums squares; pass 2 re-reads x (and the residual, which
        # is rewritten only there, chunk by chunk, after being read), then writes.
        row = tl.program_id(0).to(tl.int64)
        x_row, r_row, o_row = x_ptr + row * x_stride, res_ptr + row * res_stride, out_ptr + row * out_stride
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < n_cols
            x = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            if HAS_RESIDUAL:
                x += tl.load(r_row + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            acc += x * x
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / n_cols + eps)
        for start in range(0, n_cols, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < n_cols
            x = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            if HAS_RESIDUAL:
                x += tl.load(r_row + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
                tl.store(r_row + cols, x.to(x_ptr.dtype.element_ty).to(res_ptr.dtype.element_ty), mask=mask)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_last") if HAS_WEIGHT else 0.0
            y = _scale_rows(x, rstd, w, W_DTYPE, HAS_WEIGHT, GEMMA)
            tl.store(o_row + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gate(z, SIGMOID: tl.constexpr):
    return tl.sigmoid(z) if SIGMOID else silu(z)


@triton.jit
def _rms_norm_gated_kernel(
    x_ptr, z_ptr, out_ptr, w_ptr, res_ptr, res_out_ptr,
    n_rows, group_size, x_stride, z_stride, out_stride, res_stride, res_out_stride, eps,
    HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, SIGMOID: tl.constexpr,
    SINGLE_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WEIGHT: tl.constexpr = True, HAS_RESIDUAL: tl.constexpr = False,
):
    # grid: (row blocks, groups); a program normalises one group of block_m rows. HAS_RESIDUAL
    # (fused_add_rms_norm_gated, one group per row): x + residual in fp32 is what gets normalised,
    # and is stored into res_out (a separate buffer, in its own dtype).
    col0 = tl.program_id(1) * group_size
    if SINGLE_TILE:
        rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < group_size
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        offs = col0 + cols[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_stride + offs, mask=mask, other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        if HAS_RESIDUAL:
            x += tl.load(res_ptr + rows[:, None] * res_stride + offs, mask=mask, other=0.0,
                         eviction_policy="evict_first").to(tl.float32)
            tl.store(res_out_ptr + rows[:, None] * res_out_stride + offs, x.to(res_out_ptr.dtype.element_ty),
                     mask=mask)
        if HAS_Z:
            g = _gate(tl.load(z_ptr + rows[:, None] * z_stride + offs, mask=mask, other=0.0,
                              eviction_policy="evict_first").to(tl.float32), SIGMOID)
            if not NORM_BEFORE_GATE:
                x = x * g
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / group_size + eps)
        y = x * rstd[:, None]
        if HAS_WEIGHT:
            w = tl.load(w_ptr + col0 + cols, mask=col_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            y = y * w[None, :]
        if HAS_Z and NORM_BEFORE_GATE:
            y = y * g
        tl.store(out_ptr + rows[:, None] * out_stride + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        row = tl.program_id(0).to(tl.int64)
        x_row, z_row, o_row = x_ptr + row * x_stride + col0, z_ptr + row * z_stride + col0, out_ptr + row * out_stride + col0
        r_row, ro_row = res_ptr + row * res_stride + col0, res_out_ptr + row * res_out_stride + col0
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, group_size, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < group_size
            x = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            if HAS_RESIDUAL:
                x += tl.load(r_row + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            if HAS_Z and not NORM_BEFORE_GATE:
                x = x * _gate(tl.load(z_row + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32), SIGMOID)
            acc += x * x
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / group_size + eps)
        for start in range(0, group_size, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < group_size
            x = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            if HAS_RESIDUAL:
                x += tl.load(r_row + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
                tl.store(ro_row + cols, x.to(res_out_ptr.dtype.element_ty), mask=mask)
            if HAS_Z:
                g = _gate(tl.load(z_row + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32), SIGMOID)
                if not NORM_BEFORE_GATE:
                    x = x * g
            y = x * rstd
            if HAS_WEIGHT:
                y = y * tl.load(w_ptr + col0 + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            if HAS_Z and NORM_BEFORE_GATE:
                y = y * g
            tl.store(o_row + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _round_to(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to DTYPE (to nearest, ties to even) and widened back: the rounding
    points the spec has inside the kernel. bf16 is rounded on the bits because the Triton
    interpreter truncates a bf16 cast (a GPU rounds either way; NaN stays NaN, as only its low
    mantissa bits move)."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def _layer_norm_kernel(
    x_ptr, res_ptr, out_ptr, w_ptr, b_ptr,
    n_rows, n_cols, x_stride, res_stride, out_stride, eps,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, ONE_PLUS: tl.constexpr,
    SINGLE_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
):
    """Layer norm of rows, fp32 math, one cast per output. ONE_PLUS (Nemotron): the weight is
    ``1 + w`` rounded to w's dtype; HAS_RESIDUAL (Nemotron's fused add): ``x + residual`` is
    rounded to x's dtype (vLLM adds in that dtype), stored into the residual, then normalised."""
    X_DTYPE = x_ptr.dtype.element_ty
    W_DTYPE = w_ptr.dtype.element_ty
    if SINGLE_TILE:
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < n_cols
        for block in tl.range(tl.program_id(0), tl.cdiv(n_rows, BLOCK_M), tl.num_programs(0), num_stages=STAGES):
            rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
            mask = (rows < n_rows)[:, None] & col_mask[None, :]
            x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0,
                        eviction_policy="evict_first").to(tl.float32)
            if HAS_RESIDUAL:
                r_ptrs = res_ptr + rows[:, None] * res_stride + cols[None, :]
                x = (x + tl.load(r_ptrs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32))
                x = _round_to(x, X_DTYPE)
                tl.store(r_ptrs, x.to(res_ptr.dtype.element_ty), mask=mask)
            mean = tl.sum(x, axis=1) / n_cols
            xc = tl.where(mask, x - mean[:, None], 0.0)
            y = xc * tl.rsqrt(tl.sum(xc * xc, axis=1) / n_cols + eps)[:, None]
            if HAS_WEIGHT:
                w = tl.load(w_ptr + cols, mask=col_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
                if ONE_PLUS:
                    w = _round_to(w + 1.0, W_DTYPE)
                y = y * w[None, :]
            if HAS_BIAS:
                y = y + tl.load(b_ptr + cols, mask=col_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)[None, :]
            tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # One row per program, three passes: the mean, the centred sum of squares, then the
        # writes (the residual is rewritten only there, chunk by chunk, after being read).
        row = tl.program_id(0).to(tl.int64)
        x_row, r_row, o_row = x_ptr + row * x_stride, res_ptr + row * res_stride, out_ptr + row * out_stride
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < n_cols
            x = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            if HAS_RESIDUAL:
                x = (x + tl.load(r_row + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32))
                x = _round_to(x, X_DTYPE)
            acc += x
        mean = tl.sum(acc, axis=0) / n_cols
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < n_cols
            x = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            if HAS_RESIDUAL:
                x = (x + tl.load(r_row + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32))
                x = _round_to(x, X_DTYPE)
            xc = tl.where(mask, x - mean, 0.0)
            acc += xc * xc
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / n_cols + eps)
        for start in range(0, n_cols, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < n_cols
            x = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            if HAS_RESIDUAL:
                x = (x + tl.load(r_row + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32))
                x = _round_to(x, X_DTYPE)
                tl.store(r_row + cols, x.to(res_ptr.dtype.element_ty), mask=mask)
            y = (x - mean) * rstd
            if HAS_WEIGHT:
                w = tl.load(w_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
                if ONE_PLUS:
                    w = _round_to(w + 1.0, W_DTYPE)
                y = y * w
            if HAS_BIAS:
                y = y + tl.load(b_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            tl.store(o_row + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


# ---- launchers --------------------------------------------------------------------------------


def _launch_rms(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                out: torch.Tensor, eps: float, gemma: bool, config: _tuning.RowConfig | None = None) -> None:
    """Normalises the rows of x (+ residual, rewritten in place) into out; all are row views."""
    n_rows, n_cols = x.shape
    cfg = config or _tuning.rms_config(x.device, n_rows, n_cols, residual is not None)
    res = residual if residual is not None else x
    w = weight.contiguous() if weight is not None else x
    grid, stages = _tuning.row_grid(x.device, cfg, n_rows)
    block_m = cfg.block_m if cfg.single_tile else 1
    strides = (row_stride(x), row_stride(res), row_stride(out))
    # the code-generation choices (RowConfig's even / int32 / w_first / evict): bounds checks
    # only where a block can leave the tensor, 32-bit offsets whenever the furthest element of
    # the padded last block fits (int64 otherwise, or when the config forbids 32-bit)
    blocks = triton.cdiv(n_rows, block_m)
    row_mask = 2 if not cfg.even else (0 if n_rows % block_m == 0 else 1)
    int64 = not (cfg.int32 and cfg.single_tile and _offsets_fit(blocks * block_m, cfg.block_n, strides))
    with device_guard(x.device):
        _rms_norm_kernel[grid](
            x, res, out, w, n_rows, n_cols, *strides, eps,
            HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, GEMMA=gemma,
            SINGLE_TILE=cfg.single_tile, BLOCK_M=block_m, BLOCK_N=cfg.block_n, STAGES=stages,
            PERSISTENT=grid[0] < blocks, ROW_MASK=row_mask, EVEN_N=cfg.even and cfg.block_n == n_cols,
            INT64=int64, W_FIRST=cfg.w_first, POLICY="evict_first" if cfg.evict else "", **cfg.launch_options)


def _offsets_fit(rows: int, width: int, strides: tuple[int, ...]) -> bool:
    """Whether every element offset of ``rows`` rows of ``width`` lanes fits in an int32."""
    return all((rows - 1) * stride + width <= 2**31 for stride in strides)


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
          out: torch.Tensor, gemma: bool, config: _tuning.RowConfig | None = None) -> None:
    """Writes the norm of x (+ residual) into out and, with a residual, x + residual into it.
    Tensors without a row view are handled on contiguous copies, written back after."""
    if x.numel() == 0:
        return
    views = [as_rows(t) for t in (x, out) + ((residual,) if residual is not None else ())]
    if all(v is not None for v in views):
        _launch_rms(views[0], views[2] if residual is not None else None, weight, views[1], eps, gemma, config)
        return
    hidden = x.shape[-1]
    xc = x.contiguous().view(-1, hidden)
    rc = None if residual is None else residual.contiguous().view(-1, hidden).clone()
    oc = torch.empty_like(xc)
    _launch_rms(xc, rc, weight, oc, eps, gemma, config)
    if residual is not None:
        residual.copy_(rc.view(residual.shape))
    out.copy_(oc.view(out.shape))


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    _norm(x, None, weight, eps, out, gemma=False)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float) -> None:
    _norm(x, residual, weight, eps, x, gemma=False)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    _norm(x, None, weight, eps, out, gemma=True)
    return out


def gemma_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    _norm(x, residual, weight, eps, x, gemma=True)


def rms_norm_gated(x: torch.Tensor, weight: torch.Tensor, z: torch.Tensor | None, eps: float,
                   group_size: int, norm_before_gate: bool, sigmoid: bool,
                   config: _tuning.RowConfig | None = None) -> torch.Tensor:
    hidden = x.shape[-1]
    if group_size <= 0 or hidden % group_size:
        raise ValueError(f"customop::rms_norm_gated: group_size={group_size} must divide the last dim {hidden}")
    return _gated(x, weight, z, None, eps, group_size, norm_before_gate, sigmoid, config)[0]


def fused_rms_norm_gated(x: torch.Tensor, g: torch.Tensor, weight: torch.Tensor | None, eps: float, sigmoid: bool,
                         config: _tuning.RowConfig | None = None) -> torch.Tensor:
    """The gated kernel with the gate after the norm over whole rows (no weight: no multiply)."""
    return _gated(x, weight, g, None, eps, x.shape[-1], True, sigmoid, config)[0]


def fused_add_rms_norm_gated(x: torch.Tensor, g: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                             eps: float, sigmoid: bool,
                             config: _tuning.RowConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_rms_norm_gated`` of ``fp32(x) + fp32(residual)``, and that sum in residual's dtype."""
    return _gated(x, weight, g, residual, eps, x.shape[-1], True, sigmoid, config)


def _gated(x: torch.Tensor, weight: torch.Tensor | None, z: torch.Tensor | None, residual: torch.Tensor | None,
           eps: float, group_size: int, norm_before_gate: bool, sigmoid: bool,
           config: _tuning.RowConfig | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, residual_out or None) of the gated kernel; inputs without a row view run on copies."""
    hidden = x.shape[-1]
    out = torch.empty_like(x)
    res_out = None if residual is None else torch.empty_like(residual)
    if x.numel() == 0:
        return out, res_out
    extra = [t for t in (z, residual) if t is not None]
    xr, outr = as_rows(x), as_rows(out)
    views = [as_rows(t) for t in extra]
    direct = xr is not None and outr is not None and all(v is not None for v in views)
    if not direct:
        xr = x.contiguous().view(-1, hidden)
        views = [t.contiguous().view(-1, hidden) for t in extra]
        outr = torch.empty_like(xr)
    zr = views.pop(0) if z is not None else None
    rr = views.pop(0) if residual is not None else None
    ror = None if res_out is None else res_out.view(-1, hidden)  # fresh: always a row view
    n_rows, n_groups = xr.shape[0], hidden // group_size
    cfg = config or _tuning.row_config(x.device, n_rows * n_groups, group_size)
    grid = (triton.cdiv(n_rows, cfg.block_m) if cfg.single_tile else n_rows, n_groups)
    zt = zr if zr is not None else xr
    rt, rot = (rr, ror) if rr is not None else (xr, outr)
    with device_guard(x.device):
        _rms_norm_gated_kernel[grid](
            xr, zt, outr, weight.contiguous() if weight is not None else xr, rt, rot, n_rows, group_size,
            row_stride(xr), row_stride(zt), row_stride(outr), row_stride(rt), row_stride(rot), eps,
            HAS_Z=z is not None, NORM_BEFORE_GATE=norm_before_gate, SIGMOID=sigmoid,
            SINGLE_TILE=cfg.single_tile, BLOCK_M=cfg.block_m if cfg.single_tile else 1,
            BLOCK_N=cfg.block_n, HAS_WEIGHT=weight is not None, HAS_RESIDUAL=residual is not None,
            **cfg.launch_options)
    if not direct:
        out.copy_(outr.view(out.shape))
    return out, res_out


def _launch_layer_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                       bias: torch.Tensor | None, out: torch.Tensor, eps: float, one_plus: bool,
                       config: _tuning.RowConfig | None = None) -> None:
    n_rows, n_cols = x.shape
    cfg = config or _tuning.row_config(x.device, n_rows, n_cols)
    res = residual if residual is not None else x
    w = weight.contiguous() if weight is not None else x
    b = bias.contiguous() if bias is not None else x
    grid, stages = _tuning.row_grid(x.device, cfg, n_rows)
    with device_guard(x.device):
        _layer_norm_kernel[grid](
            x, res, out, w, b, n_rows, n_cols, row_stride(x), row_stride(res), row_stride(out), eps,
            HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
            ONE_PLUS=one_plus, SINGLE_TILE=cfg.single_tile, BLOCK_M=cfg.block_m if cfg.single_tile else 1,
            BLOCK_N=cfg.block_n, STAGES=stages, **cfg.launch_options)


def _layer_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                bias: torch.Tensor | None, eps: float, out: torch.Tensor, one_plus: bool,
                config: _tuning.RowConfig | None = None) -> None:
    """``_norm``'s contract for the layer-norm kernel: out <- norm(x (+ residual)), the residual
    rewritten in place; tensors without a row view run on copies, written back after."""
    if x.numel() == 0:
        return
    views = [as_rows(t) for t in (x, out) + ((residual,) if residual is not None else ())]
    if all(v is not None for v in views):
        _launch_layer_norm(views[0], views[2] if residual is not None else None, weight, bias, views[1], eps,
                           one_plus, config)
        return
    hidden = x.shape[-1]
    xc = x.contiguous().view(-1, hidden)
    rc = None if residual is None else residual.contiguous().view(-1, hidden).clone()
    oc = torch.empty_like(xc)
    _launch_layer_norm(xc, rc, weight, bias, oc, eps, one_plus, config)
    if residual is not None:
        residual.copy_(rc.view(residual.shape))
    out.copy_(oc.view(out.shape))


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    _layer_norm(x, None, weight, bias, eps, out, one_plus=False)
    return out


def nemotron_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    _layer_norm(x, None, weight, bias, eps, out, one_plus=True)
    return out


def fused_add_nemotron_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                  bias: torch.Tensor | None, eps: float) -> None:
    _layer_norm(x, residual, weight, bias, eps, x, one_plus=True)


_RMS_OPS = ("customop::rms_norm", "customop::fused_add_rms_norm", "customop::gemma_rms_norm",
            "customop::gemma_fused_add_rms_norm")

KERNELS = {
    "customop::rms_norm": rms_norm,
    "customop::fused_add_rms_norm": fused_add_rms_norm,
    "customop::gemma_rms_norm": gemma_rms_norm,
    "customop::gemma_fused_add_rms_norm": gemma_fused_add_rms_norm,
    "customop::rms_norm_gated": rms_norm_gated,
    "customop::fused_rms_norm_gated": fused_rms_norm_gated,
    "customop::fused_add_rms_norm_gated": fused_add_rms_norm_gated,
    "customop::layer_norm": layer_norm,
    "customop::nemotron_layer_norm": nemotron_layer_norm,
    "customop::fused_add_nemotron_layer_norm": fused_add_nemotron_layer_norm,
}

#: which _tuning config kind each op's kernel reads (for the benchmark runner's --sweep): the
#: RMSNorm family reads ``rms`` (its own size classes and code-generation knobs), the others ``rows``
TUNING = {name: "rms" if name in _RMS_OPS else "rows" for name in KERNELS}
