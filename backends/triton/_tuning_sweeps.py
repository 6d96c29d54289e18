"""The alternatives the benchmark runner's ``--sweep`` times per config kind (``SWEEP``) and their
shape filters (``sweep_alternatives``); ``_tuning.override`` applies one, and ``_tuning`` re-exports
both names."""

from __future__ import annotations

from typing import Any

from customop.backends.triton._common import next_pow2
from customop.backends.triton._tuning_tables import _INF

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
    + tuple({"block_n": n, "num_warps": w, "_tokens": (257, _INF)}
            for n, w in ((512, 4), (512, 8), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8)))
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
