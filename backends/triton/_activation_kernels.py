"""Triton kernels of the activations (the ``@triton.jit`` code; their launchers, ``KERNELS`` and
``TUNING`` are in ``activation``): the gated ``*_and_mul`` tile kernel (gate and up read in one
pass; silu_and_mul_with_clamp and situ_and_mul too), gelu_and_mul_sparse's row kernel (row
statistics of the gate), the interleaved GPT-OSS SwiGLU, and the elementwise kernel of the GELU
variants, relu2 and xIELU, with the activation codes and the ``@triton.jit`` helpers they call.

All math is fp32 with a single cast of the result (the native spec rounds after every op in the
input dtype; one rounding is closer to the exact value). ``activation`` re-exports every name here,
and its launchers look the kernels up through its own names (a test patches ``activation.X``).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from customop.backends.triton._common import INTERPRETED, NEG_LOG2E, expm1_neg, gelu_erf, mul_sigmoid, silu
from customop.backends.triton._common import gelu_tanh as tanh_gelu  # gelu_tanh: activation's launcher

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
