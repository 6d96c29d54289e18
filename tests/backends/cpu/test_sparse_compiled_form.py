"""gelu_and_mul_sparse's CPU compiled tier compiles ``gelu_and_mul_sparse_two_pass`` (the row std
as the root of the mean squared deviation, not ``Tensor.std``'s Welford reduction, which Inductor's
width-dynamic code ran at 0.72-0.90x a per-shape torch.compile): fresh random inputs at odd widths
and row counts in every dtype against the float64 reference, rows whose mean dwarfs their spread
(where a one-pass ``E[a^2] - E[a]^2`` would cancel), and the wiring (the two-pass artifacts are
the ones built, on both routes)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from customop.backends.cpu import standalone
from customop.config import Config, use_config
from customop.ops import activation as A
from customop.samples.activation import BY_LABEL as ACT
from customop.testing import assert_close, tolerance
from tests.backends.cpu.compile_counting import fresh_compiles, graphs  # noqa: F401  (autouse fixture)
from tests.cases import activation as act_ref

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
LABELS = ["gelu_and_mul_sparse[0.95]", "gelu_and_mul_sparse[0.3,tanh]"]


def compiled_op(label):
    """The op compiling from one element (every call takes the compiled tier), the route on."""
    with use_config(Config(custom_ops=["all"])):
        op = ACT[label].build()
    op.cpu_tiers = op.cpu_tiers.compiling_from(1)
    return op


def expected(op, x):
    # the op's std multiplier is an fp32 constant: in fp64 that rounding shows, so the reference
    # takes the op's multiplier there (as the route's other tests do)
    if x.dtype == torch.float64:
        return act_ref.ref_gelu_and_mul_sparse(x, op._std_multiplier, op.approximate)
    return None


def test_the_compiled_tier_compiles_the_two_pass_form():
    assert A.GeluAndMulSparse.compiled_fn is A.gelu_and_mul_sparse_two_pass
    op = compiled_op(LABELS[0])
    x = ACT[LABELS[0]].input((3, 2 * 40), torch.float32)
    with torch.no_grad():
        op.forward_cpu(x)
    two_pass = standalone.family(A.gelu_and_mul_sparse_two_pass, {}, dynamic_hidden=True)
    spec = standalone.family(A.gelu_and_mul_sparse, {}, dynamic_hidden=True)
    assert two_pass.artifacts and not spec.artifacts


@pytest.mark.slow
@pytest.mark.parametrize("label", LABELS)
def test_two_pass_form_matches_float64_on_both_routes(label):
    """1, 6 and 257 rows of odd widths (517, 2 * 1031 read), every dtype: within the dtype's
    tolerance of the float64 reference (with the spec's rounding slack, as every path that runs
    the spec's math), no Dynamo graph, and bitwise what the Dynamo path (the same form through
    torch.compile) gives."""
    case = ACT[label]
    op = compiled_op(label)
    dynamo = copy.copy(op)
    dynamo.cpu_tiers = dataclasses.replace(op.cpu_tiers, standalone=False)
    gen = torch.Generator().manual_seed(18)
    for dtype in DTYPES:
        got = []
        before = graphs()
        with torch.no_grad():
            for rows, width in ((1, 517), (6, 1031), (257, 517)):
                x = case.input((rows, 2 * width), dtype, generator=gen)
                out = op.forward_cpu(x)
                act_ref.assert_matches(case, op, x, out, spec_rounding=True, expected=expected(op, x))
                got.append((x, out))
        assert graphs() == before, dtype
        with torch.no_grad():
            for x, out in got:
                assert torch.equal(out, dynamo.forward_cpu(x)), (dtype, tuple(x.shape))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_whose_mean_dwarfs_their_spread(dtype):
    """Gates 1000 + N(0, 0.01): the two-pass std keeps its digits (a one-pass sum of squares
    would lose all of fp32's: a std off by ~0.2, the cutoff by ~0.4). What any arithmetic in the
    dtype loses is the mean's rounding, a few ulps of 1000 in ``a - cutoff``, times |b|: the
    tolerance allows 16 of them."""
    case = ACT[LABELS[0]]
    op = compiled_op(LABELS[0])
    gen = torch.Generator().manual_seed(1000)
    rows, width = 9, 777
    gate = 1000 + 0.01 * torch.randn(rows, width, generator=gen, dtype=torch.float64)
    up = torch.randn(rows, width, generator=gen, dtype=torch.float64)
    x = torch.cat([gate, up], dim=-1).to(dtype)
    with torch.no_grad():
        out = op.forward_cpu(x)
    want = expected(op, x)
    if want is None:
        want = act_ref.reference(case, x.double(), op)
    cancellation = 16 * torch.finfo(dtype).eps * float(gate.abs().max() * up.abs().max())
    atol, rtol = tolerance(dtype)
    assert_close(out, want, dtype, atol=atol + cancellation, rtol=rtol, what="gates of mean 1000")
    assert out.count_nonzero() > 0  # the 95th percentile cutoff keeps ~5% of the gates


# ---- the small-size band: every size compiles; bf16/fp16 with the spec's roundings -------------


def shipped_op(label):
    with use_config(Config(custom_ops=["all"])):
        return ACT[label].build()


def _recording(monkeypatch):
    """(x's shape, the form, thread option, emulated casts) of every ``standalone.run`` call."""
    taken, real_run = [], standalone.run

    def recording_run(fam, x, *args, **kwargs):
        taken.append((tuple(x.shape), fam.form.__name__, fam.options.get("cpp.threads", -1),
                      bool(fam.options.get("emulate_precision_casts"))))
        return real_run(fam, x, *args, **kwargs)

    monkeypatch.setattr(standalone, "run", recording_run)
    return taken


def test_band_wiring():
    tiers = A.GeluAndMulSparse.cpu_tiers
    assert tiers.compile_from(torch.bfloat16) == tiers.compile_from(torch.float16) == 1 << 14
    assert tiers.compile_from(torch.float32) == tiers.compile_from(torch.float64) == 1 << 11
    assert tiers.compiled_up_to == (1 << 14) - 1 and tiers.one_thread_up_to == 1 << 13 and tiers.standalone
    assert all(tiers.runs_compiled(n, dt) for n in (1, 2047, 2048, (1 << 14) - 1, 1 << 14) for dt in DTYPES)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_band_is_bitwise_the_spec(dtype, monkeypatch):
    """bf16/fp16 below 16K elements: the rounded-statistics form with emulated casts, bitwise
    ``forward_native`` on fresh inputs (1-15 rows, odd widths, both cases' multipliers and GELU
    forms), the one-thread artifacts up to 8K elements and the threaded ones above, no Dynamo
    graph; at 16K the main (two-pass) form, within the spec's tolerance."""
    taken = _recording(monkeypatch)
    gen = torch.Generator().manual_seed(7)
    before = graphs()
    for label in LABELS:
        case, op = ACT[label], shipped_op(label)
        with torch.no_grad():
            for rows, width in ((1, 3), (1, 4095), (3, 1365), (2, 2048), (2, 2049), (15, 545), (1, 8191)):
                x = case.input((rows, 2 * width), dtype, generator=gen)
                out = op.forward_cpu(x)
                assert torch.equal(out, op.forward_native(x)), (label, rows, width)
                act_ref.assert_matches(case, op, x, out, spec_rounding=True)
            x = case.input((1, 2 * 8192), dtype, generator=gen)  # 16K elements: the threshold
            act_ref.assert_matches(case, op, x, op.forward_cpu(x), spec_rounding=True)
    assert graphs() == before
    band = [(s, "gelu_and_mul_sparse_rounded_statistics", 1 if s[0] * s[1] <= 1 << 13 else -1, True)
            for s in ((1, 6), (1, 8190), (3, 2730), (2, 4096), (2, 4098), (15, 1090), (1, 16382))]
    main = [((1, 16384), "gelu_and_mul_sparse_two_pass", -1, False)]
    assert taken == (band + main) * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_fp32_and_fp64_band_compile_the_main_form(dtype, monkeypatch):
    """Below their 2K threshold fp32/fp64 run the two-pass form (no emulated casts: nothing to
    round), within the float64 reference's tolerance, one thread up to 8K."""
    taken = _recording(monkeypatch)
    case, op = ACT[LABELS[0]], shipped_op(LABELS[0])
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for rows, width in ((1, 5), (3, 333), (1, 1023)):
            x = case.input((rows, 2 * width), dtype, generator=gen)
            act_ref.assert_matches(case, op, x, op.forward_cpu(x), spec_rounding=True, expected=expected(op, x))
    assert [t[1:] for t in taken] == [("gelu_and_mul_sparse_two_pass", 1, False)] * 3


def test_compile_off_keeps_the_eager_spec(monkeypatch):
    """``compiling_from(inf)`` (tests, the benchmarks' eager-tier column): no band, the spec."""
    taken = _recording(monkeypatch)
    op = shipped_op(LABELS[0])
    op.cpu_tiers = op.cpu_tiers.compiling_from(float("inf"))
    x = ACT[LABELS[0]].input((3, 2 * 1000), torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(op.forward_cpu(x), op.forward_native(x))
    assert not taken


@pytest.mark.slow
def test_warmup_builds_both_forms(monkeypatch):
    """``customop.warmup`` at its defaults builds the band's (rounded statistics) and the main
    form's artifacts, one row included, so that requests of any size compile nothing."""
    import customop

    op = shipped_op(LABELS[0])
    rows = customop.warmup([op], dtypes=(torch.bfloat16, torch.float32))
    assert rows and all(r.outcome == "ran" for r in rows)
    before, built = graphs(), standalone.compiles
    taken = _recording(monkeypatch)
    case = ACT[LABELS[0]]
    with torch.no_grad():
        for dtype in (torch.bfloat16, torch.float32):
            for rows_, width in ((1, 100), (1, 4000), (3, 2048), (1, 9000), (40, 1024), (2, 700)):
                x = case.input((rows_, 2 * width), dtype)
                act_ref.assert_matches(case, op, x, op.forward_cpu(x), spec_rounding=True)
    assert graphs() == before and standalone.compiles == built
    assert len(taken) == 12


@pytest.mark.slow
def test_width_classes_share_artifacts():
    """Inductor chunks an fp32 sum over more than 4096 elements, guarding the width on it: the
    sparse op's artifacts serve output widths up to 4096 or above. A width of the other class gets
    a width-dynamic artifact of its class (``standalone._width_class_artifact``), which every later
    width of that class shares, x's widths that are multiples of 64 one traced as 64 x a symbol:
    output widths 64 and 4096 the first artifact, 4097 and 9000 (x not a multiple of 64) a second,
    16384 and 8192 + 32 a third (quantum 64); 4095 the first again. Both boundaries' sides within
    tolerance, bitwise the Dynamo path; no Dynamo graph."""
    case = ACT[LABELS[0]]
    op = compiled_op(LABELS[0])
    dynamo = copy.copy(op)
    dynamo.cpu_tiers = dataclasses.replace(op.cpu_tiers, standalone=False)
    before, built = graphs(), standalone.compiles
    got = []
    with torch.no_grad():
        for width, compiled in ((64, 1), (4096, 1), (4097, 2), (9000, 2), (16384, 3), (8224, 3), (4095, 3)):
            x = case.input((3, 2 * width), torch.float32)
            out = op.forward_cpu(x)
            act_ref.assert_matches(case, op, x, out, spec_rounding=True)
            assert standalone.compiles - built == compiled, width
            got.append((x, out))
    assert graphs() == before
    fam = standalone.family(A.gelu_and_mul_sparse_two_pass, {}, dynamic_hidden=True)
    widths = [a for a in fam.artifacts.values() if isinstance(a, standalone.Widths)]
    assert sorted({id(a): a.quantum for a in widths}.values()) == [2, 2, 64]
    with torch.no_grad():
        for x, out in got:
            assert torch.equal(out, dynamo.forward_cpu(x)), tuple(x.shape)
