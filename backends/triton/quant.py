"""fp8 quantization kernels: static and dynamic per-tensor, dynamic per-token, per-token-group.

The math is the reference's (customop/math/quant.py, op-semantics D.4), and on
real hardware the bits are the same:

- every division is IEEE (``div_rn``): Triton's ``/`` on fp32 is an approximate ``div.full``;
- per-tensor / per-token / static: ``q = clamp(x * (1/scale))`` with a correctly rounded fp32
  reciprocal, as the reference's ``scale.reciprocal()`` then multiply;
- per-group: ``q = clamp(x / s)``, a true division. Per element it is ``x * inv`` plus one
  FMA correction step, which gives the correctly rounded quotient (Markstein) for 3 flops
  instead of ``div.rn``'s slow sequence; with ue8m0 the scale is a power of two and ``x * inv``
  is already exact;
- ue8m0 rounds the scale up to a power of two on its bits (exponent + 1 when the mantissa is not
  zero), the exact ``2^ceil(log2 s)``; an approximate ``log2`` gets scales just above a power of
  two wrong.

Per-tensor dynamic needs the max over the whole tensor before any element can be written, without
a host sync: kernel 1 writes one partial max per program (a persistent grid of two programs per
SM), kernel 2 reduces them in every program (~1 KB from L2), writes the scale from program 0 and
quantizes. Kernel 2 walks the tiles in reverse, so its first reads hit what
kernel 1 left in L2. No memset and no atomics: CUDA-graph safe and deterministic.

Per-token (and the fused rms_norm + quant in fused_norm_quant.py) keeps a whole row in registers
when it fits: one read of ``x``, one write of ``q``; wider rows take extra passes over L2.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from customop.backends.triton._common import row_stride, rows_or_copy
from customop.backends.triton._tuning import flat_config, group_config, row_config, sm_count
from customop.ops._library import quant as _library_quant

#: kernel 1 of the dynamic per-tensor quant: this many programs (and partial maxima) per SM,
#: each looping over tiles of ``_AMAX_BLOCK`` elements (32 KB of bf16 in flight per program, 64
#: per thread); kernel 2 reads all partials in every program, so they stay ~1 KB
_PARTIALS_PER_SM = 2
_AMAX_BLOCK = 16384
_AMAX_WARPS = 8
_MAX_PARTIALS = 1024
#: dynamic per-tensor quant of at most this many elements runs as one program (one launch: at
#: decode sizes the second launch costs more than the two passes over an L2-hot tensor)
_SMALL_NUMEL = 32768
_SMALL_BLOCK = 4096
_SMALL_WARPS = 8


def launch_device(t: torch.Tensor):
    """Triton launches on the current device: make it the tensor's (multi-GPU processes)."""
    if t.device.type == "cpu":
        return contextlib.nullcontext()
    return torch.get_device_module(t.device.type).device(t.device)


# ---- shared pieces ---------------------------------------------------------------------------


@triton.jit
def fp8_scale(amax, fp8_max, min_scale):
    """``max(amax / fp8_max, min_scale)`` with an IEEE division."""
    return tl.maximum(tl.math.div_rn(amax, fp8_max), min_scale)


@triton.jit
def quantize(v, inv, fp8_max, q_dtype: tl.constexpr):
    """``clamp(v * inv, -max, max)`` rounded to ``q_dtype`` (round to nearest even)."""
    return tl.clamp(v * inv, -fp8_max, fp8_max).to(q_dtype)


@triton.jit
def _pow2_ceil(s):
    """``2^ceil(log2 s)`` for positive normal fp32 ``s``, exactly, on the bits."""
    bits = s.to(tl.int32, bitcast=True)
    exponent = bits & 0x7F800000
    exponent = tl.where((bits & 0x007FFFFF) != 0, exponent + 0x00800000, exponent)
    return exponent.to(tl.float32, bitcast=True)


@triton.jit
def _source_offsets(offs, N, x_stride, CONTIG: tl.constexpr):
    """Flat element index -> offset into x (rows of N at ``x_stride`` when not contiguous)."""
    if CONTIG:
        return offs
    return (offs // N) * x_stride + offs % N


# ---- per tensor -------------------------------------------------------------------------------


@triton.jit
def _absmax_partials_kernel(x_ptr, partial_ptr, numel, N, x_stride, num_tiles,
                            BLOCK: tl.constexpr, CONTIG: tl.constexpr):
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for tile in range(pid, num_tiles, tl.num_programs(0)):
        offs = tl.cast(tile, tl.int64) * BLOCK + lanes
        x = tl.load(x_ptr + _source_offsets(offs, N, x_stride, CONTIG), mask=offs < numel, other=0.0)
        acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
    tl.store(partial_ptr + pid, tl.max(acc, axis=0))


@triton.jit
def _per_tensor_quant_kernel(x_ptr, q_ptr, scale_ptr, partial_ptr, num_partials, numel, N, x_stride,
                             fp8_max, min_scale, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr,
                             DYNAMIC: tl.constexpr, CONTIG: tl.constexpr):
    pid = tl.program_id(0)
    # reverse when dynamic: the last tiles kernel 1 read are still in L2
    tile = tl.num_programs(0) - 1 - pid if DYNAMIC else pid
    offs = tile.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    # x is requested before the scale: the scale's load (and the reduction of the partials) then
    # overlaps x's instead of preceding it (div_rn is a branchy sequence loads do not move across)
    x = tl.load(x_ptr + _source_offsets(offs, N, x_stride, CONTIG), mask=mask, other=0.0,
                eviction_policy="evict_first")
    if DYNAMIC:
        idx = tl.arange(0, BLOCK_P)
        partials = tl.load(partial_ptr + idx, mask=idx < num_partials, other=0.0)
        scale = fp8_scale(tl.max(partials, axis=0), fp8_max, min_scale)
        if pid == 0:
            tl.store(scale_ptr, scale)
    else:
        scale = tl.load(scale_ptr).to(tl.float32)
    inv = tl.math.div_rn(1.0, scale)
    tl.store(q_ptr + offs, quantize(x.to(tl.float32), inv, fp8_max, q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _per_tensor_small_kernel(x_ptr, q_ptr, scale_ptr, numel, N, x_stride, fp8_max, min_scale,
                             BLOCK: tl.constexpr, CONTIG: tl.constexpr):
    """Dynamic per-tensor quant of a small tensor in one program: an amax pass, then a quantize
    pass over what the first left in L1/L2. One launch instead of two (decode sizes)."""
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, numel, BLOCK):
        offs = start + lanes
        x = tl.load(x_ptr + _source_offsets(offs, N, x_stride, CONTIG), mask=offs < numel, other=0.0)
        acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
    scale = fp8_scale(tl.max(acc, axis=0), fp8_max, min_scale)
    tl.store(scale_ptr, scale)
    inv = tl.math.div_rn(1.0, scale)
    for start in range(0, numel, BLOCK):
        offs = start + lanes
        mask = offs < numel
        x = tl.load(x_ptr + _source_offsets(offs, N, x_stride, CONTIG), mask=mask, other=0.0)
        tl.store(q_ptr + offs, quantize(x.to(tl.float32), inv, fp8_max, q_ptr.dtype.element_ty), mask=mask)


def _flat_view(x: torch.Tensor) -> tuple[torch.Tensor, int, int, bool]:
    """(tensor to pass, row length N, row stride, contiguous?) for the flat-index kernels."""
    if x.is_contiguous():  # N and the stride only matter for non-contiguous rows
        return x, 1, 1, True
    rows = rows_or_copy(x)
    return rows, rows.shape[1], row_stride(rows), rows.is_contiguous()


def _per_tensor(x: torch.Tensor, scale: torch.Tensor | None, out_dtype: torch.dtype, fp8_max: float,
                min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    numel = x.numel()
    dynamic = scale is None
    if dynamic:
        scale = torch.empty(1, dtype=torch.float32, device=x.device)
    if numel == 0:
        if dynamic:
            scale.fill_(min_scale)
        return q, scale
    src, n, stride, contig = _flat_view(x)
    with launch_device(x):
        if dynamic and numel <= _SMALL_NUMEL:
            _per_tensor_small_kernel[(1,)](src, q, scale, numel, n, stride, fp8_max, min_scale,
                                           BLOCK=_SMALL_BLOCK, CONTIG=contig, num_warps=_SMALL_WARPS)
            return q, scale
        cfg = flat_config(x.device, numel)
        block, warps = cfg.block_n, cfg.num_warps
        num_tiles = triton.cdiv(numel, block)
        if dynamic:
            # Kernel 1 is persistent: each program keeps one running max over its tiles.
            amax_block = _AMAX_BLOCK
            amax_tiles = triton.cdiv(numel, amax_block)
            num_partials = min(amax_tiles, _PARTIALS_PER_SM * sm_count(x.device), _MAX_PARTIALS)
            partials = torch.empty(num_partials, dtype=torch.float32, device=x.device)
            _absmax_partials_kernel[(num_partials,)](src, partials, numel, n, stride, amax_tiles,
                                                     BLOCK=amax_block, CONTIG=contig, num_warps=_AMAX_WARPS)
        else:
            num_partials, partials = 1, scale
        _per_tensor_quant_kernel[(num_tiles,)](
            src, q, scale, partials, num_partials, numel, n, stride, fp8_max, min_scale,
            BLOCK=block, BLOCK_P=triton.next_power_of_2(num_partials), DYNAMIC=dynamic,
            CONTIG=contig, num_warps=warps)
    return q, scale


def static_scaled_fp8_quant(x: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
                            fp8_max: float) -> torch.Tensor:
    """Launcher for ``customop::static_scaled_fp8_quant`` (one-element ``scale``)."""
    if scale.numel() != 1:
        raise ValueError(f"static_scaled_fp8_quant: scale must have one element, got {tuple(scale.shape)}")
    return _per_tensor(x, scale, out_dtype, fp8_max, 0.0)[0]


def dynamic_scaled_fp8_quant(x: torch.Tensor, out_dtype: torch.dtype, fp8_max: float,
                             min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher for ``customop::dynamic_scaled_fp8_quant``: ``(q, scale [1])``."""
    return _per_tensor(x, None, out_dtype, fp8_max, min_scale)


# ---- per token (shared with the rms_norm fusion) ----------------------------------------------


@triton.jit
def _prequant(x, w, rstd, NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """The value that gets quantized, in fp32: x itself, or RMSNorm(x) rounded like the
    reference (normalise in fp32, round to the weight dtype, multiply there, round to x's)."""
    y = x.to(tl.float32)
    if NORM:
        y = y * rstd[:, None]
        if HAS_WEIGHT:
            y = (y.to(w.dtype).to(tl.float32) * w.to(tl.float32)).to(w.dtype)
        y = y.to(x.dtype).to(tl.float32)
    return y


@triton.jit
def row_quant_kernel(x_ptr, w_ptr, ub_ptr, q_ptr, scale_ptr, M, N, x_stride, eps, fp8_max, min_scale,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_PASS: tl.constexpr,
                     NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_UB: tl.constexpr):
    """Rows ``[pid*BLOCK_M, +BLOCK_M)``: (optionally RMSNorm then) dynamic per-token quant.
    ``ONE_PASS`` (``BLOCK_N >= N``): one read of each row, kept in registers. Otherwise the row
    goes through in ``BLOCK_N`` chunks: a sum-of-squares pass (NORM), an amax pass and a quantize
    pass (the re-reads mostly hit L2)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * N
    cols = tl.arange(0, BLOCK_N)
    q_dtype = q_ptr.dtype.element_ty
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if ONE_PASS:
        mask = row_ok[:, None] & (cols[None, :] < N)
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0)
        w = 0.0
        if NORM:
            xf = x.to(tl.float32)
            rstd = _rstd(tl.sum(xf * xf, axis=1), N, eps)
            if HAS_WEIGHT:
                # loaded as [1, BLOCK_N], the layout of x's rows: no shared-memory shuffle
                w = tl.load(w_ptr + cols[None, :], mask=cols[None, :] < N, other=0.0)
        y = _prequant(x, w, rstd, NORM, HAS_WEIGHT)
        amax = tl.max(tl.abs(y), axis=1)
    else:
        if NORM:
            sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
            for c0 in range(0, N, BLOCK_N):
                sq_mask = row_ok[:, None] & (c0 + cols[None, :] < N)
                xs = tl.load(x_rows + c0 + cols[None, :], mask=sq_mask, other=0.0).to(tl.float32)
                sumsq += tl.sum(xs * xs, axis=1)
            rstd = _rstd(sumsq, N, eps)
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for c0 in range(0, N, BLOCK_N):
            a_mask = row_ok[:, None] & (c0 + cols[None, :] < N)
            xa = tl.load(x_rows + c0 + cols[None, :], mask=a_mask, other=0.0)
            wa = 0.0
            if HAS_WEIGHT:
                wa = tl.load(w_ptr + c0 + cols[None, :], mask=c0 + cols[None, :] < N, other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(_prequant(xa, wa, rstd, NORM, HAS_WEIGHT)), axis=1))
    if HAS_UB:
        amax = tl.minimum(amax, tl.load(ub_ptr).to(tl.float32))
    scale = fp8_scale(amax, fp8_max, min_scale)
    tl.store(scale_ptr + rows, scale, mask=row_ok)
    inv = tl.math.div_rn(1.0, scale)[:, None]
    if ONE_PASS:
        tl.store(q_rows + cols[None, :], quantize(y, inv, fp8_max, q_dtype), mask=mask)
    else:
        for c0 in range(0, N, BLOCK_N):
            q_mask = row_ok[:, None] & (c0 + cols[None, :] < N)
            xq = tl.load(x_rows + c0 + cols[None, :], mask=q_mask, other=0.0)
            wq = 0.0
            if HAS_WEIGHT:
                wq = tl.load(w_ptr + c0 + cols[None, :], mask=c0 + cols[None, :] < N, other=0.0)
            yq = _prequant(xq, wq, rstd, NORM, HAS_WEIGHT)
            tl.store(q_rows + c0 + cols[None, :], quantize(yq, inv, fp8_max, q_dtype), mask=q_mask)


@triton.jit
def _rstd(sumsq, N, eps):
    """``1 / sqrt(mean + eps)`` with IEEE sqrt and division (what torch's CPU rsqrt computes; the
    mean cannot match torch's bits anyway: the sum runs in another order)."""
    return tl.math.div_rn(1.0, tl.math.sqrt_rn(sumsq / N + eps))


def row_quant(x: torch.Tensor, weight: torch.Tensor | None, eps: float, scale_ub: torch.Tensor | None,
              out_dtype: torch.dtype, fp8_max: float, min_scale: float,
              norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocates ``q`` (x's shape) and ``scale`` (``x.shape[:-1] + (1,)``) and launches
    ``row_quant_kernel``."""
    # the schema's own check and message, before any early return (an empty x included)
    _library_quant._check_scale_ub("rms_norm_dynamic_per_token_fp8_quant" if norm
                                   else "dynamic_per_token_scaled_fp8_quant", scale_ub)
    q = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    scale = torch.empty(tuple(x.shape[:-1]) + (1,), dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return q, scale
    rows = rows_or_copy(x)
    m, n = rows.shape
    cfg = row_config(x.device, m, n, quant=True)
    with launch_device(x):
        row_quant_kernel[(triton.cdiv(m, cfg.block_m),)](
            rows, weight if weight is not None else rows, scale_ub if scale_ub is not None else rows,
            q, scale, m, n, row_stride(rows), eps, fp8_max, min_scale,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, ONE_PASS=cfg.single_tile, NORM=norm,
            HAS_WEIGHT=weight is not None, HAS_UB=scale_ub is not None, **cfg.launch_options)
    return q, scale


def dynamic_per_token_scaled_fp8_quant(x: torch.Tensor, scale_ub: torch.Tensor | None, out_dtype: torch.dtype,
                                       fp8_max: float, min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher for ``customop::dynamic_per_token_scaled_fp8_quant``: ``(q, scale [T, 1])``."""
    return row_quant(x, None, 0.0, scale_ub, out_dtype, fp8_max, min_scale, norm=False)


# ---- per token group --------------------------------------------------------------------------


@triton.jit
def _group_quant_kernel(x_ptr, q_ptr, scale_ptr, groups_per_row, chunks_per_row, N, x_stride, tokens,
                        fp8_max, min_scale, G: tl.constexpr, BLOCK_G: tl.constexpr,
                        GROUPS: tl.constexpr, COLUMN_MAJOR: tl.constexpr, UE8M0: tl.constexpr):
    """Groups ``[c * GROUPS, (c + 1) * GROUPS)`` of one row, as a ``[GROUPS, BLOCK_G]`` tile; programs
    go row-major (chunk fastest), and the only divisions are one per program, on scalars."""
    pid = tl.program_id(0)
    row = (pid // chunks_per_row).to(tl.int64)
    j = (pid % chunks_per_row) * GROUPS + tl.arange(0, GROUPS)
    lane = tl.arange(0, BLOCK_G)
    cols = j[:, None] * G + lane[None, :]
    group_ok = j < groups_per_row
    mask = group_ok[:, None] & (lane[None, :] < G) & (cols < N)
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    scale = fp8_scale(tl.max(tl.abs(x), axis=1), fp8_max, min_scale)
    if UE8M0:
        scale = _pow2_ceil(scale)
    inv = tl.math.div_rn(1.0, scale)[:, None]
    quotient = x * inv
    if not UE8M0:  # x * inv is exact for a power-of-two scale; else one correction step
        quotient = tl.fma(tl.fma(-quotient, scale[:, None], x), inv, quotient)
    q = tl.clamp(quotient, -fp8_max, fp8_max).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + row * N + cols, q, mask=mask)
    if COLUMN_MAJOR:  # a [..., groups_per_row, tokens] buffer; rows flatten (batch, token)
        scale_offs = ((row // tokens) * groups_per_row + j) * tokens + row % tokens
    else:
        scale_offs = row * groups_per_row + j
    tl.store(scale_ptr + scale_offs, scale, mask=group_ok)


def per_token_group_fp8_quant(x: torch.Tensor, group_size: int, column_major_scales: bool, use_ue8m0: bool,
                              out_dtype: torch.dtype, fp8_max: float,
                              min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher for ``customop::per_token_group_fp8_quant``: ``(q, scales [..., T, ceil(H/G)])``,
    column-major scales as a ``[..., H/G, T]`` buffer transposed (the reference's layout)."""
    if group_size < 1 or x.dim() < 2:
        raise ValueError(f"per_token_group_fp8_quant: x {tuple(x.shape)} must be [..., T, H], group_size >= 1")
    hidden, tokens = x.shape[-1], x.shape[-2]
    groups_per_row = triton.cdiv(hidden, group_size)
    q = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if column_major_scales:
        scales = torch.empty(tuple(x.shape[:-2]) + (groups_per_row, tokens), dtype=torch.float32,
                             device=x.device).transpose(-2, -1)
    else:
        scales = torch.empty(tuple(x.shape[:-1]) + (groups_per_row,), dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return q, scales
    rows = rows_or_copy(x)
    block_g = triton.next_power_of_2(group_size)
    cfg = group_config(x.device, rows.shape[0], groups_per_row, block_g)
    groups, warps = cfg.block_m, cfg.num_warps
    chunks = triton.cdiv(groups_per_row, groups)
    with launch_device(x):
        _group_quant_kernel[(rows.shape[0] * chunks,)](
            rows, q, scales, groups_per_row, chunks, hidden, row_stride(rows), max(tokens, 1),
            fp8_max, min_scale, G=group_size, BLOCK_G=block_g, GROUPS=groups,
            COLUMN_MAJOR=bool(column_major_scales), UE8M0=bool(use_ue8m0), num_warps=warps)
    return q, scales


KERNELS = {
    "customop::static_scaled_fp8_quant": static_scaled_fp8_quant,
    "customop::dynamic_scaled_fp8_quant": dynamic_scaled_fp8_quant,
    "customop::dynamic_per_token_scaled_fp8_quant": dynamic_per_token_scaled_fp8_quant,
    "customop::per_token_group_fp8_quant": per_token_group_fp8_quant,
}
#: which _tuning table each op reads (the benchmark runner's --sweep times its alternatives)
#: (the row kernel has no persistent grid: its sweep leaves programs_per_sm out)
ROW_SWEEP = tuple({"num_warps": w} for w in (2, 4, 8, 16)) + ({"block_m": 2}, {"num_warps": 16, "maxnreg": 32})
TUNING = {"customop::static_scaled_fp8_quant": "flat", "customop::dynamic_scaled_fp8_quant": "flat",
          "customop::dynamic_per_token_scaled_fp8_quant": ("rows", ROW_SWEEP),
          "customop::per_token_group_fp8_quant": "group"}
