"""Triton launchers of the activations, and the module the backends register (``KERNELS``) and the
benchmark runner reads (``TUNING``): the gated ``*_and_mul`` family (gate and up read in one pass;
silu_and_mul_with_clamp and situ_and_mul too), gelu_and_mul_sparse (row statistics of the gate),
the interleaved GPT-OSS SwiGLU, and the elementwise GELU variants, relu2 and xIELU.

The ``@triton.jit`` kernels, their helpers and the activation codes are in ``_activation_kernels``;
this module re-exports every name of it (``activation._and_mul_kernel``, ``activation.SILU``, ...),
and the launchers look the kernels up through these names: a test patches ``activation.X``.
Outputs are new contiguous tensors. Tiles come from ``_tuning`` (``tile`` for the gated ops,
``flat`` for the elementwise ones, ``rows`` for the sparse one).
"""

from __future__ import annotations

import functools
import math
import struct

import torch
import triton
import triton.language as tl

from customop.backends.triton import _tuning
from customop.backends.triton._activation_kernels import (  # noqa: F401  (the helpers re-exported)
    _DEVICE_TANH, _GELU_FAST_C, _SQRT_2_OVER_PI, FATRELU, GELU, GELU_FAST, GELU_NEW, GELU_TANH, QUICK_GELU, RELU2,
    SILU, SILU_CLAMP, SITU, SITU_LINEAR, SWIGLUSTEP, XIELU, _and_mul_kernel, _copysign, _device_tanh, _gate_act,
    _gelu_sparse_kernel, _swigluoai_kernel, _tanh_approx, _tile_index, _unary_kernel, libdevice,
)
from customop.backends.triton._common import (  # noqa: F401  (the kernels' helpers re-exported)
    GRID_YZ_MAX, INTERPRETED, NEG_LOG2E, as_rows, device_guard, expm1_neg, gelu_erf, mul_sigmoid, row_stride, silu,
)
from customop.backends.triton._common import gelu_tanh as tanh_gelu  # noqa: F401  (gelu_tanh: the launcher below)

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
