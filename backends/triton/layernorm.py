"""Triton kernels of the norms. One row-norm kernel (``_norm_kernel``, KIND picks the math)
serves rms_norm, fused_add_rms_norm (in place), gemma_rms_norm, gemma_fused_add_rms_norm (in
place), layer_norm, nemotron_layer_norm and fused_add_nemotron_layer_norm (in place), so that
every one of them gets the same launch shapes and code-generation choices (_tuning.rms_config).
It serves fused_rms_norm_gated and fused_add_rms_norm_gated too (the gate after the norm,
optionally a residual added first and an absent weight); Mamba's grouped rms_norm_gated has its
own kernel (grouped_norm.py).

Each program owns ``block_m`` whole rows and keeps them in registers: x (and the
residual) are read once, the outputs written once, all math in fp32 with one cast per output.
A tuning config may ask for a persistent grid instead (programs loop over row blocks, the next
block's loads in flight during this one's math), or for the looped variant (two passes over the
row in chunks; the second is mostly served by L2), which prefill sizes and rows wider than the
largest tile take. Numerics follow the spec (customop/math/layernorm.py): plain rms_norm rounds
the normalised value to the weight's dtype before multiplying by the weight in that dtype; Gemma
multiplies by ``1 + w`` in fp32; the fused RMS variants normalise the fp32 sum and store the
residual in x's dtype; the layer norms centre the row (the looped variant by Welford's running
mean), Nemotron multiplies by ``1 + w`` rounded to w's dtype, and its fused add normalises the
sum rounded to x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from customop.backends.triton import _tuning
from customop.backends.triton._common import as_rows, device_guard, row_stride, silu_or_sigmoid

# ---- kernels ----------------------------------------------------------------------------------

# The norm kinds (the row kernel's KIND constexpr; launchers pass ``.value``): how the normalised
# row meets the weight, and whether it is centred first (the kinds from LAYER on). RMS_FP32: the
# gated norms' RMS (weight multiply in fp32, the fp32 residual sum stored in the residual's own
# dtype). GATE (the row kernel's other constexpr): no gate, or the output times silu / sigmoid of g.
RMS, GEMMA, RMS_FP32, LAYER, NEMOTRON = (tl.constexpr(i) for i in range(5))
NO_GATE, SILU_GATE, SIGMOID_GATE = (tl.constexpr(i) for i in range(3))


@triton.jit
def _weighted(y, w, W_DTYPE: tl.constexpr, HAS_WEIGHT: tl.constexpr, KIND: tl.constexpr):
    """The normalised fp32 rows times the weight as each kind's spec does it: Llama in W's dtype
    (y rounded to it first), Gemma ``1 + w`` in fp32, Nemotron ``1 + w`` rounded to w's dtype,
    the others (layer norm, the gated norms' RMS) ``w`` in fp32."""
    if HAS_WEIGHT:
        if KIND == RMS:
            y = (y.to(W_DTYPE).to(tl.float32) * w.to(tl.float32)).to(W_DTYPE).to(tl.float32)
        elif KIND == GEMMA:
            y = y * (1.0 + w.to(tl.float32))
        elif KIND == NEMOTRON:
            y = y * _round_to(w.to(tl.float32) + 1.0, W_DTYPE)
        else:
            y = y * w.to(tl.float32)
    return y


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
def _add_residual(x, r, X_DTYPE: tl.constexpr, KIND: tl.constexpr):
    """x + residual in fp32; the layer norms round the sum to x's dtype before normalising it
    (vLLM's Nemotron adds in that dtype), the RMS kinds normalise the fp32 sum."""
    x = x + r.to(tl.float32)
    if KIND >= LAYER:
        x = _round_to(x, X_DTYPE)
    return x


@triton.jit
def _residual_out(x, X_DTYPE: tl.constexpr, R_DTYPE: tl.constexpr, KIND: tl.constexpr):
    """The sum stored as the new residual: in x's dtype, then the residual's (the gated norms'
    spec stores the fp32 sum in the residual's dtype directly)."""
    if KIND == RMS_FP32:
        return x.to(R_DTYPE)
    else:
        return x.to(X_DTYPE).to(R_DTYPE)


@triton.jit
def _gated_out(y, g, GATE: tl.constexpr):
    if GATE != NO_GATE:
        y = y * silu_or_sigmoid(g.to(tl.float32), GATE == SIGMOID_GATE)
    return y


@triton.jit
def _load(ptrs, mask, MASKED: tl.constexpr, POLICY: tl.constexpr):
    if MASKED:
        return tl.load(ptrs, mask=mask, other=0.0, eviction_policy=POLICY)
    else:
        return tl.load(ptrs, eviction_policy=POLICY)


@triton.jit
def _store(ptrs, value, mask, MASKED: tl.constexpr, POLICY: tl.constexpr):
    if MASKED:
        tl.store(ptrs, value, mask=mask, eviction_policy=POLICY)
    else:
        tl.store(ptrs, value, eviction_policy=POLICY)


@triton.jit
def _load_affine(w_ptr, b_ptr, cols, n_cols, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                 MASK_N: tl.constexpr):
    """(weight, bias) of a row block, each ``[1, BLOCK_N]`` (0.0 where the op has none), kept in
    L2 for the next blocks (evict_last)."""
    w = 0.0
    b = 0.0
    if HAS_WEIGHT:
        w = _load(w_ptr + cols, cols < n_cols, MASK_N, "evict_last")[None, :]
    if HAS_BIAS:
        b = _load(b_ptr + cols, cols < n_cols, MASK_N, "evict_last")[None, :]
    return w, b


@triton.jit
def _norm_block(
    x_ptr, res_ptr, out_ptr, w_ptr, b_ptr, g_ptr, ro_ptr, block, n_rows, n_cols,
    x_stride, res_stride, out_stride, g_stride, ro_stride, eps,
    KIND: tl.constexpr, GATE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_M: tl.constexpr,
    MASK_N: tl.constexpr, INT64: tl.constexpr, W_FIRST: tl.constexpr, POLICY: tl.constexpr,
    STORE_POLICY: tl.constexpr,
):
    """One block of BLOCK_M whole rows. MASK_M / MASK_N: bounds checks on rows / columns (off
    when the block is known to be inside); INT64: 64-bit row offsets (the host picks 32-bit when
    every offset fits); W_FIRST: the weight (and bias) loads are issued before x's, so that their
    latency overlaps theirs (after the reduction, they would wait behind the reduction's barrier
    and, with a residual, behind its store). The gate is loaded right after x, for the same reason.
    STORE_POLICY: the stores' eviction policy ("": none; RowConfig.store_evict)."""
    X_DTYPE = x_ptr.dtype.element_ty
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
    if W_FIRST:
        w, b = _load_affine(w_ptr, b_ptr, cols, n_cols, HAS_WEIGHT, HAS_BIAS, MASK_N)
    x = _load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask, MASKED, POLICY).to(tl.float32)
    g = 0.0
    if GATE != NO_GATE:
        g = _load(g_ptr + rows[:, None] * g_stride + cols[None, :], mask, MASKED, POLICY)
    if HAS_RESIDUAL:
        x = _add_residual(x, _load(res_ptr + rows[:, None] * res_stride + cols[None, :], mask, MASKED, POLICY),
                          X_DTYPE, KIND)
        _store(ro_ptr + rows[:, None] * ro_stride + cols[None, :],
               _residual_out(x, X_DTYPE, ro_ptr.dtype.element_ty, KIND), mask, MASKED, STORE_POLICY)
    if KIND >= LAYER:
        x = x - (tl.sum(x, axis=1) / n_cols)[:, None]
        if MASK_N:  # padded lanes are 0 - mean: out of the variance
            x = tl.where((cols < n_cols)[None, :], x, 0.0)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    if not W_FIRST:
        w, b = _load_affine(w_ptr, b_ptr, cols, n_cols, HAS_WEIGHT, HAS_BIAS, MASK_N)
    y = _weighted(x * rstd[:, None], w, W_DTYPE, HAS_WEIGHT, KIND)
    if HAS_BIAS:
        y = y + b.to(tl.float32)
    y = _gated_out(y, g, GATE)
    _store(out_ptr + rows[:, None] * out_stride + cols[None, :], y.to(out_ptr.dtype.element_ty), mask, MASKED,
           STORE_POLICY)


@triton.jit
def _norm_looped_row(
    x_ptr, res_ptr, out_ptr, w_ptr, b_ptr, g_ptr, ro_ptr, n_cols, x_stride, res_stride, out_stride, g_stride,
    ro_stride, eps, KIND: tl.constexpr, GATE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, WIDTH: tl.constexpr, POLICY: tl.constexpr,
    STORE_POLICY: tl.constexpr,
):
    """One row per program, in BLOCK_N chunks. Pass 1 reads the row (kept in L2) for its
    statistics: the sum of squares (RMS kinds) or, for the layer norms, a per-lane Welford mean
    and M2 (every lane but the last chunk's tail sees every chunk, so one running count serves
    them all), merged across lanes at the end. Pass 2 re-reads it from L2 and writes; an in-place
    residual is rewritten only there, chunk by chunk, after being read. WIDTH > 0: n_cols, with
    every tensor's rows packed (strides n_cols), as compile-time constants, as in Inductor's code
    for one shape: constant loop bounds and offsets, and no bounds checks when BLOCK_N divides it.
    POLICY: pass 2's loads' eviction policy (RowConfig.evict: evict-first, or none).
    STORE_POLICY: the stores' eviction policy (the looped kernel's: pass 2's; "": none;
    RowConfig.store_evict)."""
    X_DTYPE = x_ptr.dtype.element_ty
    W_DTYPE = w_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    if WIDTH > 0:
        width: tl.constexpr = WIDTH
        x_row, r_row, o_row = x_ptr + row * WIDTH, res_ptr + row * WIDTH, out_ptr + row * WIDTH
        g_row, ro_row = g_ptr + row * WIDTH, ro_ptr + row * WIDTH
    else:
        width = n_cols
        x_row, r_row, o_row = x_ptr + row * x_stride, res_ptr + row * res_stride, out_ptr + row * out_stride
        g_row, ro_row = g_ptr + row * g_stride, ro_ptr + row * ro_stride
    MASKED: tl.constexpr = WIDTH == 0 or WIDTH % BLOCK_N != 0
    lanes = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)  # sum of squares, or Welford's M2
    lane_mean = tl.zeros([BLOCK_N], dtype=tl.float32)
    seen = 0.0
    for start in range(0, width, BLOCK_N):
        cols = start + lanes
        mask = cols < width
        x = _load(x_row + cols, mask, MASKED, "evict_last").to(tl.float32)
        if HAS_RESIDUAL:
            x = _add_residual(x, _load(r_row + cols, mask, MASKED, "evict_last"), X_DTYPE, KIND)
        if KIND >= LAYER:
            seen += 1.0
            delta = x - lane_mean
            lane_mean += tl.where(mask, delta * (1.0 / seen), 0.0)
            acc += tl.where(mask, delta * (x - lane_mean), 0.0)
        else:
            acc += x * x
    mean = 0.0
    if KIND >= LAYER:
        count = ((width // BLOCK_N) + (lanes < width % BLOCK_N).to(tl.int32)).to(tl.float32)
        mean = tl.sum(count * lane_mean, axis=0) / width
        spread = lane_mean - mean
        acc += count * spread * spread
    rstd = tl.rsqrt(tl.sum(acc, axis=0) / width + eps)
    for start in range(0, width, BLOCK_N):
        cols = start + lanes
        mask = cols < width
        x = _load(x_row + cols, mask, MASKED, POLICY).to(tl.float32)
        g = 0.0
        if GATE != NO_GATE:
            g = _load(g_row + cols, mask, MASKED, POLICY)
        if HAS_RESIDUAL:
            x = _add_residual(x, _load(r_row + cols, mask, MASKED, POLICY), X_DTYPE, KIND)
            _store(ro_row + cols, _residual_out(x, X_DTYPE, ro_ptr.dtype.element_ty, KIND), mask, MASKED,
                   STORE_POLICY)
        w = _load(w_ptr + cols, mask, MASKED, "evict_last") if HAS_WEIGHT else 0.0
        y = _weighted((x - mean) * rstd, w, W_DTYPE, HAS_WEIGHT, KIND)
        if HAS_BIAS:
            y = y + _load(b_ptr + cols, mask, MASKED, "evict_last").to(tl.float32)
        y = _gated_out(y, g, GATE)
        _store(o_row + cols, y.to(out_ptr.dtype.element_ty), mask, MASKED, STORE_POLICY)


@triton.jit
def _norm_kernel(
    x_ptr, res_ptr, out_ptr, w_ptr, b_ptr, g_ptr, ro_ptr,
    n_rows, n_cols, x_stride, res_stride, out_stride, g_stride, ro_stride, eps,
    KIND: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    SINGLE_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
    PERSISTENT: tl.constexpr = False, ROW_MASK: tl.constexpr = 2, EVEN_N: tl.constexpr = False,
    INT64: tl.constexpr = True, W_FIRST: tl.constexpr = False, POLICY: tl.constexpr = "evict_first",
    GATE: tl.constexpr = 0, WIDTH: tl.constexpr = 0, STORE_POLICY: tl.constexpr = "",
):
    """The row norms (KIND: RMS, GEMMA, RMS_FP32, LAYER, NEMOTRON; GATE: times silu / sigmoid
    of g after the norm). x + residual is stored into ro (the residual itself for the in-place
    ops). SINGLE_TILE: whole rows in registers (_norm_block); otherwise one row per program in
    chunks (_norm_looped_row). ROW_MASK: 0 (BLOCK_M divides n_rows: no row bounds checks), 1
    (checks in the last block only), 2 (checks in every block); EVEN_N: BLOCK_N == n_cols (no
    column checks). PERSISTENT: fewer programs than row blocks, each looping over blocks with the
    next block's loads in flight (STAGES = 2); otherwise one block per program, straight-line code."""
    if SINGLE_TILE:
        pid = tl.program_id(0)
        n_full = n_rows // BLOCK_M
        if PERSISTENT:
            n_loop = n_full if ROW_MASK < 2 else tl.cdiv(n_rows, BLOCK_M)
            for block in tl.range(pid, n_loop, tl.num_programs(0), num_stages=STAGES):
                _norm_block(x_ptr, res_ptr, out_ptr, w_ptr, b_ptr, g_ptr, ro_ptr, block, n_rows, n_cols, x_stride,
                            res_stride, out_stride, g_stride, ro_stride, eps, KIND, GATE, HAS_RESIDUAL, HAS_WEIGHT,
                            HAS_BIAS, BLOCK_M, BLOCK_N, ROW_MASK == 2, not EVEN_N, INT64, W_FIRST, POLICY,
                            STORE_POLICY)
            if ROW_MASK == 1:
                if pid == n_full % tl.num_programs(0):
                    _norm_block(x_ptr, res_ptr, out_ptr, w_ptr, b_ptr, g_ptr, ro_ptr, n_full, n_rows, n_cols,
                                x_stride, res_stride, out_stride, g_stride, ro_stride, eps, KIND, GATE, HAS_RESIDUAL,
                                HAS_WEIGHT, HAS_BIAS, BLOCK_M, BLOCK_N, True, not EVEN_N, INT64, W_FIRST, POLICY,
                                STORE_POLICY)
        elif ROW_MASK == 1:
            if pid < n_full:
                _norm_block(x_ptr, res_ptr, out_ptr, w_ptr, b_ptr, g_ptr, ro_ptr, pid, n_rows, n_cols, x_stride,
                            res_stride, out_stride, g_stride, ro_stride, eps, KIND, GATE, HAS_RESIDUAL, HAS_WEIGHT,
                            HAS_BIAS, BLOCK_M, BLOCK_N, False, not EVEN_N, INT64, W_FIRST, POLICY,
                            STORE_POLICY)
            else:
                _norm_block(x_ptr, res_ptr, out_ptr, w_ptr, b_ptr, g_ptr, ro_ptr, pid, n_rows, n_cols, x_stride,
                            res_stride, out_stride, g_stride, ro_stride, eps, KIND, GATE, HAS_RESIDUAL, HAS_WEIGHT,
                            HAS_BIAS, BLOCK_M, BLOCK_N, True, not EVEN_N, INT64, W_FIRST, POLICY,
                            STORE_POLICY)
        else:
            _norm_block(x_ptr, res_ptr, out_ptr, w_ptr, b_ptr, g_ptr, ro_ptr, pid, n_rows, n_cols, x_stride,
                        res_stride, out_stride, g_stride, ro_stride, eps, KIND, GATE, HAS_RESIDUAL, HAS_WEIGHT,
                        HAS_BIAS, BLOCK_M, BLOCK_N, ROW_MASK == 2, not EVEN_N, INT64, W_FIRST, POLICY,
                            STORE_POLICY)
    else:
        _norm_looped_row(x_ptr, res_ptr, out_ptr, w_ptr, b_ptr, g_ptr, ro_ptr, n_cols, x_stride, res_stride,
                         out_stride, g_stride, ro_stride, eps, KIND, GATE, HAS_RESIDUAL, HAS_WEIGHT, HAS_BIAS, BLOCK_N,
                         WIDTH, POLICY, STORE_POLICY)


# ---- launchers --------------------------------------------------------------------------------


def _launch_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                 bias: torch.Tensor | None, out: torch.Tensor, eps: float, kind: tl.constexpr,
                 config: _tuning.RowConfig | None = None, gate: torch.Tensor | None = None,
                 gate_kind: tl.constexpr = NO_GATE, res_out: torch.Tensor | None = None) -> None:
    """Normalises the rows of x (+ residual) into out, the sum stored into res_out (default: the
    residual itself, in place); all are row views."""
    n_rows, n_cols = x.shape
    variant = "layer" if kind.value >= LAYER.value else "gated" if gate is not None else "rms"
    cfg = config or _tuning.rms_config(x.device, n_rows, n_cols, residual is not None, variant)
    res = residual if residual is not None else x
    ro = res_out if res_out is not None else res
    g = gate if gate is not None else x
    w = weight.contiguous() if weight is not None else x
    b = bias.contiguous() if bias is not None else x
    grid, stages = _tuning.row_grid(x.device, cfg, n_rows)
    block_m = cfg.block_m if cfg.single_tile else 1
    strides = (row_stride(x), row_stride(res), row_stride(out), row_stride(g), row_stride(ro))
    # the code-generation choices (RowConfig's even / int32 / w_first / evict): bounds checks
    # only where a block can leave the tensor, 32-bit offsets whenever the furthest element of
    # the padded last block fits (int64 otherwise, or when the config forbids 32-bit)
    blocks = triton.cdiv(n_rows, block_m)
    row_mask = 2 if not cfg.even else (0 if n_rows % block_m == 0 else 1)
    int64 = not (cfg.int32 and cfg.single_tile and _offsets_fit(blocks * block_m, cfg.block_n, strides))
    packed = all(stride == n_cols for stride in strides)
    width = n_cols if cfg.const_width and not cfg.single_tile and packed else 0
    with device_guard(x.device):
        _norm_kernel[grid](
            x, res, out, w, b, g, ro, n_rows, n_cols, *strides, eps,
            KIND=kind.value, HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None, SINGLE_TILE=cfg.single_tile, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
            STAGES=stages, PERSISTENT=grid[0] < blocks, ROW_MASK=row_mask,
            EVEN_N=cfg.even and cfg.block_n == n_cols, INT64=int64, W_FIRST=cfg.w_first,
            POLICY="evict_first" if cfg.evict else "", GATE=gate_kind.value, WIDTH=width,
            STORE_POLICY="evict_first" if cfg.store_evict else "", **cfg.launch_options)


def _offsets_fit(rows: int, width: int, strides: tuple[int, ...]) -> bool:
    """Whether every element offset of ``rows`` rows of ``width`` lanes fits in an int32."""
    return all((rows - 1) * stride + width <= 2**31 for stride in strides)


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
          out: torch.Tensor, kind: tl.constexpr, config: _tuning.RowConfig | None = None,
          bias: torch.Tensor | None = None, gate: torch.Tensor | None = None, gate_kind: tl.constexpr = NO_GATE,
          res_out: torch.Tensor | None = None) -> None:
    """Writes the norm of x (+ residual) into out and, with a residual, x + residual into res_out
    (default: the residual, in place). Tensors without a row view are handled on contiguous
    copies, written back after."""
    if x.numel() == 0:
        return
    extra = [t for t in (residual, gate, res_out) if t is not None]
    views = [as_rows(t) for t in [x, out] + extra]
    direct = all(v is not None for v in views)
    if direct:
        xr, outr, *rest = views
    else:
        hidden = x.shape[-1]
        xr = x.contiguous().view(-1, hidden)
        outr = torch.empty(xr.shape, dtype=out.dtype, device=out.device)
        rest = [t.contiguous().view(-1, hidden) for t in extra]
    rr = rest.pop(0) if residual is not None else None
    gr = rest.pop(0) if gate is not None else None
    ror = rest.pop(0) if res_out is not None else None
    if not direct:  # the residual the kernel writes must be a buffer of its own
        if ror is not None:
            ror = torch.empty_like(ror)
        elif rr is not None:
            rr = rr.clone()
    _launch_norm(xr, rr, weight, bias, outr, eps, kind, config, gr, gate_kind, ror)
    if not direct:
        out.copy_(outr.view(out.shape))
        if ror is not None:
            res_out.copy_(ror.view(res_out.shape))
        elif rr is not None:
            residual.copy_(rr.view(residual.shape))


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    _norm(x, None, weight, eps, out, RMS)
    return out


# The fused adds write in place (x gets the norm, residual the sum: vLLM's contract). ``out`` /
# ``residual_out`` redirect those writes into other buffers (the same kernel); the benchmark's
# ``customop_fresh`` column uses them to time the kernel writing fresh outputs, as its peers do.


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float,
                       out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None) -> None:
    _norm(x, residual, weight, eps, x if out is None else out, RMS, res_out=residual_out)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    _norm(x, None, weight, eps, out, GEMMA)
    return out


def gemma_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                             out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None) -> None:
    _norm(x, residual, weight, eps, x if out is None else out, GEMMA, res_out=residual_out)


def fused_rms_norm_gated(x: torch.Tensor, g: torch.Tensor, weight: torch.Tensor | None, eps: float, sigmoid: bool,
                         config: _tuning.RowConfig | None = None) -> torch.Tensor:
    """The row-norm kernel's fp32 RMS over whole rows, times the weight (none: no multiply), then
    times silu / sigmoid of g."""
    out = torch.empty_like(x)
    _norm(x, None, weight, eps, out, RMS_FP32, config, gate=g, gate_kind=SIGMOID_GATE if sigmoid else SILU_GATE)
    return out


def fused_add_rms_norm_gated(x: torch.Tensor, g: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                             eps: float, sigmoid: bool,
                             config: _tuning.RowConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_rms_norm_gated`` of ``fp32(x) + fp32(residual)``, and that sum in residual's dtype."""
    out, res_out = torch.empty_like(x), torch.empty_like(residual)
    _norm(x, residual, weight, eps, out, RMS_FP32, config, gate=g,
          gate_kind=SIGMOID_GATE if sigmoid else SILU_GATE, res_out=res_out)
    return out, res_out


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    _norm(x, None, weight, eps, out, LAYER, bias=bias)
    return out


def nemotron_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    _norm(x, None, weight, eps, out, NEMOTRON, bias=bias)
    return out


def fused_add_nemotron_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                  bias: torch.Tensor | None, eps: float, out: torch.Tensor | None = None,
                                  residual_out: torch.Tensor | None = None) -> None:
    _norm(x, residual, weight, eps, x if out is None else out, NEMOTRON, bias=bias, res_out=residual_out)


KERNELS = {
    "customop::rms_norm": rms_norm,
    "customop::fused_add_rms_norm": fused_add_rms_norm,
    "customop::gemma_rms_norm": gemma_rms_norm,
    "customop::gemma_fused_add_rms_norm": gemma_fused_add_rms_norm,
    "customop::fused_rms_norm_gated": fused_rms_norm_gated,
    "customop::fused_add_rms_norm_gated": fused_add_rms_norm_gated,
    "customop::layer_norm": layer_norm,
    "customop::nemotron_layer_norm": nemotron_layer_norm,
    "customop::fused_add_nemotron_layer_norm": fused_add_nemotron_layer_norm,
}

#: which _tuning config kind each op's kernel reads (for the benchmark runner's --sweep): ``rms``
#: (the row norms' own size classes and code-generation knobs)
TUNING = {name: "rms" for name in KERNELS}
