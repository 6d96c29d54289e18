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

The tables (with the measurements beside them) are in ``_tuning_tables``, the config dataclasses in
``_tuning_configs``, the sweeps' alternatives in ``_tuning_sweeps``; this module picks configs from
the tables and re-exports those names (``_tuning.RMS_TABLE``, ``_tuning.SWEEP``, ...). The
selection functions read the tables through this module's names: a test patches ``_tuning``'s.
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
from customop.backends.triton._tuning_configs import RotaryConfig, RowConfig, TileConfig
from customop.backends.triton._tuning_sweeps import SWEEP, sweep_alternatives  # noqa: F401  (re-exported)
from customop.backends.triton._tuning_tables import (
    _INF,
    GROUP_TABLE,
    LOOP_ROW,
    QUANT_ROW_ELEMS_PER_THREAD,
    RMS_EVICT_MAX_ROWS,
    RMS_LOOPED,
    RMS_RESIDUAL_DECODE_WARPS,
    RMS_TABLE,
    RMS_VARIANTS,
    ROW_TABLE,
    TILE_TABLE,
)

_ALIASES = {"xpu": "cuda", "cpu": "cuda", "hip": "cuda"}
_OVERRIDES: dict[str, dict[str, Any]] = {}


def device_kind(device: torch.device) -> str:
    if device.type == "cuda":
        return "hip" if torch.version.hip else "cuda"
    return device.type


@functools.cache
def _sm_count(device_type: str, index: int | None) -> int:
    if device_type == "cuda":
        index = index if index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_properties(index).multi_processor_count
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
