"""Triton kernels of the activations: the gated ``*_and_mul`` family (gate and up read in one
pass; silu_and_mul_with_clamp and situ_and_mul too), gelu_and_mul_sparse (row statistics of the
gate), the interleaved GPT-OSS SwiGLU, and the elementwise GELU variants, relu2 and xIELU.

All math is fp32 with a single cast of the result (the native spec rounds after every op in the
input dtype; one rounding is closer to the exact value). Outputs are new contiguous tensors.
Tiles come from ``_tuning`` (``tile`` for the gated ops, ``flat`` for the elementwise ones,
``rows`` for the sparse one).
"""

from __future__ import annotations

import functools
import math
import struct

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from customop.backends.triton import _tuning
from customop.backends.triton._common import (
    GRID_YZ_MAX, INTERPRETED, NEG_LOG2E, as_rows, device_guard, expm1_neg, gelu_erf, mul_sigmoid, row_stride, silu,
)
from customop.backends.triton._common import gelu_tanh as tanh_gelu  # gelu_tanh: the launcher below

# Activation codes (the kernels' ACT constexpr). Globals read inside @triton.jit code must be
# tl.constexpr objects; launchers pass ``.value``.
SILU, GELU, GELU_TANH, FATRELU, SWIGLUSTEP = (tl.constexpr(i) for i in range(5))
# situ_and_mul without / with linear_beta: two codes, so that the kernel needs no extra flag
SILU_CLAMP, SITU, SITU_LINEAR = (tl.constexpr(i) for i in range(5, 8))
GELU_NEW, GELU_FAST, QUICK_GELU, RELU2, XIELU = (tl.constexpr(i) for i in range(10, 15))

_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_GELU_FAST_C = tl.constexpr(0.7978845608)  # gelu_fast's spec inlines the constant with 10 digits


#: situ's tanh: the device library's when compiled for a GPU, a portable form under the
#: interpreter (which has no libdevice)
_DEVICE_TANH = tl.constexpr(not INTERPRETED)


@triton.jit
def _tanh_approx(x):
    # the hardware tanh (MUFU.TANH, sm_75+): relative error <= 2**-10.99 (PTX ISA), 1/8 of a
    # bf16 ulp; only bf16 outputs on NVIDIA GPUs use it (the launcher's FAST_TANH)
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _device_tanh(x, FAST_TANH: tl.constexpr):
    if FAST_TANH:
        return _tanh_approx(x)
    else:
        return libdevice.tanh(x)


@triton.jit
def _copysign(mag, sgn):
    # |mag| with sgn's sign: one bit-select (LOP3 on NVIDIA) where a compare, a negation and a
    # select would be three. (mag is fp32 on the GPU; the interpreter makes a python-float
    # parameter outside fp32's normal range fp64, hence the cast.)
    bits = mag.to(tl.float32).to(tl.uint32, bitcast=True) & 0x7FFFFFFF
    return (bits | (sgn.to(tl.uint32, bitcast=True) & 0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def _tile_index(d, BLOCK_N: tl.constexpr, GRID2D: tl.constexpr):
    # (row block, column block) of this program: the grid's two axes, or a flat row-major index
    if GRID2D:
        return tl.program_id(1), tl.program_id(0)
    pid = tl.program_id(0)
    col_blocks = tl.cdiv(d, BLOCK_N)
    return pid // col_blocks, pid % col_blocks


@triton.jit
def _gate_act(a, param, ACT: tl.constexpr):
    # param: fatrelu's threshold or swiglustep's limit
    if ACT == SILU:
        return silu(a)
    elif ACT == GELU:
        return gelu_erf(a)
    elif ACT == GELU_TANH:
        return tanh_gelu(a, _SQRT_2_OVER_PI)
    elif ACT == SWIGLUSTEP:
        return tl.minimum(silu(a), param)
    else:  # FATRELU
        return tl.where(a > param, a, 0.0)


@triton.jit
def _and_mul_kernel(
    x_ptr, out_ptr, n_rows, d, x_stride, out_stride, gate_offset, up_offset, param, param2, param3, param4,
    ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN: tl.constexpr = False, INT64: tl.constexpr = True, EVICT: tl.constexpr = "evict_first",
    GRID2D: tl.constexpr = False, WIDTH: tl.constexpr = 0, FAST_TANH: tl.constexpr = False,
):
    # param: fatrelu's threshold, swiglustep's and silu_and_mul_with_clamp's limit, situ's beta;
    # param2: silu_and_mul_with_clamp's alpha, situ's 1 / beta; param3: silu_and_mul_with_clamp's
    # beta, situ's linear_beta; param4: situ's 1 / linear_beta (the reciprocals: _fp32_reciprocal)
    # tiles of the [n_rows, d] output, row-major (column block fastest): the programs in flight
    # read one contiguous stretch of x and write one of out, as a flat copy does. EVEN: the tile
    # divides the output (no bounds checks); INT64: 64-bit offsets (the host picks 32-bit when
    # every offset fits); EVICT: x's eviction policy ("" for none); WIDTH > 0: d, with x's and
    # out's rows packed (strides 2d and d), as compile-time constants (one kernel per width);
    # FAST_TANH: situ's tanh is the hardware approximation (bf16 outputs on NVIDIA GPUs).
    if WIDTH > 0:
        width: tl.constexpr = WIDTH
        x_row_stride: tl.constexpr = 2 * WIDTH
        out_row_stride: tl.constexpr = WIDTH
    else:
        width = d
        x_row_stride = x_stride
        out_row_stride = out_stride
    row_block, col_block = _tile_index(width, BLOCK_N, GRID2D)
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    if INT64:
        rows = rows.to(tl.int64)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < width)[None, :]
    x_row = x_ptr + rows[:, None] * x_row_stride + cols[None, :]
    if EVEN:
        a = tl.load(x_row + gate_offset, eviction_policy=EVICT).to(tl.float32)
        b = tl.load(x_row + up_offset, eviction_policy=EVICT).to(tl.float32)
    else:
        a = tl.load(x_row + gate_offset, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
        b = tl.load(x_row + up_offset, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    if ACT == SILU_CLAMP:
        g = tl.minimum(a, param)
        y = mul_sigmoid(g, g, param2) * (tl.minimum(tl.maximum(b, -param), param) + param3)
    elif ACT == SITU or ACT == SITU_LINEAR:
        # beta tanh(a / beta) sigmoid(a) [times linear_beta tanh(b / linear_beta)], with a / beta
        # a product with the host's 1 / beta (as Inductor's code has it: within ~1.5 fp32 ulp of
        # the quotient; tanh's condition number is below 1, so tanh moves by no more). The gate
        # (|beta tanh sigmoid| <= |beta|) is formed before b multiplies it, as in the spec, so a
        # large b with a small sigmoid does not overflow on the way.
        if _DEVICE_TANH:
            # compiled for a GPU: the device library's tanh (CUDA's tanhf, <= 2 ulp; the function
            # Inductor's code calls) or, for bf16 outputs on NVIDIA, the hardware tanh (one
            # special-function op where tanhf costs two and a dozen others: the kernel was bound
            # by them, H200 BENCHMARKS.md); sigmoid's division is Triton's approximate `/`
            # (div.full.f32: <= 2 ulp, 1 / inf is 0). The interpreter has no libdevice and no
            # inline assembly: CI runs the portable form below, the H200 tier (tests/gpu) checks
            # these against float64.
            g = param * _device_tanh(a * param2, FAST_TANH)
            if ACT == SITU_LINEAR:
                b = param3 * _device_tanh(b * param4, FAST_TANH)
            y = g / (1.0 + tl.exp2(a * NEG_LOG2E)) * b
        else:
            # portable: tanh(|v|) = -m / (2 + m) with m = expm1(-2 |v|) in [-1, 0] (no
            # cancellation near 0), and the denominators of tanh (2 + m, in [1, 2]) and sigmoid
            # (1 + exp(-a)) multiplied into one, divided once; beta tanh(a / beta) is odd in a and
            # even in beta: |beta| tanh(|a / beta|), then a's sign (_copysign).
            m = expm1_neg(tl.abs(a) * (-2.0 * tl.abs(param2)))
            den = (2.0 + m) * (1.0 + tl.exp2(a * NEG_LOG2E))
            if ACT == SITU_LINEAR:
                m_up = expm1_neg(tl.abs(b) * (-2.0 * tl.abs(param4)))
                b = _copysign(-tl.abs(param3) * m_up, b)
                den = den * (2.0 + m_up)
            y = _copysign(-tl.abs(param) * m / den, a) * b
    else:
        if ACT == SWIGLUSTEP:
            b = tl.minimum(tl.maximum(b, -param), param)
        y = _gate_act(a, param, ACT) * b
    if EVEN:
        tl.store(out_ptr + rows[:, None] * out_row_stride + cols[None, :], y.to(out_ptr.dtype.element_ty))
    else:
        tl.store(out_ptr + rows[:, None] * out_row_stride + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swigluoai_kernel(
    x_ptr, out_ptr, n_rows, d, x_stride, out_stride, alpha, limit,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr = False, INT64: tl.constexpr = True,
    EVICT: tl.constexpr = "evict_first", GRID2D: tl.constexpr = False,
):
    # Interleaved lanes: one contiguous load of 2 * BLOCK_N lanes per row (16-byte accesses; a
    # [rows, cols, 2] pointer tile would not vectorise), then a register-local split into pairs.
    # Tiles go row-major, as in _and_mul_kernel. INT64 and EVICT as there; EVEN is not used (the masks stay).
    row_block, col_block = _tile_index(d, BLOCK_N, GRID2D)
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    if INT64:
        rows = rows.to(tl.int64)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    lanes = 2 * col_block * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
    row_mask = (rows < n_rows)[:, None]
    gu = tl.load(x_ptr + rows[:, None] * x_stride + lanes[None, :], mask=row_mask & (lanes < 2 * d)[None, :],
                 other=0.0, eviction_policy=EVICT).to(tl.float32)
    g, u = tl.split(tl.reshape(gu, [BLOCK_M, BLOCK_N, 2]))
    mask = row_mask & (cols < d)[None, :]
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    y = (u + 1.0) * mul_sigmoid(g, g, alpha)
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_sparse_kernel(
    x_ptr, out_ptr, n_rows, d, x_stride, out_stride, std_multiplier,
    APPROX_TANH: tl.constexpr, SINGLE_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    if SINGLE_TILE:
        rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = tl.arange(0, BLOCK_N)
        mask = (rows < n_rows)[:, None] & (cols < d)[None, :]
        x_row = x_ptr + rows[:, None] * x_stride + cols[None, :]
        # both halves are requested before the reductions, so their latencies overlap
        a = tl.load(x_row, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        b = tl.load(x_row + d, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        mean = tl.sum(a, axis=1) / d
        centred = tl.where(mask, a - mean[:, None], 0.0)
        std = tl.sqrt(tl.sum(centred * centred, axis=1) / d)
        cutoff = (mean + std * std_multiplier)[:, None]
        h = tl.maximum(a - cutoff, 0.0)
        g = tanh_gelu(h, _SQRT_2_OVER_PI) if APPROX_TANH else gelu_erf(h)
        tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], (g * b).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # One row per program. Pass 1 merges per-chunk (count, mean, M2) (Chan et al.), which
        # stays accurate when the mean is large next to the spread.
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * x_stride
        count = tl.zeros([1], dtype=tl.float32)
        mean = tl.zeros([1], dtype=tl.float32)
        m2 = tl.zeros([1], dtype=tl.float32)
        for start in range(0, d, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < d
            a = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            n_chunk = tl.minimum(d - start, BLOCK_N).to(tl.float32)
            chunk_mean = tl.sum(a, axis=0) / n_chunk
            chunk_m2 = tl.sum(tl.where(mask, (a - chunk_mean) * (a - chunk_mean), 0.0), axis=0)
            total = count + n_chunk
            delta = chunk_mean - mean
            mean += delta * (n_chunk / total)
            m2 += chunk_m2 + delta * delta * (count * n_chunk / total)
            count = total
        cutoff = mean + tl.sqrt(m2 / d) * std_multiplier
        for start in range(0, d, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < d
            a = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            b = tl.load(x_row + d + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            h = tl.maximum(a - cutoff, 0.0)
            g = tanh_gelu(h, _SQRT_2_OVER_PI) if APPROX_TANH else gelu_erf(h)
            tl.store(out_ptr + row * out_stride + cols, (g * b).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _unary_kernel(
    x_ptr, out_ptr, numel, alpha_p_ptr, alpha_n_ptr, beta, eps,
    ACT: tl.constexpr, BLOCK: tl.constexpr,
    EVEN: tl.constexpr = False, INT64: tl.constexpr = True, EVICT: tl.constexpr = "evict_first",
):
    # EVEN: BLOCK divides numel (no bounds checks); INT64: 64-bit offsets (the host picks 32-bit
    # when every offset fits); EVICT: x's eviction policy ("" for none)
    start = tl.program_id(0) * BLOCK
    if INT64:
        start = start.to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < numel - start
    if EVEN:
        x = tl.load(x_ptr + start + offs, eviction_policy=EVICT).to(tl.float32)
    else:
        x = tl.load(x_ptr + start + offs, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    if ACT == GELU:
        y = gelu_erf(x)
    elif ACT == GELU_NEW or ACT == GELU_TANH:  # the same formula: gelu_tanh rounds once, as this does
        y = tanh_gelu(x, _SQRT_2_OVER_PI)
    elif ACT == GELU_FAST:
        y = tanh_gelu(x, _GELU_FAST_C)
    elif ACT == QUICK_GELU:
        y = mul_sigmoid(x, x, 1.702)
    elif ACT == RELU2:
        r = tl.maximum(x, 0.0)
        y = r * r
    else:  # XIELU; the spec rounds alpha_p / alpha_n to x's dtype first
        x_dtype = x_ptr.dtype.element_ty
        alpha_p = tl.load(alpha_p_ptr).to(x_dtype).to(tl.float32)
        alpha_n = tl.load(alpha_n_ptr).to(x_dtype).to(tl.float32)
        negative = (expm1_neg(tl.minimum(x, eps)) - x) * alpha_n + beta * x
        y = tl.where(x > 0.0, alpha_p * x * x + beta * x, negative)
    if EVEN:
        tl.store(out_ptr + start + offs, y.to(out_ptr.dtype.element_ty))
    else:
        tl.store(out_ptr + start + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


# ---- launchers --------------------------------------------------------------------------------


def _gated_io(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output, input rows view, output rows view) of a gated op."""
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    rows = as_rows(x)
    if rows is None:
        rows = x.contiguous().view(-1, x.shape[-1])
    return out, rows, out.view(-1, d)


#: the gated activations measured faster in _tuning's streaming tile (H200, 2026-12-02, 4096 and
#: 32768 x 2 x 14336: silu / mul_and_silu / fatrelu 0.94-0.95x -> 1.00x compile, gelu tanh 0.95x
#: -> 1.02x); erf (compute-bound there) and swigluoai (87.0 -> 89.1 us at 4096) were slower in it,
#: the clamp / situ / swiglustep codes were not measured: they keep the mid-size tile
_STREAMING_TILE_ACTS = frozenset(code.value for code in (SILU, FATRELU, GELU_TANH))
#: the activations bound by the special-function units (two tanh and a sigmoid per element):
#: _tuning's compute-bound tile (TILE_TABLE's ``compute_elems_per_warp``), unless FAST_TANH
#: (one special-function op per tanh) makes them streaming ops like silu's, with a constant width
_COMPUTE_BOUND_ACTS = frozenset(code.value for code in (SITU, SITU_LINEAR))


def _tile_class(kernel, constexprs: dict) -> dict[str, bool]:
    """Which of _tuning's tiles a gated launch takes (tile_config's keyword arguments)."""
    if kernel is not _and_mul_kernel:
        return {"streaming_class": False}
    act = constexprs["ACT"]
    if act in _COMPUTE_BOUND_ACTS:
        if constexprs.get("FAST_TANH"):
            return {"streaming_class": True, "const_width": True}
        return {"streaming_class": False, "compute_bound": True}
    return {"streaming_class": act in _STREAMING_TILE_ACTS}


#: the row blocks of a 2-D tile grid ride the grid's second axis (a module name: tests patch it)
_GRID_Y = GRID_YZ_MAX


def _launch_tiles(kernel, x: torch.Tensor, config: _tuning.TileConfig | None, *args, **constexprs) -> torch.Tensor:
    """A gated op's launch over ``[n_rows, d]`` output tiles: ``kernel(rows, out_rows, n_rows, d,
    x_stride, out_stride, *args, **constexprs, BLOCK_M, BLOCK_N)`` in row-major tile order."""
    out, rows, out_rows = _gated_io(x)
    n_rows, d = out_rows.shape
    if out.numel() == 0:
        return out
    cfg = config or _tuning.tile_config(x.device, n_rows, d, **_tile_class(kernel, constexprs))
    row_blocks, col_blocks = triton.cdiv(n_rows, cfg.block_m), triton.cdiv(d, cfg.block_n)
    x_stride = row_stride(rows)
    # the width compiled in (packed rows only): the flat grid then (TileConfig.grid2d says why)
    const_width = cfg.const_width and x_stride == 2 * d and kernel is _and_mul_kernel
    grid2d = cfg.grid2d and not const_width and row_blocks <= _GRID_Y
    grid = (col_blocks, row_blocks) if grid2d else (row_blocks * col_blocks,)
    # 32-bit offsets when the furthest lane of the padded last tile fits (x's row holds both
    # halves: 2 * the padded width covers the gate / up offsets and swigluoai's lane pairs)
    padded_rows, padded_cols = row_blocks * cfg.block_m, col_blocks * cfg.block_n
    fits = max((padded_rows - 1) * x_stride + 2 * padded_cols, (padded_rows - 1) * d + padded_cols) <= 2**31
    with device_guard(x.device):
        kernel[grid](rows, out_rows, n_rows, d, x_stride, d, *args, **constexprs,
                     BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
                     EVEN=cfg.even and n_rows % cfg.block_m == 0 and d % cfg.block_n == 0,
                     INT64=not (cfg.int32 and fits), EVICT=cfg.eviction_policy, GRID2D=grid2d,
                     **({"WIDTH": d} if const_width else {}))
    return out


def _and_mul(x: torch.Tensor, act: tl.constexpr, param: float = 0.0, gate_second: bool = False,
             config: _tuning.TileConfig | None = None, param2: float = 0.0, param3: float = 0.0,
             param4: float = 0.0, **constexprs) -> torch.Tensor:
    d = x.shape[-1] // 2
    gate_offset, up_offset = (d, 0) if gate_second else (0, d)
    return _launch_tiles(_and_mul_kernel, x, config, gate_offset, up_offset, param, param2, param3, param4,
                         ACT=act.value, **constexprs)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _and_mul(x, SILU)


def mul_and_silu(x: torch.Tensor) -> torch.Tensor:
    return _and_mul(x, SILU, gate_second=True)


def _gelu_code(approximate: str) -> tl.constexpr:
    if approximate not in ("none", "tanh"):
        raise ValueError(f"customop::gelu_and_mul: approximate must be 'none' or 'tanh', got {approximate!r}")
    return GELU_TANH if approximate == "tanh" else GELU


def gelu_and_mul(x: torch.Tensor, approximate: str) -> torch.Tensor:
    return _and_mul(x, _gelu_code(approximate))


def fatrelu_and_mul(x: torch.Tensor, threshold: float) -> torch.Tensor:
    return _and_mul(x, FATRELU, param=threshold)


def swiglustep_and_mul(x: torch.Tensor, limit: float) -> torch.Tensor:
    return _and_mul(x, SWIGLUSTEP, param=limit)


def silu_and_mul_with_clamp(x: torch.Tensor, swiglu_limit: float, alpha: float, beta: float,
                            config: _tuning.TileConfig | None = None) -> torch.Tensor:
    return _and_mul(x, SILU_CLAMP, param=swiglu_limit, param2=alpha, param3=beta, config=config)


_FLT_MAX = float(torch.finfo(torch.float32).max)


@functools.lru_cache(maxsize=64)
def _fp32_reciprocal(p: float) -> float:
    """1 / p for a kernel whose p arrives as an fp32 argument: the reciprocal of p rounded to
    fp32, kept within +-FLT_MAX / 2. A subnormal p's reciprocal (inf in fp32) becomes that
    bound, so a / p of a = 0 is 0 (not 0 * inf = NaN) and any normal a saturates tanh, as the
    quotient does; the halving keeps the portable form's -2 / |p| finite."""
    p32 = struct.unpack("f", struct.pack("f", p))[0]
    if p32 == 0.0:
        return math.copysign(_FLT_MAX / 2, p)
    return math.copysign(min(abs(1.0 / p32), _FLT_MAX / 2), p32)


def _fast_tanh(x: torch.Tensor) -> bool:
    """Whether situ's tanh may be the hardware approximation: bf16 outputs (its error is 1/8 of
    their ulp; fp16's ulp is 8x finer) on an NVIDIA GPU (inline PTX)."""
    return x.dtype == torch.bfloat16 and x.device.type == "cuda" and torch.version.hip is None


def situ_and_mul(x: torch.Tensor, beta: float, linear_beta: float | None,
                 config: _tuning.TileConfig | None = None) -> torch.Tensor:
    act, up = (SITU, 1.0) if linear_beta is None else (SITU_LINEAR, linear_beta)
    return _and_mul(x, act, param=beta, param2=_fp32_reciprocal(beta), param3=up, param4=_fp32_reciprocal(up),
                    config=config, FAST_TANH=_fast_tanh(x))


def swigluoai_and_mul(x: torch.Tensor, alpha: float, limit: float,
                      config: _tuning.TileConfig | None = None) -> torch.Tensor:
    return _launch_tiles(_swigluoai_kernel, x, config, alpha, limit)


def gelu_and_mul_sparse(x: torch.Tensor, std_multiplier: float, approximate: str,
                        config: _tuning.RowConfig | None = None) -> torch.Tensor:
    tanh = _gelu_code(approximate) is GELU_TANH
    out, rows, out_rows = _gated_io(x)
    n_rows, d = out_rows.shape
    if out.numel() == 0:
        return out
    cfg = config or _tuning.row_config(x.device, n_rows, d)
    grid = (triton.cdiv(n_rows, cfg.block_m) if cfg.single_tile else n_rows,)
    with device_guard(x.device):
        _gelu_sparse_kernel[grid](rows, out_rows, n_rows, d, row_stride(rows), d, std_multiplier,
                                  APPROX_TANH=tanh, SINGLE_TILE=cfg.single_tile,
                                  BLOCK_M=cfg.block_m if cfg.single_tile else 1, BLOCK_N=cfg.block_n,
                                  **cfg.launch_options)
    return out


def _unary(x: torch.Tensor, act: tl.constexpr, alpha_p: torch.Tensor | None = None, alpha_n: torch.Tensor | None = None,
           beta: float = 0.0, eps: float = 0.0, config: _tuning.TileConfig | None = None,
           light: bool = False) -> torch.Tensor:
    xc = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    numel = out.numel()
    if numel == 0:
        return out
    cfg = config or _tuning.flat_config(x.device, numel, unary=True, light=light)
    p = alpha_p if alpha_p is not None else xc
    n = alpha_n if alpha_n is not None else xc
    blocks = triton.cdiv(numel, cfg.block_n)
    with device_guard(x.device):
        _unary_kernel[(blocks,)](xc, out, numel, p, n, beta, eps, ACT=act.value, BLOCK=cfg.block_n,
                                 EVEN=cfg.even and numel % cfg.block_n == 0,
                                 INT64=not (cfg.int32 and blocks * cfg.block_n <= 2**31),
                                 EVICT=cfg.eviction_policy, num_warps=cfg.num_warps)
    return out


def gelu(x: torch.Tensor) -> torch.Tensor:
    return _unary(x, GELU)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return _unary(x, GELU_TANH)


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    return _unary(x, GELU_NEW)


def gelu_fast(x: torch.Tensor) -> torch.Tensor:
    return _unary(x, GELU_FAST)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return _unary(x, QUICK_GELU)


def relu2(x: torch.Tensor) -> torch.Tensor:
    return _unary(x, RELU2, light=True)


def xielu(x: torch.Tensor, alpha_p: torch.Tensor, alpha_n: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    return _unary(x, XIELU, alpha_p, alpha_n, beta, eps)


KERNELS = {
    "customop::silu_and_mul": silu_and_mul,
    "customop::mul_and_silu": mul_and_silu,
    "customop::gelu_and_mul": gelu_and_mul,
    "customop::gelu_and_mul_sparse": gelu_and_mul_sparse,
    "customop::fatrelu_and_mul": fatrelu_and_mul,
    "customop::swigluoai_and_mul": swigluoai_and_mul,
    "customop::swiglustep_and_mul": swiglustep_and_mul,
    "customop::silu_and_mul_with_clamp": silu_and_mul_with_clamp,
    "customop::situ_and_mul": situ_and_mul,
    "customop::gelu": gelu,
    "customop::gelu_tanh": gelu_tanh,
    "customop::gelu_new": gelu_new,
    "customop::gelu_fast": gelu_fast,
    "customop::quick_gelu": quick_gelu,
    "customop::relu2": relu2,
    "customop::xielu": xielu,
}

#: which _tuning config kind each op's kernel reads (for the benchmark runner's --sweep)
TUNING = {name: "tile" for name in KERNELS}
#: (the sparse kernel has no persistent grid)
_SPARSE_SWEEP = tuple({"num_warps": w} for w in (8, 16, 32)) + ({"block_m": 2}, {"num_warps": 16, "maxnreg": 64})
TUNING.update({"customop::gelu_and_mul_sparse": ("rows", _SPARSE_SWEEP), **{f"customop::{n}": "flat" for n in
               ("gelu", "gelu_tanh", "gelu_new", "gelu_fast", "quick_gelu", "relu2", "xielu")}})
