"""Triton kernels of the norms (the ``@triton.jit`` code; their launchers, ``KERNELS`` and ``TUNING``
are in ``layernorm``): the row-norm kernel ``_norm_kernel`` (KIND picks the math, GATE an optional
gate after the norm), its whole-rows block (``_norm_block``) and looped row (``_norm_looped_row``),
the norm kinds and gate codes, and the ``@triton.jit`` helpers they call.

``layernorm`` re-exports every name here, and its launchers look the kernel up through its own
names (a test patches ``layernorm._norm_kernel``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from customop.backends.triton._common import silu_or_sigmoid

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
