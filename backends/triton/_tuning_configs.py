"""The config dataclasses of the Triton kernels' launch tuning (``_tuning``'s picks and overrides):
RowConfig (row reductions), TileConfig (elementwise tiles and blocks, per-token-group quant),
RotaryConfig (the rotary kernel). ``_tuning`` re-exports them."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RowConfig:
    block_m: int
    block_n: int
    num_warps: int
    single_tile: bool
    #: 0: one program per row block; k > 0: a persistent grid of k programs per SM looping over
    #: row blocks with the next block's loads in flight (rms_norm family only)
    programs_per_sm: int = 0
    #: > 0: cap on registers per thread (NVIDIA's ``maxnreg``), so that one more program fits
    #: on an SM (e.g. Gemma's fp32 epilogue takes 40 at 16 warps: 3 programs per SM, 4 at 32)
    maxnreg: int = 0
    #: code generation (rms family only; tuning.SWEEP times each against the table's pick):
    #: ``even``: no bounds checks where the block cannot leave the tensor (rows: only the last
    #: block is checked, none when block_m divides the rows; columns: none when block_n is the
    #: row width); ``int32``: 32-bit element offsets when the launcher finds that they fit (int64
    #: otherwise); ``w_first``: the weight's load issued before x's; ``evict``: x (and the
    #: residual) read with ``evict_first`` (the looped kernel: in pass 2)
    even: bool = True
    int32: bool = True
    w_first: bool = True
    evict: bool = True
    #: (looped kernel) the row width and packed-row strides as compile-time constants, as in
    #: Inductor's code for one shape (one compiled kernel per width)
    const_width: bool = False
    #: the stores with ``evict_first`` (the looped kernel's: pass 2's): an in-place op rewrites
    #: the lines it has just read, which then stay in L2 dirty ahead of the next rows' reads. ncu
    #: (H200, 2026-12-03, one kernel from a flushed L2) saw the single tile write 6.9 MB of rms_norm
    #: 4096 x 4096's 32 MB to HBM during the kernel (Liger 11.6, Inductor 12.8): the rest is written
    #: back during whatever runs next
    store_evict: bool = False

    @property
    def launch_options(self) -> dict[str, int]:
        return {"num_warps": self.num_warps, **({"maxnreg": self.maxnreg} if self.maxnreg else {})}


@dataclasses.dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    #: code generation (the gated ``tile`` kernels and the unary ``flat`` kernel): ``even``: no
    #: bounds checks when the tile divides the output; ``int32``: 32-bit element offsets when the
    #: launcher finds that they fit (int64 otherwise); ``evict``: x read with ``evict_first``;
    #: ``grid2d`` (gated tiles): a (column block, row block) grid, so that a program finds its tile
    #: without the integer division of a flat grid index before its first load (a latency a
    #: one-token launch waits on; Inductor's one-row kernels index flat with a constant width).
    #: Where the launcher compiles the width in (``const_width``), the flat grid's division is by
    #: a constant (a multiply and a shift) and the launcher indexes flat whatever ``grid2d`` says:
    #: measured faster than the 2-D grid at every decode row (TILE_TABLE's ``small_grid_*``)
    even: bool = True
    int32: bool = True
    evict: bool = True
    grid2d: bool = False
    #: (gated ``*_and_mul`` kernel, packed rows) the width as a compile-time constant, as in
    #: Inductor's code for one shape: no runtime width, strides or offsets in the address math;
    #: one compiled kernel per hidden size
    const_width: bool = False

    @property
    def eviction_policy(self) -> str:
        """x's ``tl.load`` eviction policy (the kernels' ``EVICT`` constexpr; "" for none)."""
        return "evict_first" if self.evict else ""


@dataclasses.dataclass(frozen=True)
class RotaryConfig:
    #: warps per program (one token, or one slice of its heads, per program)
    num_warps: int
    #: at least this many programs per token (each takes a slice of the heads)
    min_splits: int = 1
