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

The ``@triton.jit`` kernels, their helpers and the norm kinds are in ``_layernorm_kernels``, whose
every name this module re-exports (the launchers look the kernel up through them: a test patches
``layernorm._norm_kernel``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from customop.backends.triton import _tuning
from customop.backends.triton._common import as_rows, device_guard, row_stride, silu_or_sigmoid  # noqa: F401
from customop.backends.triton._layernorm_kernels import (  # noqa: F401  (the kernels and helpers re-exported)
    GEMMA, LAYER, NEMOTRON, NO_GATE, RMS, RMS_FP32, SIGMOID_GATE, SILU_GATE, _add_residual, _gated_out, _load,
    _load_affine, _norm_block, _norm_kernel, _norm_looped_row, _residual_out, _round_to, _store, _weighted,
)

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
