"""What every Pallas kernel here shares: the interpret-mode decision, the TPU tiling rule and the
row-block choice.

The TPU tiling rule: the last two block dims are multiples of (8, 128) or equal to the array's
dims. The kernels block over rows and keep the last dims whole (always legal), so the main tiling
choice is the number of rows per block; only the gated activations also split columns, in
multiples of 128.
"""

from __future__ import annotations

import os

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

INTERPRET_ENV = "CUSTOMOP_PALLAS_INTERPRET"

#: VMEM the blocks of one grid step may use (inputs and outputs are double-buffered by Pallas).
#: 4 MiB stays well inside the smallest default scoped VMEM limit (16 MiB on v5e).
VMEM_BLOCK_BUDGET = 4 * 1024 * 1024
#: Default row blocks are multiples of 32 so that fp32 (8 rows per vreg tile), bf16 (16) and fp8
#: (32) tiles are all full; a user-given block only has to meet the lowering rule (8).
ROW_ALIGN = 32
MAX_BLOCK_ROWS = 512


def use_interpret(torch_xla_device: bool = False) -> bool:
    """The one place that decides Pallas interpret mode.

    ``CUSTOMOP_PALLAS_INTERPRET=1``/``0`` wins; otherwise interpret unless the XLA device is a TPU:
    torch_xla's device for the torch bridge (``torch_xla_device=True``), else JAX's default
    backend. The JAX side never asks torch_xla: that would start torch_xla's runtime, which
    claims the TPU before JAX can. Mosaic (``interpret=False``) only runs on a TPU (elsewhere
    Pallas raises "Only interpret mode is supported on CPU backend")."""
    env = os.environ.get(INTERPRET_ENV, "").strip()
    if env:
        if env not in ("0", "1"):
            raise ValueError(f"{INTERPRET_ENV} must be 0 or 1, got {env!r}")
        return env == "1"
    if torch_xla_device:
        import torch_xla.runtime as xr

        return xr.device_type() != "TPU"
    return jax.default_backend() != "tpu"


def resolve_interpret(interpret: bool | None) -> bool:
    return use_interpret() if interpret is None else bool(interpret)


def row_block(op: str, rows: int, bytes_per_row: int, block_rows: int | None = None) -> int:
    """Rows per block for a kernel that keeps whole rows in VMEM.

    ``block_rows`` (if given) must be a positive multiple of 8 or equal ``rows``, the TPU rule for
    the second-to-last block dim; it is checked here so a bad value fails before anything is
    traced, with the kernel's name. By default: all rows when they fit the VMEM budget (one block
    equal to the full dim is legal for any row count, e.g. 7), else the largest multiple of 32
    rows that fits (at least 8; the last block may be partial, Pallas masks its writes)."""
    if block_rows is not None:
        if isinstance(block_rows, bool) or not isinstance(block_rows, int) or block_rows <= 0:
            raise ValueError(f"customop.backends.tpu.{op}: block_rows must be a positive int, got {block_rows!r}")
        if block_rows % 8 and block_rows != rows:
            raise ValueError(
                f"customop.backends.tpu.{op}: block_rows={block_rows} breaks the TPU tiling rule: the "
                f"second-to-last block dim must be a multiple of 8 or equal the row count ({rows})")
        return min(block_rows, rows)  # a block past the end is the full dim, which is legal
    fit = max(1, VMEM_BLOCK_BUDGET // max(1, bytes_per_row))
    if rows <= min(fit, MAX_BLOCK_ROWS):
        return rows
    aligned = min(fit, MAX_BLOCK_ROWS) // ROW_ALIGN * ROW_ALIGN
    return aligned if aligned else 8


def grid_for(rows: int, block: int) -> tuple[int]:
    return (pl.cdiv(rows, block),)


def bytes_per_row(*row_bytes: int, f32_temps: int = 0, width: int = 0) -> int:
    """VMEM per row of a block: each input/output row twice (double buffering) plus ``f32_temps``
    fp32 temporaries of ``width`` lanes."""
    return 2 * sum(row_bytes) + 4 * f32_temps * width


def row_parallel(grid_dims: int = 1) -> pltpu.CompilerParams:
    """Grid steps are independent: let Mosaic split them across TensorCores (megacore)."""
    return pltpu.CompilerParams(dimension_semantics=("parallel",) * grid_dims)


def check_last_dim(op: str, arg: str, array: jax.Array, size: int) -> None:
    if array.ndim == 0 or array.shape[-1] != size:
        raise ValueError(f"customop.backends.tpu.{op}: {arg} has shape {tuple(array.shape)}, expected [..., {size}]")


def check_same_shape(op: str, arg: str, array: jax.Array, like: jax.Array) -> None:
    if tuple(array.shape) != tuple(like.shape):
        raise ValueError(f"customop.backends.tpu.{op}: {arg} has shape {tuple(array.shape)}, expected {tuple(like.shape)}")
