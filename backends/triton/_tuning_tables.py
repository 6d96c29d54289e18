"""The measured tuning tables of the Triton kernels, keyed by device type, with the measurements
behind each number beside it. Plain data: ``_tuning`` picks configs from them and re-exports every
name, and its selection functions read them through those names (so a test patches ``_tuning.X``).
The config kinds, device types and how the numbers were measured: ``_tuning``'s docstring."""

from __future__ import annotations

from typing import Any

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
