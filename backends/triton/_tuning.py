"""Block sizes and warps for the Triton kernels, from tables keyed by device type and shape.

Never autotuned at run time: autotuning benchmarks on the first call of each shape (a host sync,
seconds of warm-up, results that differ between runs) and cannot run under the interpreter
(several configs need a driver to time them). The tables are plain data; ``override`` lets the benchmark
runner's ``--sweep`` time alternatives, and its results are how the numbers here get changed.

Config kinds:
- ``rows``: a row reduction (the norms, gelu_and_mul_sparse, per-token quant). ``block_m`` rows
  per program; ``block_n`` >= the row (or group) width when ``single_tile``, so the row stays in
  registers and is read once; otherwise a loop over ``block_n`` chunks (two passes over the row).
- ``tile``: a 2-D elementwise tile of the output (``*_and_mul``): ``block_m`` rows x ``block_n``
  columns per program, programs in row-major tile order.
- ``flat``: a 1-D elementwise block over the flattened tensor (unary activations, per-tensor
  quant).
- ``group``: per-token-group quant, ``block_m`` whole groups of one row per program.
- ``rotary``: warps per program and forced head splits of the rotary kernel.

Device types: ``cuda`` (NVIDIA), ``hip`` (AMD: a wavefront is 64 lanes, so half the warps give
the same threads), ``xpu`` (Intel, as cuda), ``cpu`` (the Triton interpreter in CI: the cuda
table, so that CI runs the GPU code paths, with one "SM").

The cuda numbers follow from bytes in flight (an H200 SM needs ~64 KB of loads in flight to
stream at full rate: 16-byte accesses, and enough registers left for four or more programs per
SM) and were checked on the H200 (``--sweep``, 2026-11-29; the numbers beside each table). What
compiling them for sm_90 without a GPU shows (tests/backends/triton/aot_check.py): no spills, all
accesses 16 bytes wide on aligned rows; the 8192-wide rms kernel at 16 warps takes 32-38
registers (3-4 resident programs), the quant row kernel at 4 warps ~90-100 (5 programs).
Earlier sweeps (with triton's do_bench) were noise: on the H200's host the launch path took
longer than do_bench's L2 flush, and the same config measured 30 and 170 us; the runner now
times in CUDA graphs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Iterator
from typing import Any

import torch

from customop.backends.triton._common import next_pow2


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


#: rows: (largest padded row width, rows per program, warps); wider rows loop (LOOP_ROW)
ROW_TABLE: dict[str, tuple[tuple[int, int, int], ...]] = {
    "cuda": (
        (128, 32, 4),
        (256, 16, 4),
        (512, 8, 4),
        (1024, 4, 4),
        (2048, 1, 4),
        (4096, 1, 8),
        (8192, 1, 16),
        (16384, 1, 16),
        (32768, 1, 32),
    ),
}
#: the row norms (one kernel: the RMSNorm family, and since 2026-12-02 the layer norms and the
#: fused gated norms, which took ROW_TABLE before): size classes by token count, first match:
#: (most rows, largest padded row width, rows per program, warps, programs per SM (0: one program
#: per row block)); within a class, fewer rows per program while that leaves fewer than two
#: programs per SM. Decode (<= 256 rows: one row per program, a latency-bound launch), mid sizes
#: (<= 8192 rows) and prefill streaming each have their own rows so that a sweep result changes
#: one class; the numbers are ROW_TABLE's until the ``rms`` sweep says otherwise. Wider rows loop.
#: ``RMS_EVICT_MAX_ROWS``: the evict-first hint on x only up to this many rows. H200 sweep,
#: 2026-12-01, bf16: without it rms_norm 32768 x 4096 / x 8192 took 131.7 / 257.6 us against
#: 140.3 / 266.9 with it (liger 130.6, compile 250.4); at 1-4096 rows the hint was as fast or
#: faster (1 x 4096: 1.42 us against 1.58; that 1.42 was the first graph timing of a process,
#: which reads fast: runner_timing.warm_up_graph_timer). Since 2026-12-03 (twelfth day) up to
#: 2048 rows: with every output set written back to HBM (the runner's timer since the tenth day)
#: the hint lost at 4096 x 4096 (H200 sweep: rms_norm 19.24 us with it, 18.30 without; Liger
#: 18.86) and tied at 4096 x 8192 (33.86 / 33.78) and with a residual (34.46 / 34.34). The
#: runner's rounds at 4096 rows then (h200/2026-12-03-twelfth-rounds-4096-no-hint.json, us, with
#: -> without; best peer): rms_norm 19.24 -> 18.50 (Liger 18.98), gemma 18.90 -> 18.13 (18.92),
#: layer_norm 19.40 -> 18.82 (20.55), nemotron 19.51 -> 19.05; the 8192-lane rows and the
#: in-place fused adds unchanged.
_INF = 1 << 62
RMS_EVICT_MAX_ROWS: dict[str, int] = {"cuda": 2048}
RMS_TABLE: dict[str, tuple[tuple[int, int, int, int, int], ...]] = {
    "cuda": (
        (256, 2048, 1, 4, 0), (256, 4096, 1, 8, 0), (256, 8192, 1, 8, 0), (256, 16384, 1, 16, 0),
        (256, 32768, 1, 32, 0),
        (8192, 128, 32, 4, 0), (8192, 256, 16, 4, 0), (8192, 512, 8, 4, 0), (8192, 1024, 4, 4, 0),
        (8192, 2048, 1, 4, 0), (8192, 4096, 1, 8, 0), (8192, 8192, 1, 16, 0), (8192, 16384, 1, 16, 0),
        (8192, 32768, 1, 32, 0),
        (_INF, 128, 32, 4, 0), (_INF, 256, 16, 4, 0), (_INF, 512, 8, 4, 0), (_INF, 1024, 4, 4, 0),
        (_INF, 2048, 1, 4, 0), (_INF, 4096, 1, 8, 0), (_INF, 8192, 1, 16, 0), (_INF, 16384, 1, 16, 0),
        (_INF, 32768, 1, 32, 0),
    ),
}
#: the decode class's warps with a residual (the fused adds), per padded width, where they differ
#: from RMS_TABLE's. H200 sweeps, bf16, 1 / 16 / 256 rows x 8192, 8 warps against 16 (us):
#: 2026-12-01: rms_norm 1.81-1.83 / 1.94-1.99 against 1.91-1.92 / 1.99-2.00, gemma 1.93 / 2.04
#: against 2.02 / 2.15 (Liger 1.90 / 2.00); 2026-12-02 (a second sweep): rms_norm 1.84 / 1.99 / 3.69 against 1.86
#: / 2.00 / 3.70, gemma 1.93 / 2.03 / 3.83 against 2.00 / 2.18 / 3.78, layer_norm 2.31 / 2.46 /
#: 4.32 against 2.41 / 2.50 / 4.32; with a residual 16 stayed ahead: fused add 2.13 / 2.31 / 6.11
#: against 2.16 / 2.32 / 6.13 at 8, Gemma's 2.29 / 2.40 / 6.19 against 2.27 / 2.44 / 6.29,
#: Nemotron's 3.03 / 3.11 / 6.96 against 3.11 / 3.22 / 7.04.
RMS_RESIDUAL_DECODE_WARPS: dict[str, dict[int, int]] = {"cuda": {8192: 16}}
#: rows wider than the table: chunk width and warps of the looped kernel
LOOP_ROW: dict[str, tuple[int, int]] = {"cuda": (8192, 16)}
#: the row norms at prefill sizes take the looped kernel, Inductor's form for these ops: pass 1
#: reads the row (kept in L2 by evict_last), pass 2 re-reads it from L2 and writes. ``min_rows``:
#: padded width -> more rows than this loop (the entry of the largest width not above the row's);
#: ``residual_min_rows`` the same for the fused adds, where given. Chunk: half the row, at most
#: ``max_chunk`` (rms_norm), or the row, at most ``max_chunk`` or ``residual_chunk``'s entry by
#: width (with a residual, whose store then waits for the reduction instead of competing with the
#: first reads); ``lanes_per_warp`` lanes per warp; ``store_evict``: RowConfig.store_evict at these
#: sizes. H200 sweeps, bf16 (single-tile pick -> looped; compile):
#: - 2026-12-02, 32768 rows: rms_norm x 4096 130.9 -> 126.8 us (129.3 liger), x 8192 255.3 ->
#:   249.5 (249.3 compile); fused add x 4096 265.8 -> 251.4 (249.4), x 8192 525.9 -> 508.2 (500.7).
#: - 2026-12-02, 4096 rows: rms_norm x 8192 35.3 -> 34.2 (34.4), fused add x 4096 35.9 -> 34.8
#:   (33.8), x 8192 68.8 -> 68.3 (66.7 liger); rms_norm x 4096 lost (17.0 -> 18.3: half-row
#:   chunks of 2048), hence 8192 rows there.
#: ``const_width``: the width and packed strides compiled in (RowConfig.const_width), as Inductor's
#: code has them. H200 sweep 2026-12-03 (``70e2611`` with the compiled-width kernel), bf16, runtime -> compiled
#: width (compile): fused add 4096 x 4096 35.23 -> 34.76 (34.06), x 8192 68.49 -> 67.20 (66.43);
#: gemma fused add 4096 x 8192 68.98 -> 66.80 (66.29); rms_norm / gemma 4096 x 8192 34.50 / 34.98 ->
#: 34.00 / 34.35 (34.10 / 34.86); 32768 rows within 0.5% either way but gemma x 8192 (253.68 ->
#: 250.48) and its fused add (509.32 -> 513.59).
#: ``decode_min_rows`` (no residual): within the decode class (<= 256 rows), more rows than this
#: take the looped kernel with the whole row as its chunk (the entry of the largest width not above
#: the row's; 8192: 256 keeps those rows on the single tile). Same sweep, 256 x 4096, single tile
#: -> looped (compile): rms_norm 2.71 -> 2.53-2.74 (2.69), gemma 2.79 -> 2.53 (2.66), fused gated
#: 3.44 -> 3.13 (3.68); a scratch run the same day: rms_norm 2.64 -> 2.50 (2.50). Where it lost:
#: 16 x 4096 (1.68 -> 1.76), 256 x 8192 (3.69 -> 3.95); 17-255 rows were not measured. Dropped
#: for the RMSNorm family on 2026-12-03, when the runner's timer gave every input set its own
#: outputs (tenth day): the single tile (8 warps) then led at 130 / 192 / 256 x 4096, rms_norm
#: 2.48 / 3.08 / 3.32 -> 2.28 / 2.83 / 3.14 us (Liger 2.42 / 2.96 / 3.24), gemma 2.50 / 3.10 /
#: 3.34 -> 2.31 / 2.82 / 3.22 (Liger 2.36 / 2.91 / 3.19). The fused gated norms keep it (not re-measured).
#: ``residual_lanes_per_warp``: the fused adds' lanes per warp by width (the default elsewhere).
#: Same sweep, x 8192, 16 -> 32 warps (compile): fused add 4096 / 32768 rows 67.20 / 511.65 ->
#: 66.34 / 502.32 (66.43 / 503.52), gemma's 66.80 / 513.59 -> 66.49 / 503.98 (66.29 / 504.57).
RMS_LOOPED: dict[str, dict[str, Any]] = {
    "cuda": {"min_rows": {4096: 8192, 8192: 2048}, "residual_min_rows": {4096: 2048}, "max_chunk": 4096,
             "lanes_per_warp": 256, "const_width": True, "residual_lanes_per_warp": {8192: 128}},
}
#: Per-variant changes to the row-norm picks above (``variant`` of rms_config: "rms" the RMSNorm
#: family, "layer" the layer norms, "gated" the fused gated norms). H200 sweep 2026-12-02, bf16,
#: table pick -> this (compile):
#: - layer: never the looped kernel (its Welford pass measured slower than the single tile: the
#:   old single-tile kernel ran layer_norm 32768 x 4096 in 136.5 us, the looped pick in 188.8;
#:   compile 181.8), and ``mid_block_m`` rows per program above the decode class (4096 x 8192:
#:   45.7 -> 36.8 us (39.2); 4096 x 4096: 18.8 -> 17.9 (25.3); nemotron 4096 x 8192 46.2 -> 37.3).
#: - gated: ``decode_warps`` per padded width at <= 256 rows (1 / 16 / 256 x 4096: 2.13 / 2.27 /
#:   3.72 -> 1.92 / 2.04 / 3.61 us at 16 warps; compile 2.0 / 2.3 / 3.5), and its own looped
#:   class: from 2048 rows of 8192+ lanes, 2048-lane chunks (4096 with a residual) at 256 lanes
#:   per warp (4096 x 8192: 57.0 -> 53.0 us (49.8); with a residual 88.6 -> 83.1 (81.8);
#:   32768 x 8192: 397.1 -> 377.2 (370.7)); the evict-first hint on x only at decode sizes
#:   (``evict_max_rows``; 4096 x 4096: 26.6 -> 26.1 us (30.7), with a residual 46.0 -> 41.9 (42.0)),
#:   and with a residual from ``residual_x_first_rows`` rows of the decode class the weight's load
#:   after x's (``RowConfig.w_first`` False): two H200 sweeps (2026-12-03, 256 rows, the rows
#:   129-255 follow unmeasured) put the fused add at 256 x 4096 at 5.00 / 5.04 -> 4.84 / 4.82 us
#:   (compile 4.94) and 256 x 8192 at 7.48 / 7.43 -> 7.12 / 7.22 (8.57); without the residual it
#:   was no faster (256 x 4096 4.00 both; 256 x 8192 5.72 -> 6.12).
#: - fourteenth day (2026-12-04; medians of five interleaved rounds of the runner's timer, us,
#:   pick -> new (compile); h200/2026-12-04-fourteenth-rounds-plan1.json):
#:   - rms: with a residual, no evict-first hint on x and the residual at decode sizes
#:     (``residual_evict_max_rows``): the in-place fused adds rewrite the lines they read, and the
#:     hint sends them out of L2 first. Gemma's fused add 1 / 16 / 256 x 8192 2.280 / 2.395 / 6.254
#:     -> 2.205 / 2.328 / 6.061 (Liger 2.253 / 2.390 / 6.255), x 4096 1.778 / 1.872 / 4.325 -> 1.763
#:     / 1.872 / 4.318 (1.742 / 1.845 / 4.168); fused_add_rms_norm 1.733-6.102 -> 1.723-6.127,
#:     ahead of Liger throughout. Without a residual the hint stays (Gemma 1-256 rows: ties).
#:   - gated, the looped class: the stores evict-first (``store_evict``), 4096-lane chunks on 16
#:     warps without a residual, 2048-lane chunks on 16 warps with one at 8192 lanes
#:     (``residual_chunk``, ``residual_lanes_per_warp``), and the fused add of 4096 lanes looped
#:     from 2048 rows (the whole row, 16 warps): fused_rms_norm_gated 4096 / 32768 x 8192 50.90 /
#:     373.06 -> 49.62 / 371.17 (49.92 / 372.77); the fused add x 8192 81.60 / 633.05 -> 81.46 /
#:     615.89 (82.62 / 619.97), x 4096 41.96 / 313.79 -> 41.40 / 309.08 (42.12 / 309.66).
#:     Measured at 4096 and 32768 rows; 2049-4095 rows follow unmeasured.
RMS_VARIANTS: dict[str, dict[str, dict[str, Any]]] = {
    "cuda": {
        "rms": {"residual_evict_max_rows": 0},
        "layer": {"looped": None, "mid_block_m": 2},
        "gated": {"decode_warps": {4096: 16}, "evict_max_rows": 256, "residual_x_first_rows": 129,
                  "looped": {"min_rows": {8192: 2048}, "residual_min_rows": {4096: 2048}, "max_chunk": 4096,
                             "residual_chunk": {4096: 4096, 8192: 2048}, "lanes_per_warp": 256,
                             "residual_lanes_per_warp": {8192: 128}, "const_width": True, "store_evict": True,
                             "decode_min_rows": {4096: 128, 8192: 256}}},
    },
}

#: row kernels that keep the whole row live across a reduction and then quantize it (per-token
#: fp8 quant, rms_norm + quant): single-row programs get the fewest warps (4 at least) that hold
#: at most this many elements per thread. At 8192 wide that is 4 warps, ~90-100 registers: five
#: programs (80 KB of loads) in flight per SM, against three (48 KB) at the norms' 16 warps, where
#: the quant epilogue's registers (34-36) cost the fourth. Measured on the H200, 4096 x 8192 bf16:
#: rms_norm + quant 33.4 us at 4 warps, 62-75 at 16 (the same-size copy: 28.6).
QUANT_ROW_ELEMS_PER_THREAD: dict[str, int] = {"cuda": 64}

#: tile / flat: elements per program for large tensors (16 per thread: two 16-byte loads of bf16
#: in flight per thread and operand), the smallest block when the tensor is small (more programs
#: spread a decode-sized tensor over more SMs), and elements per warp for each case (8 per thread
#: when the grid has fewer than two programs per SM: one vector each, the shortest dependent chain
#: per thread, which is what a latency-bound decode launch waits on).
#: H200, bf16, graph-free medians: 2048 / 4 warps beat 4096 / 8 by 1-2 us on the 4096 x 8192
#: unary ops (36.6-37.3 vs 38.2-38.8; same-size copy 36.1-37.6), 1024 / 2 is best or tied on the
#: gated ops (gelu erf 97.3 vs 103-106 at 8 per thread), 1024 / 4 is best at decode (1.3-1.4 us).
#: Streaming sizes (``stream_*``; H200 sweep 2026-12-02, bf16, against Inductor's code, which has
#: no eviction hint, no masks and 32-bit offsets): above ``decode_tokens`` rows the gated tile is
#: 2048 elements at 8 warps without the evict-first hint (silu_and_mul 4096 / 32768 x 2 x 14336:
#: 82.0 / 639.1 us, was 87.0 / 678.6; compile 81.9 / 639.1); unary ops from ``stream_flat_numel``
#: elements take 1024-element blocks at 4 warps without the hint (quick_gelu 32768 x 8192: 251.7
#: us, was 260.7; compile 253.1). Below those sizes the hint measured as fast or faster.
TILE_TABLE: dict[str, dict[str, int]] = {
    "cuda": {"tile_elems": 1024, "tile_min_n": 1024, "flat_elems": 2048, "flat_min": 1024, "elems_per_warp": 512,
             "small_elems_per_warp": 256, "decode_tokens": 256, "decode_min_n": 1024,
             "stream_tile_elems": 2048, "stream_elems_per_warp": 256, "stream_flat_numel": 1 << 20,
             "stream_flat_elems": 1024, "small_grid_tile_n": 512, "small_grid_min_n": 256,
             "small_grid_elems_per_warp": 64,
             "compute_elems_per_warp": 256, "light_mid_numel": 1 << 22, "light_mid_elems": 4096,
             "rotating_min_rows": 256},
}
#: ``rotating_min_rows`` (gated tiles, decode class, not a small grid): from this many rows the
#: streaming-class ops (silu, fatrelu, gelu tanh) read x without the evict-first hint and the erf
#: gate takes ``compute_elems_per_warp`` (4 warps a 1024-element tile). H200 tile sweep
#: 2026-12-03, bf16, 256 x 2 x 14336, every output set written back to HBM (the runner's timer
#: since that day), pick -> this (compile): mul_and_silu 7.25 -> 7.08, fatrelu 7.16 -> 6.96 (6.97
#: / 6.80); gelu erf 8.48 -> 8.07 (7.97), where dropping the hint lost (8.90). 17-255 rows were
#: not measured and keep the hint.
#: ``light_mid_*`` (flat, ``light`` ops: relu2, a max and a multiply per element): from
#: ``stream_flat_numel`` up to ``light_mid_numel`` elements, ``light_mid_elems``-element blocks at
#: ``elems_per_warp`` (4096 at 8 warps, 16 per thread) instead of the streaming class's 1024 at 4.
#: H200 flat sweeps, bf16, relu2 256 x 4096 / 256 x 8192, us (streaming pick -> 4096 / 8; Liger):
#: 2026-12-02 run 1: 2.15 -> 2.13 / 3.52 -> 3.45 (2.14 / 3.35); run 2: 2.18 -> 1.98 / 3.58 -> 3.44
#: (2.03 / 3.36). quick_gelu lost with it (256 x 4096: 2.30 -> 2.41), so the others keep theirs.
#: (tile, decode rows) up to ``decode_tokens`` rows the gated tile may shrink to ``decode_min_n``
#: columns (instead of ``tile_min_n``) to spread the few rows over more SMs; the ``tile`` sweep's
#: decode alternatives time 128-2048. Those rows launch on the 2-D grid (``TileConfig.grid2d``):
#: H200 sweep 2026-12-02 (gelu erf / tanh, fatrelu, swigluoai at 1 / 16 / 256 x 14336, bf16),
#: 1.026x the flat grid's pick in geometric mean over the 12 rows, where re-timing the pick's own
#: shape gave 0.988x (the noise at 1.3-1.8 us); no other decode alternative beat the pick.
#: ``small_grid_*``: where the decode-class tile (gated) or the ``flat_min`` block (unary ops)
#: leaves fewer than two programs per SM (1-16 tokens of 14336 / 4096-8192 lanes), 512-element
#: tiles at 8 warps, two elements per thread: the shortest dependent chain per thread (erf's
#: branches, the sigmoid) in a launch that waits on latency. H200 sweep 2026-12-02, bf16, pick ->
#: 512 / 8 (compile): gelu erf 1 / 16 x 14336 1.51 -> 1.34 / 1.74 -> 1.66 us (1.30 / 1.62),
#: gelu tanh 1.37 -> 1.32 / 1.61 -> 1.55 (1.38 / 1.64), fatrelu 1.26 -> 1.27 / 1.46 -> 1.44
#: (1.28 / 1.39); quick_gelu 1 / 16 x 8192 1.30 -> 1.24 / 1.40 -> 1.34 (1.25 / 1.41). At 256
#: tokens the small tiles lost (gelu tanh 7.55 against 6.43 us): the class stops at two programs per SM.
#: Since 2026-12-03 the small gated grids take the width as a compile-time constant (the launcher
#: then indexes them flat, TileConfig.grid2d), and the small grids, gated and flat (unary ops and
#: now per-tensor quant too), halve their blocks down to ``small_grid_min_n`` while fewer programs
#: than SMs would run: Inductor's shape at these sizes (1-D, 128-256 elements, 1-2 per thread).
#: H200 decode study 2026-12-03 (h200/2026-12-03-twelfth-decode-study.txt: three interleaved
#: rounds, medians, us; pick -> new (compile)): gelu erf 1 / 16 x 14336 1.338 -> 1.269 / 1.672
#: -> 1.603 (1.328 / 1.659), fatrelu 16 x 14336 1.424 -> 1.374 (1.390), unary gelu 1 / 16 x 4096
#: 1.272 -> 1.240 / 1.382 -> 1.355 (1.253 / 1.365). The flat grid without the constant width was
#: the slowest of the three (gelu erf 16: 1.971 at 512 / 8), the 2-D grid with it between
#: (1.674); ncu put per-tensor quant 1 x 8192 at 2.40 us in 8 programs of 1024 against
#: Inductor's 2.13 in 32 of 256. A runner pass with 256-element blocks at every small flat size
#: (h200/2026-12-03-twelfth-rounds-1-16-act-quant.json) lost at 16 x 8192, where 512 programs
#: of 256 ran behind 256 of 512 (quick_gelu 1.306 -> 1.389 us, gelu_fast 1.331 -> 1.398): the
#: halving stops at one program per SM.
#: ``compute_elems_per_warp``: situ_and_mul on libdevice's tanh (fp16 / fp32 outputs: two tanh and
#: a sigmoid per element, bound by the special-function units; bf16 takes the hardware tanh and the
#: streaming tile, tile_config's ``const_width``) beyond the small grids: 1024-element tiles at 4
#: warps, Inductor's pointwise shape. H200 sweep 2026-12-02, bf16, x 2 x 14336, libdevice tanh, 2 warps -> 4
#: (compile): 256 tokens 10.58 -> 9.06 us (9.08), 4096 126.2 -> 118.5 (104.6), 32768 985.6 ->
#: 933.2 (846.0); 16 and 32 elements per thread were slower (126-177 us at 4096).
#: per-token-group quant: elements per program (whole groups of one row), per thread, and the
#: smallest program; 32 groups of 128 at 4 warps take ~55 registers: nine programs (72 KB of
#: loads) in flight per SM, against six (48 KB) at 8 warps
GROUP_TABLE: dict[str, dict[str, int]] = {"cuda": {"elems": 4096, "elems_per_thread": 32, "min_elems": 512}}

_ALIASES = {"xpu": "cuda", "cpu": "cuda", "hip": "cuda"}
_OVERRIDES: dict[str, dict[str, Any]] = {}


def device_kind(device: torch.device) -> str:
    if device.type == "cuda":
        return "hip" if torch.version.hip else "cuda"
    return device.type


@functools.cache
def _sm_count(device_type: str, index: int | None) -> int:
    if device_type == "cuda":
        return torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device()).multi_processor_count
    if device_type == "xpu":
        props = torch.xpu.get_device_properties(index if index is not None else torch.xpu.current_device())
        return int(getattr(props, "gpu_subslice_count", 0) or getattr(props, "max_compute_units", 64) // 8 or 64)
    return 1  # the interpreter: grids are small anyway


def sm_count(device: torch.device) -> int:
    return _sm_count(device.type, device.index)


def _table(table: dict[str, Any], kind: str) -> Any:
    return table.get(kind) or table[_ALIASES.get(kind, "cuda")]


def _warps(kind: str, warps: int) -> int:
    return max(1, warps // 2) if kind == "hip" else warps


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _apply_override(name: str, cfg: Any) -> Any:
    fields = _OVERRIDES.get(name)
    return dataclasses.replace(cfg, **fields) if fields else cfg


def row_config(device: torch.device, n_rows: int, n_cols: int, quant: bool = False) -> RowConfig:
    """Config of a row reduction over ``n_cols`` lanes (a whole row, or one group). ``quant``:
    the per-token quant kernels (fewer warps per row, QUANT_ROW_ELEMS_PER_THREAD)."""
    kind = device_kind(device)
    return _apply_override("rows", _row_config(kind, sm_count(device), n_rows, n_cols, quant))


@functools.lru_cache(maxsize=512)
def _row_config(kind: str, sms: int, n_rows: int, n_cols: int, quant: bool) -> RowConfig:
    width = next_pow2(n_cols)
    for max_width, block_m, warps in _table(ROW_TABLE, kind):
        if width <= max_width:
            # Fewer rows per program while that leaves fewer than two programs per SM.
            while block_m > 1 and _cdiv(n_rows, block_m) < 2 * sms:
                block_m //= 2
            if quant and block_m == 1:
                per_thread = _table(QUANT_ROW_ELEMS_PER_THREAD, kind)
                warps = min(warps, max(4, width // (32 * per_thread)))
            return RowConfig(block_m, width, _warps(kind, warps), True)
    chunk, warps = _table(LOOP_ROW, kind)
    return RowConfig(1, chunk, _warps(kind, warps), False)


def rms_config(device: torch.device, n_rows: int, n_cols: int, residual: bool = False,
               variant: str = "rms") -> RowConfig:
    """Config of the row-norm kernel (RMS_TABLE, RMS_LOOPED, RMS_VARIANTS; override kind
    ``rms``). ``residual``: the fused-add variants (their own looped chunk); ``variant``: "rms"
    (the RMSNorm family), "layer" (the layer norms) or "gated" (the fused gated norms)."""
    kind = device_kind(device)
    return _apply_override("rms", _rms_config(kind, sm_count(device), n_rows, n_cols, residual, variant))


@functools.lru_cache(maxsize=512)
def _rms_config(kind: str, sms: int, n_rows: int, n_cols: int, residual: bool = False,
                variant: str = "rms") -> RowConfig:
    width = next_pow2(n_cols)
    changes = _table(RMS_VARIANTS, kind)[variant]
    looped = changes.get("looped", _table(RMS_LOOPED, kind))
    if looped and (cfg := _looped_config(kind, looped, n_rows, width, residual)):
        return cfg
    for max_rows, max_width, block_m, warps, per_sm in _table(RMS_TABLE, kind):
        if n_rows <= max_rows and width <= max_width:
            x_first = False
            if max_rows <= 256:
                if residual:
                    warps = _table(RMS_RESIDUAL_DECODE_WARPS, kind).get(width, warps)
                    x_first = n_rows >= changes.get("residual_x_first_rows", _INF)
                warps = changes.get("decode_warps", {}).get(width, warps)
            elif block_m == 1:
                block_m = changes.get("mid_block_m", 1)
            while block_m > 1 and _cdiv(n_rows, block_m) < 2 * sms:
                block_m //= 2
            evict_max_rows = changes.get("evict_max_rows", _table(RMS_EVICT_MAX_ROWS, kind))
            if residual:
                evict_max_rows = changes.get("residual_evict_max_rows", evict_max_rows)
            return RowConfig(block_m, width, _warps(kind, warps), True, programs_per_sm=per_sm,
                             evict=n_rows <= evict_max_rows, w_first=not x_first)
    chunk, warps = _table(LOOP_ROW, kind)
    return RowConfig(1, chunk, _warps(kind, warps), False)


def _looped_config(kind: str, looped: dict[str, Any], n_rows: int, width: int, residual: bool) -> RowConfig | None:
    """The looped kernel's config where ``looped`` (RMS_LOOPED or a variant's) sends rows of
    ``width`` padded lanes to it; None where they keep the single tile."""
    decode_min_rows = _by_width(looped.get("decode_min_rows", {}), width, math.inf)
    store_evict = False
    if not residual and decode_min_rows < n_rows <= 256:  # 256: RMS_TABLE's decode class
        chunk = width
    elif n_rows > _looped_min_rows(looped, width, residual):
        chunk = min(width, _by_width(looped.get("residual_chunk", {}), width, looped["max_chunk"])) if residual \
            else min(width // 2, looped["max_chunk"])
        store_evict = looped.get("store_evict", False)
    else:
        return None
    lanes = looped["lanes_per_warp"]
    if residual:
        lanes = _by_width(looped.get("residual_lanes_per_warp", {}), width, lanes)
    return RowConfig(1, chunk, _warps(kind, max(1, chunk // lanes)), False,
                     const_width=looped.get("const_width", False), store_evict=store_evict)


def _looped_min_rows(looped: dict[str, Any], width: int, residual: bool) -> float:
    """Above how many rows a row of ``width`` padded lanes takes the looped kernel (RMS_LOOPED)."""
    by_width = looped.get("residual_min_rows", looped["min_rows"]) if residual else looped["min_rows"]
    return _by_width(by_width, width, math.inf)


def _by_width(by_width: dict[int, Any], width: int, default: Any) -> Any:
    """The entry of the largest width not above ``width``; ``default`` when there is none."""
    fitting = [w for w in by_width if w <= width]
    return by_width[max(fitting)] if fitting else default


def row_grid(device: torch.device, cfg: RowConfig, n_rows: int) -> tuple[tuple[int], int]:
    """(grid, pipeline stages) of a row kernel: a persistent grid when the config asks for one
    and there are more row blocks than it has programs."""
    if not cfg.single_tile:
        return (n_rows,), 1
    blocks = _cdiv(n_rows, cfg.block_m)
    resident = cfg.programs_per_sm * sm_count(device)
    if resident and blocks > resident:
        return (resident,), 2
    return (blocks,), 1


def _small_grid_n(t: dict[str, int], sms: int, block_n: int, row_blocks: int, n_cols: int) -> int:
    """A small grid's block width (TILE_TABLE's ``small_grid_*``): ``small_grid_tile_n`` at most,
    halved down to ``small_grid_min_n`` while fewer programs than SMs would run."""
    block_n = min(block_n, t["small_grid_tile_n"])
    while block_n > t["small_grid_min_n"] and row_blocks * _cdiv(n_cols, block_n) < sms:
        block_n //= 2
    return block_n


def _small_grid_warps(kind: str, t: dict[str, int], elems: int) -> int:
    """Warps of a small-grid program of ``elems`` elements (TILE_TABLE's ``small_grid_*``)."""
    return _warps(kind, max(1, min(8, elems // t["small_grid_elems_per_warp"])))


def tile_config(device: torch.device, n_rows: int, n_cols: int, streaming_class: bool = True,
                compute_bound: bool = False, const_width: bool = False) -> TileConfig:
    """2-D elementwise tile over an ``[n_rows, n_cols]`` output. ``streaming_class=False`` keeps
    the mid-size tile at streaming sizes too, for the ops not measured faster in the streaming one
    (gelu_and_mul's erf gate, compute-bound there, ran at 99.4 / 789.7 us at 4096 / 32768 x 2 x
    14336 in it against 93.4 / 737.2 in the mid-size tile; H200, 2026-12-02 / 2026-11-29).
    ``compute_bound``: the mid-size tile at TILE_TABLE's ``compute_elems_per_warp`` (situ).
    ``const_width``: the streaming tile with the width as a compile-time constant (TileConfig's
    ``const_width``): situ with the hardware tanh, H200 sweep 2026-12-02 (bf16, x 2 x 14336,
    4096 / 32768 tokens): 88.3 / 688.8 -> 82.2 / 642.1 us, the same-size copy 84.0 / 657.3; silu
    and gelu were within 0.3% either way, so they keep the runtime width."""
    kind = device_kind(device)
    return _apply_override("tile", _tile_config(kind, sm_count(device), n_rows, n_cols, streaming_class,
                                                compute_bound, const_width))


@functools.lru_cache(maxsize=512)
def _tile_config(kind: str, sms: int, n_rows: int, n_cols: int, streaming_class: bool = True,
                 compute_bound: bool = False, const_width: bool = False) -> TileConfig:
    t = _table(TILE_TABLE, kind)
    stream = streaming_class and n_rows > t["decode_tokens"]
    elems = t["stream_tile_elems"] if stream else t["tile_elems"]
    block_n = min(next_pow2(n_cols), elems)
    block_m = min(max(1, elems // block_n), next_pow2(n_rows))
    if not stream and _cdiv(n_rows, block_m) * _cdiv(n_cols, block_n) < 2 * sms:
        # a latency-bound launch (TILE_TABLE's ``small_grid_*``): smaller tiles, more warps, the
        # width compiled in (the launcher indexes the tiles flat then)
        block_n = _small_grid_n(t, sms, block_n, _cdiv(n_rows, block_m), n_cols)
        return TileConfig(block_m, block_n, _small_grid_warps(kind, t, block_m * block_n), grid2d=True,
                          const_width=True)
    min_n = t["tile_min_n"] if stream else t["decode_min_n"]
    while block_n > min_n and _cdiv(n_rows, block_m) * _cdiv(n_cols, block_n) < 2 * sms:
        block_n //= 2
    small = _cdiv(n_rows, block_m) * _cdiv(n_cols, block_n) < 2 * sms
    rotating = not small and t["rotating_min_rows"] <= n_rows <= t["decode_tokens"]
    if small:
        per_warp = t["small_elems_per_warp"]
    elif stream:
        per_warp = t["stream_elems_per_warp"]
    else:
        erf_rotating = rotating and not streaming_class
        per_warp = t["compute_elems_per_warp" if compute_bound or erf_rotating else "elems_per_warp"]
    warps = max(1, min(8, block_m * block_n // per_warp))
    evict = not stream and not (rotating and streaming_class)
    return TileConfig(block_m, block_n, _warps(kind, warps), evict=evict,
                      grid2d=n_rows <= t["decode_tokens"], const_width=const_width and stream)


def flat_config(device: torch.device, numel: int, unary: bool = False, light: bool = False) -> TileConfig:
    """1-D elementwise block over ``numel`` elements (``block_m`` is 1). ``unary``: the unary
    activations' kernel, which has a streaming class (TILE_TABLE's ``stream_flat_*``); the other
    users of flat blocks (per-tensor quant) were not swept for it. ``light`` (unary): an op of a
    couple of instructions per element, with its own class below ``light_mid_numel``."""
    kind = device_kind(device)
    return _apply_override("flat", _flat_config(kind, sm_count(device), numel, unary, light))


@functools.lru_cache(maxsize=512)
def _flat_config(kind: str, sms: int, numel: int, unary: bool = False, light: bool = False) -> TileConfig:
    t = _table(TILE_TABLE, kind)
    if unary and light and t["stream_flat_numel"] <= numel < t["light_mid_numel"]:
        block = t["light_mid_elems"]
        return TileConfig(1, block, _warps(kind, block // t["elems_per_warp"]), evict=False)
    if unary and numel >= t["stream_flat_numel"]:
        block = t["stream_flat_elems"]
        return TileConfig(1, block, _warps(kind, block // t["stream_elems_per_warp"]), evict=False)
    block = t["flat_elems"]
    if _cdiv(numel, t["flat_min"]) < 2 * sms:  # a latency-bound launch (TILE_TABLE's ``small_grid_*``)
        block = _small_grid_n(t, sms, t["small_grid_tile_n"], 1, numel)
        return TileConfig(1, block, _small_grid_warps(kind, t, block))
    while block > t["flat_min"] and _cdiv(numel, block) < 2 * sms:
        block //= 2
    small = _cdiv(numel, block) < 2 * sms
    warps = max(1, min(8, block // t["small_elems_per_warp" if small else "elems_per_warp"]))
    return TileConfig(1, block, _warps(kind, warps))


def group_config(device: torch.device, n_rows: int, groups_per_row: int, block_g: int) -> TileConfig:
    """Per-token-group quant: ``block_m`` groups (of ``block_n`` = the padded group width) of one
    row per program."""
    kind = device_kind(device)
    return _apply_override("group", _group_config(kind, sm_count(device), n_rows, groups_per_row, block_g))


@functools.lru_cache(maxsize=512)
def _group_config(kind: str, sms: int, n_rows: int, groups_per_row: int, block_g: int) -> TileConfig:
    t = _table(GROUP_TABLE, kind)
    groups = max(1, min(next_pow2(groups_per_row), t["elems"] // block_g))
    min_groups = max(1, min(groups, t["min_elems"] // block_g))
    while groups > min_groups and n_rows * _cdiv(groups_per_row, groups) < 2 * sms:
        groups //= 2
    small = n_rows * _cdiv(groups_per_row, groups) < 2 * sms
    per_warp = 32 * (8 if small else t["elems_per_thread"])
    return TileConfig(groups, block_g, _warps(kind, max(1, min(8, groups * block_g // per_warp))))


def rotary_config(device: torch.device, is_neox: bool) -> RotaryConfig:
    """neox: 8 warps per program; gptj: 4 (H200, bf16, (32 + 8) heads of 128: at 4096 tokens
    neox 26.8 us at 8 warps, 37.0 at 4, the same-size copy 25.7; gptj 26.4 at 4, 26.8 at 8, where
    its de-interleave loses the 16-byte accesses). Neox took 4 below 2 x SMs tokens until
    2026-12-04, from a decode timing under the runner's old timer; seven interleaved rounds of the
    current one (h200/2026-12-04-fourteenth-rounds-rotary.txt), us, 4 -> 8 warps (Liger): 1 token
    1.413 -> 1.411 (1.517), 16 tokens 1.614 -> 1.597 (1.664), 256 tokens 3.768 -> 3.511 (3.619)."""
    kind = device_kind(device)
    return _apply_override("rotary", RotaryConfig(_warps(kind, 8 if is_neox else 4)))


# ---- benchmark sweeps -------------------------------------------------------------------------

#: alternatives the runner's --sweep times per config kind (fields replaced in the table's pick;
#: for ``rows`` only block_m and num_warps, since block_n must cover the row)
SWEEP: dict[str, tuple[dict[str, Any], ...]] = {
    "rows": tuple({"num_warps": w} for w in (4, 8, 16, 32)) + ({"block_m": 2},)
    + tuple({"programs_per_sm": p} for p in (1, 2, 4)) + ({"maxnreg": 32}, {"maxnreg": 32, "programs_per_sm": 4}),
    # the gated ops: the previous kernel's code (bounds checks and int64 offsets everywhere), then
    # small tiles at decode sizes (more programs for a few rows) and, beyond, Inductor's two
    # pointwise shapes (1024 / 4 warps, 512 / 8) and larger tiles
    "tile": ({"even": False, "int32": False},)
    + tuple({"block_n": n, "num_warps": w, "_tokens": (0, 256)} for n, w in ((128, 1), (256, 1), (256, 2), (512, 1),
                                                                          (512, 2), (1024, 4), (2048, 8)))
    + tuple({"block_n": n, "num_warps": w, "_tokens": (257, _INF)} for n, w in ((512, 4), (512, 8), (1024, 4),
                                                                             (1024, 8), (2048, 4), (2048, 8), (4096, 8)))
    # no eviction hint (Inductor's pointwise kernels give their loads none), alone and with
    # Inductor's launch shapes
    + ({"evict": False},)
    # the 2-D grid (no division before the loads) at decode sizes, alone and with small tiles
    + tuple(dict({"grid2d": True, "_tokens": (0, 256)}, **shape) for shape in (
        {}, {"evict": False}, {"block_n": 256, "num_warps": 2}, {"block_n": 512, "num_warps": 2},
        {"block_n": 256, "num_warps": 2, "evict": False}))
    # the width as a constant (Inductor's per-shape code), at decode sizes and beyond
    + tuple(dict({"const_width": True}, **shape) for shape in ({}, {"evict": False}))
    # one or two elements per thread at decode sizes (a latency-bound launch: the shortest chain
    # of dependent work per thread, e.g. erf's branches), on the 2-D grid
    + tuple({"grid2d": True, "block_n": n, "num_warps": w, "_tokens": (0, 256)}
            for n, w in ((128, 4), (256, 4), (256, 8), (512, 8), (512, 16), (1024, 16)))
    + tuple({"evict": False, "block_n": n, "num_warps": w, "_tokens": (257, _INF)} for n, w in ((1024, 4), (2048, 8)))
    # more elements per thread beyond decode sizes (the compute-bound situ measured 168 / 143 / 130
    # us at 4 / 8 / 16 per thread, 4096 x 2 x 14336), with the width as a constant
    + tuple({"const_width": True, "block_n": n, "num_warps": w, "_tokens": (257, _INF)}
            for n, w in ((1024, 1), (2048, 2), (4096, 4), (2048, 4), (1024, 4), (1024, 8)))
    + ({"const_width": True, "evict": False, "block_n": 1024, "num_warps": 4, "_tokens": (257, _INF)},),
    # the unary ops: the previous kernel's code (bounds checks and int64 offsets everywhere), no
    # eviction hint, then block sizes and warps
    "flat": ({"even": False, "int32": False}, {"evict": False}, {"evict": False, "block_n": 1024, "num_warps": 4})
    + tuple({"block_n": n, "num_warps": w} for n, w in ((512, 1), (1024, 4), (2048, 4), (2048, 8), (4096, 4),
                                                        (4096, 8), (8192, 8), (8192, 16), (16384, 16)))
    # one or two elements per thread at decode sizes (as for the gated tiles)
    + tuple({"block_n": n, "num_warps": w, "_tokens": (0, 256)} for n, w in ((128, 4), (256, 4), (512, 8), (1024, 16))),
    # the RMSNorm family. Keys starting with "_" limit an alternative to shapes (sweep_alternatives):
    # "_tokens" / "_width": inclusive (low, high) bounds on the rows and the padded row width.
    # First the code generation: the previous kernel's (bounds checks everywhere, int64 offsets,
    # the weight loaded after the reduction), the weight after the reduction alone, no eviction
    # hint (Inductor's persistent reductions give x none); then warps (none that leave more than
    # 64 fp32 elements of a row per thread); then at mid and prefill sizes the rows per program
    # and the persistent grid.
    "rms": ({"even": False, "int32": False, "w_first": False}, {"w_first": False}, {"evict": False},
            {"num_warps": 2, "_width": (0, 4096)}, {"num_warps": 4}, {"num_warps": 8}, {"num_warps": 16},
            {"num_warps": 32, "_width": (8192, _INF)},
            {"num_warps": 8, "evict": False, "_tokens": (257, _INF), "_width": (8192, _INF)},
            # Liger's one-row kernel compiles to the same sm_90 code as 16 warps without the hint
            # (offline SASS, 2026-12-03), and its Gemma form led at 256 x 8192; never timed here yet
            {"num_warps": 16, "evict": False, "_width": (8192, 8192)},
            {"block_m": 2, "_tokens": (257, _INF)}, {"programs_per_sm": 1, "_tokens": (257, _INF)},
            {"programs_per_sm": 2, "_tokens": (257, _INF)}, {"programs_per_sm": 4, "_tokens": (257, _INF)},
            {"programs_per_sm": 4, "maxnreg": 32, "_tokens": (257, _INF)})
    # the looped kernel (Inductor's form for every size: pass 1 reads the row in chunks, keeping
    # it in L2, pass 2 re-reads it from there and writes), by chunk and warps
    + tuple({"single_tile": False, "block_n": n, "num_warps": w, "_tokens": (16, _INF)}
            for n, w in ((512, 4), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8), (4096, 16)))
    # and with the width compiled in (RowConfig.const_width), and the looped picks without it
    + tuple({"single_tile": False, "block_n": n, "num_warps": w, "const_width": True, "_tokens": (16, _INF)}
            for n, w in ((2048, 8), (2048, 16), (4096, 8), (4096, 16)))
    + ({"single_tile": False, "block_n": 8192, "num_warps": 16, "const_width": True, "_tokens": (16, _INF),
        "_width": (8192, _INF)},)
    + ({"const_width": False, "_tokens": (2049, _INF)},)
    # the single tile where a decode-class pick loops (the fused gated norms' decode_min_rows)
    + tuple({"single_tile": True, "num_warps": w, "_tokens": (129, 256), "_width": (4096, 4096)} for w in (4, 8, 16))
    # the stores marked evict-first (the in-place fused adds at 4096 x 4096 ran ~1 us behind the
    # same kernel writing fresh buffers, 2026-12-03; the single tile's as well since the twelfth
    # day), alone, without the load hint, and with the looped picks' chunks
    + ({"store_evict": True, "_tokens": (2049, _INF)}, {"store_evict": True, "evict": False, "_tokens": (2049, _INF)})
    + tuple({"single_tile": False, "block_n": n, "num_warps": w, "const_width": True, "store_evict": True,
             "_tokens": (2049, _INF)} for n, w in ((2048, 8), (4096, 16))),
    "rotary": ({"num_warps": 4}, {"num_warps": 8}, {"num_warps": 16}, {"min_splits": 2}),
    "group": tuple({"block_m": m, "num_warps": w} for m, w in ((16, 2), (16, 4), (32, 4), (32, 8), (64, 4), (64, 8))),
}


def sweep_alternatives(alternatives: tuple[dict[str, Any], ...], tokens: int, width: int) -> list[dict[str, Any]]:
    """The alternatives that apply to a shape of ``tokens`` rows of ``width`` lanes (padded to a
    power of two), without their "_" filter keys."""
    width = next_pow2(width)
    out = []
    for alt in alternatives:
        lo_t, hi_t = alt.get("_tokens", (0, _INF))
        lo_w, hi_w = alt.get("_width", (0, _INF))
        if lo_t <= tokens <= hi_t and lo_w <= width <= hi_w:
            out.append({k: v for k, v in alt.items() if not k.startswith("_")})
    return out


@contextlib.contextmanager
def override(kind: str, **fields: Any) -> Iterator[None]:
    """Within the block, configs of ``kind`` (rows, rms, tile, flat, ...) get ``fields`` replaced."""
    if kind not in SWEEP:
        raise ValueError(f"_tuning.override: unknown kind {kind!r}; known: {sorted(SWEEP)}")
    previous = _OVERRIDES.get(kind)
    _OVERRIDES[kind] = fields
    try:
        yield
    finally:
        if previous is None:
            _OVERRIDES.pop(kind, None)
        else:
            _OVERRIDES[kind] = previous
