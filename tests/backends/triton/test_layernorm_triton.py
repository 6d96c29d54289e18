"""The norm kernels (backends/triton/layernorm.py, grouped_norm.py) under the Triton
interpreter: every case of the table (``customop/samples/layernorm.py``) through
``forward_kernel`` (the launcher as the CPU kernel of its ``customop::`` op) against the float64
references (``tests/cases/layernorm.py``), then the launchers directly (strided views, tilings,
the looped and persistent variants) and through ``torch.ops.customop.*`` (opcheck,
torch.compile)."""

from __future__ import annotations

import functools

import pytest
import torch

from customop.backends.triton import _tuning, grouped_norm
from customop.backends.triton import layernorm as norm
from customop.samples.layernorm import CASES, DTYPES, SIZES
from customop.testing import assert_close
from tests.backends.triton.conftest import as_cpu_kernel
from tests.cases.layernorm import (
    assert_matches, ref_fused_add, ref_fused_add_nemotron, ref_fused_gated, ref_gated, ref_gemma, ref_layer_norm,
    ref_rms_norm, reference,
)

pytestmark = pytest.mark.interpret

EPS = 1e-6
LOOPED = _tuning.RowConfig(1, 1024, 4, False)  # forces the chunked two-pass variant
LAUNCHERS = {name.removeprefix("customop::"): launcher
             for name, launcher in {**norm.KERNELS, **grouped_norm.KERNELS}.items()}


def _x(shape, dtype, scale=1.0, offset=0.0):
    return (torch.randn(shape) * scale + offset).to(dtype)


# ---- the table, through forward_kernel -----------------------------------------------------------

PARAMS = [pytest.param(c, s, id=f"{c.label}-{'x'.join(map(str, s))}") for c in CASES for s in SIZES["small"]]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case,shape", PARAMS)
def test_kernel_matches_float64_reference(case, shape, dtype, poison_empty):
    op = case.build(shape[-1], dtype)
    args = case.inputs(shape, dtype)
    expected = reference(case, op, *args)
    with as_cpu_kernel(case.library_op, LAUNCHERS[case.library_op]) as calls:
        got = op.forward_kernel(*args, **case.call_kwargs)
    assert len(calls) == 1, "forward_kernel did not reach the Triton launcher"
    assert_matches(got, expected, dtype, what=case.label)
    if case.in_place:  # written in place
        assert got[0] is args[0] and got[1] is args[1]


# ---- the launchers directly ---------------------------------------------------------------------


@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_fused_add_on_strided_views_leaves_padding_alone(gemma):
    """x and residual are column slices of wider poisoned buffers: the kernel writes through
    the row stride and never into the padding."""
    launcher = norm.gemma_fused_add_rms_norm if gemma else norm.fused_add_rms_norm
    hidden, pad = 100, 28
    xbuf = torch.full((9, hidden + pad), float("nan"))
    rbuf = torch.full((9, hidden + pad), float("nan"))
    x, r = xbuf[:, :hidden], rbuf[:, pad:]
    x.copy_(_x((9, hidden), torch.float32, 2.0))
    r.copy_(_x((9, hidden), torch.float32, 2.0))
    w = _x((hidden,), torch.float32, 0.5, 1.0)
    want_out, want_res = ref_fused_add(x, r, w, EPS, gemma)
    launcher(x, r, w, EPS)
    assert_close(x, want_out, torch.float32)
    assert_close(r, want_res, torch.float32)
    assert xbuf[:, hidden:].isnan().all() and rbuf[:, :pad].isnan().all()


@pytest.mark.parametrize("launcher,ref_kind", [(norm.fused_add_rms_norm, "llama"),
                                               (norm.gemma_fused_add_rms_norm, "gemma"),
                                               (norm.fused_add_nemotron_layer_norm, "nemotron")])
def test_fused_add_into_other_buffers(launcher, ref_kind, poison_empty):
    """``out`` / ``residual_out`` (the benchmark's fresh-output form): the same results written
    into NaN-poisoned buffers, x and residual left as they were."""
    x, r = _x((7, 100), torch.float32, 2.0), _x((7, 100), torch.float32, 2.0)
    w, b = _x((100,), torch.float32, 0.5, 1.0), _x((100,), torch.float32, 0.5)
    x0, r0 = x.clone(), r.clone()
    out, res_out = torch.full_like(x, float("nan")), torch.full_like(r, float("nan"))
    if ref_kind == "nemotron":
        launcher(x, r, w, b, EPS, out=out, residual_out=res_out)
        want = ref_fused_add_nemotron(x0, r0, w, b, EPS)
    else:
        launcher(x, r, w, EPS, out=out, residual_out=res_out)
        want = ref_fused_add(x0, r0, w, EPS, ref_kind == "gemma")
    assert_close((out, res_out), want, torch.float32)
    assert torch.equal(x, x0) and torch.equal(r, r0)


def test_non_row_viewable_inputs_fall_back_to_copies(poison_empty):
    """A transposed x has no [rows, hidden] view with unit stride: computed on a copy, written
    back in place."""
    x = _x((64, 6), torch.float32, 2.0).t()  # [6, 64], last-dim stride 6
    r = _x((6, 64), torch.float32, 2.0)
    w = _x((64,), torch.float32, 0.5, 1.0)
    assert_close(norm.rms_norm(x, w, EPS), ref_rms_norm(x, w, EPS).float(), torch.float32)
    want_out, want_res = ref_fused_add(x, r, w, EPS)
    norm.fused_add_rms_norm(x, r, w, EPS)
    assert_close(x, want_out.float(), torch.float32)
    assert_close(r, want_res.float(), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_looped_variant(dtype, poison_empty):
    """Rows wider than the largest tile take the chunked variant; forced here on small rows."""
    x, r = _x((3, 4231), dtype, 2.0), _x((3, 4231), dtype, 2.0)
    w = _x((4231,), dtype, 0.5, 1.0)
    out = torch.empty_like(x)
    norm._norm(x, None, w, EPS, out, kind=norm.RMS, config=LOOPED)
    assert_close(out, ref_rms_norm(x, w, EPS).to(dtype), dtype)
    want_out, want_res = ref_fused_add(x, r, w, EPS, gemma=True)
    norm._norm(x, r, w, EPS, x, kind=norm.GEMMA, config=LOOPED)
    assert_close(x, want_out.to(dtype), dtype)
    assert_close(r, want_res.to(dtype), dtype)


@pytest.mark.parametrize("rows_per_program", [1, 2, 8])
def test_rows_per_program(rows_per_program, poison_empty):
    x, w = _x((13, 100), torch.float32, 2.0), _x((100,), torch.float32)
    out = torch.empty_like(x)
    norm._norm(x, None, w, EPS, out, kind=norm.RMS, config=_tuning.RowConfig(rows_per_program, 128, 4, True))
    assert_close(out, ref_rms_norm(x, w, EPS).float(), torch.float32)


@pytest.mark.parametrize("block_m", [1, 4])
def test_persistent_grid(block_m, poison_empty):
    """programs_per_sm > 0: fewer programs than row blocks, each looping over several blocks
    (the interpreter counts one SM, so one program does every block here)."""
    cfg = _tuning.RowConfig(block_m, 128, 4, True, programs_per_sm=1)
    assert _tuning.row_grid(torch.device("cpu"), cfg, 13) == ((1,), 2)
    x, r, w = _x((13, 100), torch.bfloat16, 2.0), _x((13, 100), torch.bfloat16, 2.0), _x((100,), torch.bfloat16, 0.5, 1.0)
    want_out, want_res = ref_fused_add(x, r, w, EPS)
    norm._norm(x, r, w, EPS, x, kind=norm.RMS, config=cfg)
    assert_close(x, want_out.bfloat16(), torch.bfloat16)
    assert_close(r, want_res.bfloat16(), torch.bfloat16)


class _LaunchSpy:
    """Wraps a @triton.jit kernel: records each launch's constexprs, then launches it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append({"grid": grid, **kwargs})
            return self.kernel[grid](*args, **kwargs)

        return launch


# rows, width, config -> the code-generation constexprs the launcher must pick
_CODEGEN = [
    # 13 rows in blocks of 4: only the last block is bounds-checked; 100 of 128 lanes: columns too
    (13, 100, _tuning.RowConfig(4, 128, 4, True), {"ROW_MASK": 1, "EVEN_N": False, "INT64": False}),
    # 12 rows in blocks of 4 and the whole 128-lane row: no check at all
    (12, 128, _tuning.RowConfig(4, 128, 4, True), {"ROW_MASK": 0, "EVEN_N": True, "INT64": False}),
    (13, 128, _tuning.RowConfig(1, 128, 2, True, w_first=False), {"ROW_MASK": 0, "EVEN_N": True, "W_FIRST": False}),
    # the host's 64-bit choice forced; the previous kernel's code (checks everywhere, int64, weight last)
    (13, 128, _tuning.RowConfig(4, 128, 4, True, int32=False), {"ROW_MASK": 1, "EVEN_N": True, "INT64": True}),
    (13, 100, _tuning.RowConfig(8, 128, 4, True, even=False, int32=False, w_first=False, evict=False),
     {"ROW_MASK": 2, "EVEN_N": False, "INT64": True, "W_FIRST": False, "POLICY": ""}),
    (12, 128, _tuning.RowConfig(4, 128, 4, True, even=False), {"ROW_MASK": 2, "EVEN_N": False, "INT64": False}),
    # persistent grid (the interpreter has one "SM": one program loops over every block), with
    # and without a tail block, 32- and 64-bit
    (13, 100, _tuning.RowConfig(4, 128, 4, True, programs_per_sm=1), {"ROW_MASK": 1, "PERSISTENT": True}),
    (12, 128, _tuning.RowConfig(4, 128, 4, True, programs_per_sm=1, int32=False),
     {"ROW_MASK": 0, "EVEN_N": True, "PERSISTENT": True, "INT64": True}),
    (13, 128, _tuning.RowConfig(2, 128, 4, True, programs_per_sm=1, even=False, w_first=False),
     {"ROW_MASK": 2, "PERSISTENT": True, "INT64": False}),
    (7, 37, _tuning.RowConfig(1, 64, 1, True, evict=False), {"ROW_MASK": 0, "EVEN_N": False, "POLICY": ""}),
    # the looped kernel (a tail chunk) with pass 2's stores marked evict-first, and without
    (13, 100, _tuning.RowConfig(1, 64, 2, False, store_evict=True), {"SINGLE_TILE": False, "STORE_POLICY": "evict_first"}),
    (13, 100, _tuning.RowConfig(1, 64, 2, False), {"SINGLE_TILE": False, "STORE_POLICY": "", "POLICY": "evict_first"}),
    # the looped kernel's pass-2 loads without the evict-first hint
    (13, 100, _tuning.RowConfig(1, 64, 2, False, evict=False), {"SINGLE_TILE": False, "POLICY": ""}),
    # the single tile's stores evict-first, with and without a persistent grid
    (13, 100, _tuning.RowConfig(4, 128, 4, True, store_evict=True), {"ROW_MASK": 1, "STORE_POLICY": "evict_first"}),
    (12, 128, _tuning.RowConfig(4, 128, 4, True, programs_per_sm=1, store_evict=True, evict=False),
     {"PERSISTENT": True, "STORE_POLICY": "evict_first", "POLICY": ""}),
]


_KINDS = {"llama": norm.RMS, "gemma": norm.GEMMA, "layer": norm.LAYER, "nemotron": norm.NEMOTRON}


def _kind_refs(kind, x, r, w, b):
    """(reference of norm(x), references of the fused add's (out, residual)) of a norm kind; the
    layer norms' fused add is Nemotron's (the one op that has it)."""
    if kind in (norm.RMS, norm.GEMMA):
        gemma = kind is norm.GEMMA
        return (ref_gemma(x, w, EPS) if gemma else ref_rms_norm(x, w, EPS)), ref_fused_add(x, r, w, EPS, gemma=gemma)
    return (ref_layer_norm(x, w, b, EPS, one_plus=kind is norm.NEMOTRON),
            ref_fused_add_nemotron(x, r, w, b, EPS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", list(_KINDS.values()), ids=list(_KINDS))
@pytest.mark.parametrize("rows,width,config,expect", _CODEGEN,
                         ids=[f"{r}x{w}-{'-'.join(f'{k}{v}' for k, v in e.items())}" for r, w, _, e in _CODEGEN])
def test_norm_codegen_knobs(rows, width, config, expect, kind, dtype, monkeypatch):
    """Every code-generation choice of the row-norm kernel (bounds checks per block / none,
    32- / 64-bit offsets, weight first / last, eviction hint, persistent grid) on odd shapes, for
    every norm kind: the launcher picks the expected constexprs, and the norm and the fused add
    (outputs poisoned with NaN) match the float64 references."""
    spy = _LaunchSpy(norm._norm_kernel)
    monkeypatch.setattr(norm, "_norm_kernel", spy)
    layer = kind in (norm.LAYER, norm.NEMOTRON)
    x, r = _x((rows, width), dtype, 2.0, 1.0 if layer else 0.0), _x((rows, width), dtype, 2.0)
    w = _x((width,), dtype, 0.5, 0.0 if kind in (norm.GEMMA, norm.NEMOTRON) else 1.0)
    b = _x((width,), dtype, 0.5) if layer else None
    want, (want_out, want_res) = _kind_refs(kind, x, r, w, b)
    out = torch.full_like(x, float("nan"))
    norm._norm(x, None, w, EPS, out, kind, config=config, bias=b)
    assert_close(out, want.to(dtype), dtype)
    fused_kind = norm.NEMOTRON if layer else kind
    norm._norm(x, r, w, EPS, x, fused_kind, config=config, bias=b)
    assert_close(x, want_out.to(dtype), dtype)
    assert_close(r, want_res.to(dtype), dtype)
    assert len(spy.launches) == 2
    for launch in spy.launches:
        assert {k: launch[k] for k in expect} == expect


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("sigmoid", [False, True], ids=["silu", "sigmoid"])
@pytest.mark.parametrize("rows,width,config,expect", _CODEGEN,
                         ids=[f"{r}x{w}-{'-'.join(f'{k}{v}' for k, v in e.items())}" for r, w, _, e in _CODEGEN])
def test_fused_gated_codegen_knobs(rows, width, config, expect, sigmoid, dtype, monkeypatch):
    """The fused gated norms on the row-norm kernel through the same code-generation choices:
    the gate read with x's masks and offsets, and the fp32 residual sum stored into a buffer of
    its own (fp32 here: no rounding to x's dtype)."""
    spy = _LaunchSpy(norm._norm_kernel)
    monkeypatch.setattr(norm, "_norm_kernel", spy)
    x, g = _x((rows, width), dtype, 2.0), _x((rows, width), dtype, 2.0)
    r, w = _x((rows, width), torch.float32, 2.0), _x((width,), dtype, 0.5, 1.0)
    got = norm.fused_rms_norm_gated(x, g, w, EPS, sigmoid, config=config)
    assert_close(got, ref_fused_gated(x, g, w, EPS, sigmoid)[0].to(dtype), dtype)
    y, res_out = norm.fused_add_rms_norm_gated(x, g, r, w, EPS, sigmoid, config=config)
    want_y, want_s = ref_fused_gated(x, g, w, EPS, sigmoid, r)
    assert_close(y, want_y.to(dtype), dtype)
    assert_close(res_out, want_s.float(), torch.float32)
    assert len(spy.launches) == 2
    for launch in spy.launches:
        assert {k: launch[k] for k in expect} == expect


def test_rms_offsets_switch_to_int64_beyond_int32():
    """The host's 32-bit test: the furthest element of the padded last block must fit."""
    assert norm._offsets_fit(2, 4096, (4096,))
    assert norm._offsets_fit(1 << 18, 8192, (8192,))  # 32768 * 8 rows of 8192: 2**31 - 1 at most
    assert not norm._offsets_fit((1 << 18) + 1, 8192, (8192,))
    assert not norm._offsets_fit(3, 128, (128, 1 << 30))  # any one tensor's stride decides


def test_rms_size_classes_and_sweep_filters():
    """RMS_TABLE's classes (one row per program at decode sizes) and the shape filters of the
    ``rms`` sweep (no alternative leaves more than 64 elements of a row per thread)."""
    cfg = _tuning._rms_config("cuda", 132, 16, 4096)
    assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.single_tile) == (1, 4096, 8, True)
    assert _tuning._rms_config("cuda", 132, 4096, 512).block_m == 8
    # decode rows of 8192 lanes: 8 warps, 16 with a residual (RMS_RESIDUAL_DECODE_WARPS); AMD halves
    assert _tuning._rms_config("cuda", 132, 1, 8192).num_warps == 8
    assert _tuning._rms_config("cuda", 132, 256, 8192, True).num_warps == 16
    assert _tuning._rms_config("hip", 304, 256, 8192, True).num_warps == 8
    assert _tuning._rms_config("cuda", 132, 257, 8192, True).num_warps == 16  # mid sizes: the table's
    assert not _tuning._rms_config("cuda", 132, 16, 65536).single_tile
    # prefill sizes (RMS_LOOPED): the looped kernel, half-row chunks (the row with a residual),
    # the width compiled in
    assert _tuning._rms_config("cuda", 132, 32768, 4096) == _tuning.RowConfig(1, 2048, 8, False, const_width=True)
    assert _tuning._rms_config("cuda", 132, 32768, 4096, True) == _tuning.RowConfig(1, 4096, 16, False, const_width=True)
    assert _tuning._rms_config("cuda", 132, 32768, 8192) == _tuning.RowConfig(1, 4096, 16, False, const_width=True)
    # the fused adds at 8192 lanes: 128 lanes per warp (residual_lanes_per_warp)
    assert _tuning._rms_config("cuda", 132, 32768, 5120, True) == _tuning.RowConfig(1, 4096, 32, False, const_width=True)
    # decode_min_rows (the fused gated norms only): 129-256 rows of 4096 lanes without a residual
    # loop over the whole row; the RMSNorm family keeps the single tile there
    assert _tuning._rms_config("cuda", 132, 256, 4096) == _tuning.RowConfig(1, 4096, 8, True)
    assert _tuning._rms_config("cuda", 132, 129, 4096, variant="gated") == _tuning.RowConfig(1, 4096, 16, False,
                                                                                             const_width=True)
    assert _tuning._rms_config("cuda", 132, 128, 4096).single_tile
    assert _tuning._rms_config("cuda", 132, 256, 4096, True).single_tile
    assert _tuning._rms_config("cuda", 132, 256, 8192).single_tile
    assert _tuning._rms_config("cuda", 132, 256, 2048).single_tile
    assert _tuning._rms_config("cuda", 132, 256, 4096, variant="layer").single_tile
    assert _tuning._rms_config("cuda", 132, 8192, 4096).single_tile  # mid sizes keep the single tile
    assert _tuning._rms_config("cuda", 132, 32768, 2048).single_tile  # narrower rows: not measured
    # from 2048 rows: 8192+ lanes, and 4096+ lanes with a residual (RMS_LOOPED's min_rows by width)
    assert _tuning._rms_config("cuda", 132, 4096, 8192) == _tuning.RowConfig(1, 4096, 16, False, const_width=True)
    assert _tuning._rms_config("cuda", 132, 4096, 4096, True) == _tuning.RowConfig(1, 4096, 16, False, const_width=True)
    assert _tuning._rms_config("cuda", 132, 4096, 4096).single_tile
    assert _tuning._rms_config("cuda", 132, 2048, 8192).single_tile
    assert _tuning._rms_config("cuda", 132, 4096, 2048, True).single_tile
    # RMS_VARIANTS: the layer norms never loop and take two rows per program above decode sizes;
    # the fused gated norms take 16 warps at decode sizes of 4096 lanes and loop from 2048 rows
    # of 8192 lanes (of 4096 with a residual) on 16 warps with evict-first stores, in 4096-lane
    # chunks (with a residual: the whole row at 4096 lanes, 2048-lane chunks at 8192)
    assert _tuning._rms_config("cuda", 132, 32768, 8192, variant="layer") == _tuning.RowConfig(2, 8192, 16, True, evict=False)
    assert _tuning._rms_config("cuda", 132, 16, 8192, variant="layer").block_m == 1
    assert _tuning._rms_config("cuda", 132, 16, 4096, variant="gated").num_warps == 16
    assert _tuning._rms_config("cuda", 132, 16, 4096).num_warps == 8
    gated_looped = functools.partial(_tuning.RowConfig, 1, single_tile=False, const_width=True, store_evict=True)
    assert _tuning._rms_config("cuda", 132, 4096, 8192, variant="gated") == gated_looped(4096, 16)
    assert _tuning._rms_config("cuda", 132, 4096, 8192, True, "gated") == gated_looped(2048, 16)
    assert _tuning._rms_config("cuda", 132, 4096, 4096, True, "gated") == gated_looped(4096, 16)
    assert _tuning._rms_config("cuda", 132, 2048, 4096, True, "gated").single_tile
    assert _tuning._rms_config("cuda", 132, 4096, 4096, variant="gated").single_tile
    assert not _tuning._rms_config("cuda", 132, 256, 4096, variant="gated").store_evict  # the decode class's loop
    assert not _tuning._rms_config("cuda", 132, 4096, 4096, variant="gated").evict
    assert _tuning._rms_config("cuda", 132, 256, 4096, variant="gated").evict
    # with a residual, from residual_x_first_rows rows of the decode class: x's load before the weight's
    assert not _tuning._rms_config("cuda", 132, 256, 4096, True, "gated").w_first
    assert not _tuning._rms_config("cuda", 132, 129, 8192, True, "gated").w_first
    assert _tuning._rms_config("cuda", 132, 128, 4096, True, "gated").w_first
    assert _tuning._rms_config("cuda", 132, 257, 4096, True, "gated").w_first
    assert _tuning._rms_config("cuda", 132, 256, 4096, True).w_first  # the RMSNorm family: unchanged
    # the RMSNorm family's fused adds read x and the residual without the evict-first hint
    assert not _tuning._rms_config("cuda", 132, 16, 8192, True).evict
    assert _tuning._rms_config("cuda", 132, 16, 8192).evict
    assert _tuning._rms_config("cuda", 132, 16, 8192, True, "gated").evict
    # the evict-first hint on x up to RMS_EVICT_MAX_ROWS (2048) rows
    assert _tuning._rms_config("cuda", 132, 2048, 4096).evict
    assert not _tuning._rms_config("cuda", 132, 4096, 4096).evict
    for tokens in (1, 16, 256, 4096, 32768):
        for width in (4096, 8192):
            alts = _tuning.sweep_alternatives(_tuning.SWEEP["rms"], tokens, width)
            assert alts and all(not k.startswith("_") for a in alts for k in a)
            assert all(width // (32 * a["num_warps"]) <= 64 for a in alts if "num_warps" in a)
            assert any("programs_per_sm" in a for a in alts) == (tokens > 256)
    with _tuning.override("rms", num_warps=2):
        assert _tuning.rms_config(torch.device("cpu"), 16, 4096).num_warps == 2


def test_rms_norm_gated_without_z_and_looped(poison_empty):
    x, w, z = _x((5, 300), torch.bfloat16, 2.0), _x((300,), torch.bfloat16, 0.5, 1.0), _x((5, 300), torch.bfloat16)
    assert_close(grouped_norm.rms_norm_gated(x, w, None, 1e-5, 100, False, False),
                 ref_gated(x, w, None, 1e-5, 100, False, False).bfloat16(), torch.bfloat16)
    for nbg in (False, True):
        out = grouped_norm.rms_norm_gated(x, w, z, 1e-5, 300, nbg, False, config=_tuning.RowConfig(1, 64, 4, False))
        assert_close(out, ref_gated(x, w, z, 1e-5, 300, nbg, False).bfloat16(), torch.bfloat16)


@pytest.mark.parametrize("width", [100, 2048, 4231], ids=lambda w: f"w{w}")
@pytest.mark.parametrize("dtype,offset", [(torch.float32, 200.0), (torch.bfloat16, 3.0)], ids=str)
def test_layer_norm_looped_variant(dtype, offset, width, poison_empty):
    """The looped variant (Welford statistics over 1024-lane chunks, then the writes), forced on
    rows narrower than one chunk, of whole chunks and with a tail chunk. The fp32 rows sit at
    200 with a spread of 4: a one-pass E[x^2] - mean^2 in fp32 is off by ~1e-3 there, beyond
    the tolerance, and a centred pass by ~7e-6."""
    x, r = _x((3, width), dtype, 4.0, offset=offset), _x((3, width), dtype, 2.0)
    w, b = _x((width,), dtype, 0.5, 1.0), _x((width,), dtype, 0.5)
    out = torch.full_like(x, float("nan"))
    norm._norm(x, None, w, EPS, out, norm.LAYER, config=LOOPED, bias=b)
    assert_close(out, ref_layer_norm(x, w, b, EPS).to(dtype), dtype)
    want_out, want_res = ref_fused_add_nemotron(x, r, w, b, EPS)
    norm._norm(x, r, w, EPS, x, norm.NEMOTRON, config=LOOPED, bias=b)
    assert_close(x, want_out.to(dtype), dtype)
    assert_close(r, want_res.to(dtype), dtype)


_CONST_WIDTH = _tuning.RowConfig(1, 1024, 4, False, const_width=True)


@pytest.mark.parametrize("width", [1024, 2048, 4231], ids=lambda w: f"w{w}")
@pytest.mark.parametrize("kind", list(_KINDS.values()), ids=list(_KINDS))
def test_looped_const_width(kind, width, monkeypatch, poison_empty):
    """RowConfig.const_width: the looped kernel with the width and the packed strides compiled
    in (no bounds checks where the 1024-lane chunk divides the width, checks on 4231), for every
    norm kind, the norm and the fused add against the float64 references; rows that are not
    packed (a view of wider rows) keep the runtime width."""
    spy = _LaunchSpy(norm._norm_kernel)
    monkeypatch.setattr(norm, "_norm_kernel", spy)
    dtype = torch.bfloat16
    layer = kind in (norm.LAYER, norm.NEMOTRON)
    x, r = _x((3, width), dtype, 2.0, 1.0 if layer else 0.0), _x((3, width), dtype, 2.0)
    w = _x((width,), dtype, 0.5, 0.0 if kind in (norm.GEMMA, norm.NEMOTRON) else 1.0)
    b = _x((width,), dtype, 0.5) if layer else None
    want, (want_out, want_res) = _kind_refs(kind, x, r, w, b)
    view = _x((3, width + 64), dtype, 2.0, 1.0 if layer else 0.0)[:, :width]
    want_view, _ = _kind_refs(kind, view, r, w, b)
    out = torch.full_like(x, float("nan"))
    norm._norm(x, None, w, EPS, out, kind, config=_CONST_WIDTH, bias=b)
    assert_close(out, want.to(dtype), dtype)
    norm._norm(x, r, w, EPS, x, norm.NEMOTRON if layer else kind, config=_CONST_WIDTH, bias=b)
    assert_close(x, want_out.to(dtype), dtype)
    assert_close(r, want_res.to(dtype), dtype)
    out_view = torch.full_like(view, float("nan"))
    norm._norm(view, None, w, EPS, out_view, kind, config=_CONST_WIDTH, bias=b)
    assert_close(out_view, want_view.to(dtype), dtype)
    assert [launch["WIDTH"] for launch in spy.launches] == [width, width, 0]


def test_nemotron_fused_add_on_strided_views_leaves_padding_alone():
    hidden, pad = 100, 28
    xbuf, rbuf = torch.full((9, hidden + pad), float("nan")), torch.full((9, hidden + pad), float("nan"))
    x, r = xbuf[:, :hidden], rbuf[:, pad:]
    x.copy_(_x((9, hidden), torch.float32, 2.0))
    r.copy_(_x((9, hidden), torch.float32, 2.0))
    w, b = _x((hidden,), torch.float32, 0.5), _x((hidden,), torch.float32, 0.5)
    want_out, want_res = ref_fused_add_nemotron(x, r, w, b, EPS)
    norm.fused_add_nemotron_layer_norm(x, r, w, b, EPS)
    assert_close(x, want_out, torch.float32)
    assert_close(r, want_res, torch.float32)
    assert xbuf[:, hidden:].isnan().all() and rbuf[:, :pad].isnan().all()


@pytest.mark.parametrize("config", [None, _tuning.RowConfig(1, 64, 4, False),
                                    _tuning.RowConfig(1, 64, 4, False, const_width=True)],
                         ids=["tile", "looped", "looped-const-width"])
def test_fused_rms_norm_gated_variants(config, poison_empty):
    """No weight, a transposed (copied) gate, an fp32 residual (its sum kept in fp32)."""
    x, w = _x((5, 300), torch.bfloat16, 2.0), _x((300,), torch.bfloat16, 0.5, 1.0)
    g = _x((300, 5), torch.bfloat16).t()
    r = _x((5, 300), torch.float32, 2.0)
    for weight, sigmoid in ((None, False), (w, True)):
        got = norm.fused_rms_norm_gated(x, g, weight, 1e-5, sigmoid, config=config)
        assert_close(got, ref_fused_gated(x, g, weight, 1e-5, sigmoid)[0], torch.bfloat16)
    y, res_out = norm.fused_add_rms_norm_gated(x, g, r, w, 1e-5, False, config=config)
    want_y, want_s = ref_fused_gated(x, g, w, 1e-5, False, r)
    assert y.dtype == torch.bfloat16 and res_out.dtype == torch.float32
    assert_close(y, want_y, torch.bfloat16)
    assert_close(res_out, want_s, torch.float32)


def test_rms_norm_gated_rejects_bad_group():
    with pytest.raises(ValueError, match="group_size"):
        grouped_norm.rms_norm_gated(torch.randn(2, 10), torch.ones(10), None, 1e-5, 3, False, False)


def test_empty_input():
    x = torch.randn(0, 16)
    assert norm.rms_norm(x, torch.ones(16), EPS).shape == (0, 16)
    norm.fused_add_rms_norm(x, x.clone(), None, EPS)


# ---- through torch.ops.customop.* ---------------------------------------------------------------


def _library_cases():
    x, r, w, z = _x((3, 40), torch.float32, 2.0), _x((3, 40), torch.float32), _x((40,), torch.float32, 0.5, 1.0), _x((3, 40), torch.float32)
    return {
        "rms_norm": (norm.rms_norm, (x, w, EPS)),
        "gemma_rms_norm": (norm.gemma_rms_norm, (x, w, EPS)),
        "rms_norm_gated": (grouped_norm.rms_norm_gated, (x, w, z, 1e-5, 20, False, True)),
        "fused_add_rms_norm": (norm.fused_add_rms_norm, (x, r, w, EPS)),
        "gemma_fused_add_rms_norm": (norm.gemma_fused_add_rms_norm, (x, r, w, EPS)),
        "layer_norm": (norm.layer_norm, (x, w, z[0], 1e-5)),
        "nemotron_layer_norm": (norm.nemotron_layer_norm, (x, w, z[0], 1e-5)),
        "fused_add_nemotron_layer_norm": (norm.fused_add_nemotron_layer_norm, (x, r, w, z[0], 1e-5)),
        "fused_rms_norm_gated": (norm.fused_rms_norm_gated, (x, z, w, 1e-5, False)),
        "fused_add_rms_norm_gated": (norm.fused_add_rms_norm_gated, (x, z, r, None, 1e-5, True)),
    }


def _clone_args(args):
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(_library_cases()))
def test_library_op_runs_kernel_and_passes_opcheck_and_compile(name):
    launcher, args = _library_cases()[name]
    op = getattr(torch.ops.customop, name)
    in_place = name.endswith(("fused_add_rms_norm", "fused_add_nemotron_layer_norm"))
    reference_args = _clone_args(args)
    expected = op(*reference_args)  # the reference implementation (no kernel registered yet)
    with as_cpu_kernel(name, launcher) as calls:
        got_args = _clone_args(args)
        got = op(*got_args)
        assert len(calls) == 1
        if in_place:
            assert_close(got_args[:2], reference_args[:2], torch.float32)
        else:
            assert_close(got, expected, torch.float32)
        torch.library.opcheck(op.default, _clone_args(args))

        def fn(*a):
            result = op(*a)
            return a[:2] if in_place else result

        torch.compiler.reset()
        compiled_args = _clone_args(args)
        out = torch.compile(fn, fullgraph=True)(*compiled_args)
        assert_close(out, got_args[:2] if in_place else got, torch.float32, atol=0, rtol=0)
        if in_place:  # the mutation reached the caller's tensors
            assert_close(compiled_args[:2], got_args[:2], torch.float32, atol=0, rtol=0)
        assert len(calls) > 1, "the compiled graph did not call the Triton kernel"
