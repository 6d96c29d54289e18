"""The standalone route (backends/cpu/standalone.py, issue 18) beyond the norms: the activations'
and QuantFP8's compiled tiers. Fresh random inputs at 1, 7 and 4231 rows in every dtype the ops
take, against the float64 references and bitwise against the Dynamo path it replaces; one
artifact for every token count of two or more (one more for one token), no Dynamo graph while the
guards hold; one artifact for every width too (the width is symbolic in these ops' traces, its
guards checked once per new width: a width that fails one gets an artifact of its own); guard
failures (including a graph that returns an input, QuantFP8's static scale, and x of another rank
where the outputs do not follow x's rows) fall back with the right result."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from customop.backends.cpu import CpuTiers, run_tiered, standalone
from customop.config import Config, use_config
from customop.ops import activation as A
from customop.ops.quantization import input_quant_fp8
from customop.samples.activation import BY_LABEL as ACT
from customop.samples.quant import BY_LABEL as QUANT
from customop.testing import assert_close
from tests.backends.cpu.compile_counting import fresh_compiles, graphs  # noqa: F401  (autouse fixture)
from tests.cases import activation as act_ref
from tests.cases import quant as quant_ref

D = 1031  # odd output width: the vector loops' tails run too (gated ops read 2 * D)
ROWS = (1, 7, 4231)
ACT_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
QUANT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
FP8 = torch.float8_e4m3fn

#: one case per activation op with a compiled tier (gelu never compiles, gelu_tanh on AVX2 CPUs
#: only; swigluoai_and_mul compiles a de-interleaved copy, which keeps the Dynamo path)
ACT_CASES = ["silu_and_mul", "mul_and_silu", "gelu_and_mul[tanh]", "gelu_and_mul_sparse[0.95]", "fatrelu_and_mul",
             "swiglustep_and_mul", "silu_and_mul_with_clamp[1.702,1]", "situ_and_mul[4,25]", "gelu_new",
             "gelu_fast", "quick_gelu", "relu2", "xielu", "gelu_tanh"]
#: the dynamic modes that take the route (2-D x, no padding; scale_ub is a one-element tensor)
QUANT_CASES = ["dynamic per-tensor", "dynamic per-token", "dynamic per-token scale_ub", "per-group 64",
               "per-group 64 ue8m0", "per-group 128", "per-group 128 column-major"]


def via_dynamo(op):
    """The same op with its compiled tier called through Dynamo, as before."""
    other = copy.copy(op)
    other.cpu_tiers = dataclasses.replace(op.cpu_tiers, standalone=False)
    return other


def act_op(label):
    """The op compiling from one element, the route on (as shipped)."""
    with use_config(Config(custom_ops=["all"])):
        op = ACT[label].build()
    op.cpu_tiers = dataclasses.replace(op.cpu_tiers.compiling_from(1), standalone=True)
    return op


def quant_op(label):
    """The op compiling from one element, the route on (as shipped)."""
    with use_config(Config(custom_ops=["all"])):
        op = quant_ref.build(QUANT[label], FP8)
    op.cpu_tiers = dataclasses.replace(op.cpu_tiers.compiling_from(1), standalone=True)
    return op


def act_input(label, rows, dtype, seed, width=D):
    case = ACT[label]
    gen = torch.Generator().manual_seed(seed)
    return case.input((rows, 2 * width if case.gated else width), dtype, generator=gen)


def test_tiers_wiring():
    # the route is on for every compiled activation (swigluoai_and_mul compiles a de-interleaved
    # copy: Dynamo's path) and QuantFP8, width-dynamic: customop.warmup cannot know their widths
    compiled = [A.SiluAndMul, A.MulAndSilu, A.GeluAndMul, A.GeluAndMulSparse, A.FatreluAndMul, A.SwigluStepAndMul,
                A.SiluAndMulWithClamp, A.SituAndMul, A.NewGELU, A.FastGELU, A.QuickGELU, A.ReLUSquaredActivation,
                A.XIELU, A.SwigluOAIAndMul]
    assert all(cls.cpu_tiers.standalone and cls.cpu_tiers.dynamic_hidden for cls in compiled)
    assert A.GELUTanh.cpu_tiers.min_numel == (1 << 20 if torch.backends.cpu.get_cpu_capability() == "AVX2"
                                              else math.inf)
    assert A.GELUTanh.cpu_tiers.standalone or A.GELUTanh.cpu_tiers.min_numel == math.inf
    tiers = input_quant_fp8.QUANT_CPU_TIERS
    assert tiers.standalone and tiers.dynamic_hidden and not tiers.rows
    assert A.SiluAndMul.cpu_tiers.standalone_family(A.silu_and_mul).dynamic_hidden


@pytest.mark.slow
@pytest.mark.parametrize("label", ACT_CASES)
def test_activation_float64_reference_and_bitwise_the_dynamo_path(label):
    """1, 7 and 4231 rows in bf16, fp16, fp32 and fp64: within the dtype's tolerance of the float64
    reference, bitwise what the Dynamo path gives, no Dynamo graph, two artifacts per dtype."""
    case = ACT[label]
    op = act_op(label)
    for dtype in ACT_DTYPES:
        before, built = graphs(), standalone.compiles
        got = {}
        with torch.no_grad():
            for rows in ROWS:
                x = act_input(label, rows, dtype, seed=rows)
                got[rows] = x, op.forward_cpu(x)
                expected = None
                if dtype == torch.float64 and case.op == "gelu_and_mul_sparse":
                    # the op's std multiplier is a float32 constant (an fp32 icdf): in fp64 that
                    # rounding shows, so the reference takes the op's multiplier
                    expected = act_ref.ref_gelu_and_mul_sparse(x, op._std_multiplier, op.approximate)
                if dtype == torch.float64 and case.op == "situ_and_mul":
                    # the spec computes situ in fp32 whatever the input dtype: fp32's tolerance
                    assert_close(got[rows][1], act_ref.reference(case, x, op), torch.float32)
                    continue
                act_ref.assert_matches(case, op, x, got[rows][1], spec_rounding=True, expected=expected)
        assert graphs() == before and standalone.compiles - built == 2, dtype
        dynamo = via_dynamo(op)
        with torch.no_grad():
            for rows, (x, out) in got.items():
                assert torch.equal(out, dynamo.forward_cpu(x)), (dtype, rows)


@pytest.mark.slow
@pytest.mark.parametrize("label", QUANT_CASES)
def test_quant_float64_reference_and_bitwise_the_dynamo_path(label):
    """1, 7 and 4231 rows x 1024 in bf16, fp16 and fp32: the scales exactly and q bit for bit
    against the float64 reference (and the scales' layout), bitwise the Dynamo path's (q, scale),
    strides included; no Dynamo graph, two artifacts per dtype."""
    case = QUANT[label]
    op = quant_op(label)
    for dtype in QUANT_DTYPES:
        before, built = graphs(), standalone.compiles
        got = {}
        with torch.no_grad():
            for rows in ROWS:
                x = case.input((rows, 1024), dtype, generator=torch.Generator().manual_seed(rows))
                kwargs = case.call_kwargs(x, op.fp8_max)
                got[rows] = x, kwargs, op.forward_cpu(x, **kwargs)
                quant_ref.check_against_reference(case, x, got[rows][2], FP8, kwargs)
        assert graphs() == before and standalone.compiles - built == 2, dtype
        dynamo = via_dynamo(op)
        with torch.no_grad():
            for rows, (x, kwargs, (q, scale)) in got.items():
                q2, scale2 = dynamo.forward_cpu(x, **kwargs)
                assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)), (dtype, rows)
                assert torch.equal(scale, scale2) and scale.stride() == scale2.stride(), (dtype, rows)


@pytest.mark.slow
@pytest.mark.parametrize("label", ["static per-tensor", "static per-channel", "static per-group 128",
                                   "dynamic per-token padded 12", "dynamic per-tensor padded 12",
                                   "per-group 128 ue8m0 column-major tma"])
def test_quant_modes_the_route_refuses(label):
    """Static scales (the spec returns the caller's tensor: a graph returning an input is never
    compiled standalone), padding to a token count and TMA-aligned scales (their trace guards on
    the rows: a multiple of 4, the padding) keep Dynamo's path for two or more rows, with the
    reference's result."""
    case = QUANT[label]
    op = quant_op(label)
    with torch.no_grad():
        for rows in (7, 4231):
            x = case.input((rows, 1024), torch.bfloat16, generator=torch.Generator().manual_seed(rows))
            kwargs = case.call_kwargs(x, op.fp8_max)
            quant_ref.check_against_reference(case, x, op.forward_cpu(x, **kwargs), FP8, kwargs)
            fam = op.cpu_tiers.standalone_family(input_quant_fp8.quant_fp8)
            assert standalone.run(fam, x, (kwargs.get("scale"), kwargs.get("scale_ub")), op._math) is None


@pytest.mark.slow
def test_one_artifact_serves_every_token_count():
    op, quant = act_op("silu_and_mul"), quant_op("per-group 128")
    before, built = graphs(), standalone.compiles
    with torch.no_grad():
        for rows in (2, 3, 7, 64, 4231, 5, 1, 1, 2):
            x = act_input("silu_and_mul", rows, torch.bfloat16, seed=rows)
            act_ref.assert_matches(ACT["silu_and_mul"], op, x, op.forward_cpu(x))
            gen = torch.Generator().manual_seed(rows)
            xq = QUANT["per-group 128"].input((rows, 1024), torch.bfloat16, generator=gen)
            quant_ref.check_against_reference(QUANT["per-group 128"], xq, quant.forward_cpu(xq), FP8, {})
        assert standalone.compiles - built == 4  # per op: rows >= 2 (dynamic) and one row (static)
        assert graphs() == before
        # 3-D x: the activation (rows) runs on a view of its rows, same artifact
        x = act_input("silu_and_mul", 15, torch.bfloat16, seed=9).view(3, 5, 2 * D)
        out = op.forward_cpu(x)
        assert out.shape == (3, 5, D) and torch.equal(out.flatten(0, 1), op.forward_cpu(x.flatten(0, 1)))
        assert standalone.compiles - built == 4 and graphs() == before
        # another width: the same artifact (the width is symbolic); another argument value: a new one
        x = act_input("silu_and_mul", 6, torch.bfloat16, seed=6, width=D + 2)
        act_ref.assert_matches(ACT["silu_and_mul"], op, x, op.forward_cpu(x))
        assert standalone.compiles - built == 4
        fat = act_op("fatrelu_and_mul")
        x = act_input("fatrelu_and_mul", 6, torch.float32, seed=6)
        act_ref.assert_matches(ACT["fatrelu_and_mul"], fat, x, fat.forward_cpu(x))
        fat.threshold = -0.5
        act_ref.assert_matches(ACT["fatrelu_and_mul"], fat, x, fat.forward_cpu(x))
        assert standalone.compiles - built == 6 and graphs() == before
        # 3-D x for QuantFP8 (no ``rows``: its scales need not follow x's rows): Dynamo's path
        xq = QUANT["per-group 128"].input((3, 5, 1024), torch.bfloat16, generator=torch.Generator().manual_seed(3))
        q, scale = quant.forward_cpu(xq)
        q2, scale2 = quant.forward_cpu(xq.flatten(0, 1))
        assert q.shape == xq.shape and scale.shape == (3, 5, 8)
        assert torch.equal(q.flatten(0, 1).view(torch.uint8), q2.view(torch.uint8))
        assert torch.equal(scale.flatten(0, 1), scale2)
        assert standalone.compiles - built == 6 and graphs() > before


def _verdicts(fam):
    """width -> verdict of the family's width-dynamic artifacts (rows >= 2 and one row)."""
    return [art.verdicts for art in fam.artifacts.values() if isinstance(art, standalone.Widths)]


#: (label, widths, the dtype): the gated ops read twice the width; 7 and 4231 odd, 1 the gated
#: split to one column (which its guards exclude: ``Ne(w // 2, 1)``)
WIDTH_CASES = [("silu_and_mul", (7, 4231, 64), torch.bfloat16), ("gelu_new", (7, 4231, 64), torch.float32),
               ("xielu", (7, 4231), torch.bfloat16)]


@pytest.mark.slow
@pytest.mark.parametrize("label,widths,dtype", WIDTH_CASES, ids=[c[0] for c in WIDTH_CASES])
def test_one_artifact_serves_every_width(label, widths, dtype):
    """Odd and 4K-ish widths at 3 rows and one row: one artifact for each (built at the first
    width), no Dynamo graph, within tolerance of the float64 reference and bitwise the Dynamo
    path's (whose graph is dynamic in the width too)."""
    op = act_op(label)
    before, built = graphs(), standalone.compiles
    # silu_and_mul's 3 x 128 (x's width a multiple of 64) also builds its aligned artifact
    # (``CpuTiers.aligned_widths``: tests/backends/cpu/test_aligned_widths.py)
    aligned = int(op.cpu_tiers.aligned_widths and 64 in widths)
    got = []
    with torch.no_grad():
        for width in widths:
            for rows in (3, 1) if label != "xielu" else (3,):
                x = act_input(label, rows, dtype, seed=width + rows, width=width)
                got.append((x, op.forward_cpu(x)))
                act_ref.assert_matches(ACT[label], op, x, got[-1][1], spec_rounding=True)
        assert standalone.compiles - built == (2 if label != "xielu" else 1) + aligned and graphs() == before
        fam = op.cpu_tiers.standalone_family(type(op).math_fn)
        read = {2 * w if ACT[label].gated else w for w in widths}  # x's width: the verdicts' key
        assert all(set(v) == read and all(v.values()) for v in _verdicts(fam))
        dynamo = via_dynamo(op)
        for x, out in got:
            assert torch.equal(out, dynamo.forward_cpu(x)), tuple(x.shape)
        if ACT[label].gated:
            # a width its artifact's guards exclude (one output column): an artifact of its own
            x = act_input(label, 3, dtype, seed=1, width=1)
            out = op.forward_cpu(x)
            act_ref.assert_matches(ACT[label], op, x, out, spec_rounding=True)
            assert torch.equal(out, dynamo.forward_cpu(x))
            assert standalone.compiles - built == 3 + aligned and any(v.get(2) is False for v in _verdicts(fam))
            op.forward_cpu(x)
            assert standalone.compiles - built == 3 + aligned  # remembered: no check and no build again


@pytest.mark.slow
def test_quant_one_artifact_serves_every_width():
    """Per-group 128 at widths of 2, 33 and 8 groups: one artifact (traced as 128 x a width symbol,
    which is at least 2), q and the scales exactly the reference's and the Dynamo path's; one
    group (width 128) and a width of no whole group (200, which the spec pads) get artifacts of
    their own (or the Dynamo path), never the shared one."""
    label = "per-group 128"
    case, op = QUANT[label], quant_op(label)
    dynamo = via_dynamo(op)
    before, built = graphs(), standalone.compiles
    got = {}
    with torch.no_grad():
        for width in (256, 4224, 1024, 128, 200):
            x = case.input((3, width), torch.float32, generator=torch.Generator().manual_seed(width))
            got[width] = x, op.forward_cpu(x)
            quant_ref.check_against_reference(case, x, got[width][1], FP8, {})
            if width == 1024:
                assert standalone.compiles - built == 1 and graphs() == before
        for width in (256, 4224, 128):  # bitwise the Dynamo path (a sample: its graphs take seconds)
            x, (q, scale) = got[width]
            q2, scale2 = dynamo.forward_cpu(x)
            assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(scale, scale2), width
    fam = op.cpu_tiers.standalone_family(input_quant_fp8.quant_fp8)
    (verdicts,) = _verdicts(fam)
    assert verdicts == {256: True, 4224: True, 1024: True, 128: False, 200: False}


@pytest.mark.slow
@pytest.mark.parametrize("rows", [1, 3])
def test_quant_one_group_first_keeps_the_shared_artifact_open(rows):
    """Per-group 128 whose first call is one group wide: its trace fixes the width (the group
    count 1 specialises), so width 128 gets an artifact of its own and the next width builds the
    shared width-dynamic one, which widths 4224 and 1024 share. Before, the first
    build was refused (its guards named the fixed width's symbol) and remembered under the shared
    key, which sent every later width of the row class to Dynamo's path (1x4096 bf16 31.5 against
    18.4 us a call). Every dtype, fresh random inputs: q and the scales exactly the reference's,
    no Dynamo graph, two artifacts; a sample bitwise the Dynamo path."""
    label = "per-group 128"
    case, op = QUANT[label], quant_op(label)
    dynamo = via_dynamo(op)
    fam = op.cpu_tiers.standalone_family(input_quant_fp8.quant_fp8)
    for dtype in QUANT_DTYPES:
        before, built = graphs(), standalone.compiles
        got = {}
        with torch.no_grad():
            for width in (128, 4224, 1024, 128):
                x = case.input((rows, width), dtype, generator=torch.Generator().manual_seed(width + rows))
                got[width] = x, op.forward_cpu(x)
                quant_ref.check_against_reference(case, x, got[width][1], FP8, {})
        assert graphs() == before and standalone.compiles - built == 2, dtype
        shared = [a for k, a in fam.artifacts.items() if isinstance(a, standalone.Widths) and k[0] is dtype
                  and k[1] is None and a.width is not None]
        assert len(shared) == 1 and shared[0].verdicts == {4224: True, 1024: True, 128: False}, dtype
        if dtype is torch.bfloat16:
            with torch.no_grad():
                for width in (128, 1024):
                    x, (q, scale) = got[width]
                    q2, scale2 = dynamo.forward_cpu(x)
                    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(scale, scale2)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ACT_DTYPES, ids=str)
def test_swigluoai_small_size_band(dtype):
    """swigluoai_and_mul as shipped: bf16/fp16 up to 64K elements run the interleaved spec's
    artifact without Dynamo (the small-size band), the eager tier above it and the de-interleaved
    compiled path from the 128K threshold; fp32/fp64 keep the eager tier below theirs. Odd widths,
    fresh random inputs: within tolerance of the float64 reference, the band's calls bitwise the
    same graph through Dynamo, no Dynamo graph for them, two artifacts (one row and more); a
    non-contiguous input and a call recording autograd take the eager tier, compiling nothing."""
    case = ACT["swigluoai_and_mul"]
    with use_config(Config(custom_ops=["all"])):
        op = case.build()
    low = dtype in (torch.bfloat16, torch.float16)
    band = A._SWIGLUOAI_BAND
    assert band.compiled_up_to == 1 << 16 and band.standalone
    assert op.cpu_tiers.compile_from(dtype) == (1 << 17 if low else 1 << 21)
    before, built = graphs(), standalone.compiles
    got = {}
    with torch.no_grad():
        for rows in (1, 3, 31):  # 31 x 2062 = 63922 elements: the band's last sizes
            x = act_input("swigluoai_and_mul", rows, dtype, seed=rows + 40, width=1031)
            got[rows] = x, op.forward_cpu(x)
            act_ref.assert_matches(case, op, x, got[rows][1], spec_rounding=True)
        assert graphs() == before and standalone.compiles - built == (2 if low else 0), dtype
        if low:
            dynamo = dataclasses.replace(band, standalone=False)
            for rows, (x, out) in got.items():
                assert torch.equal(out, run_tiered(dynamo, A.swigluoai_and_mul, x, op.alpha, op.limit)), rows
        built = standalone.compiles
        for rows, width in ((40, 1031), (40, 1700)):  # above the band (eager); the bf16 threshold
            x = act_input("swigluoai_and_mul", rows, dtype, seed=rows + width, width=width)
            act_ref.assert_matches(case, op, x, op.forward_cpu(x), spec_rounding=True)
        strided = torch.empty(2 * 1031, 5, dtype=dtype).t().copy_(
            act_input("swigluoai_and_mul", 5, dtype, seed=9, width=1031))
        act_ref.assert_matches(case, op, strided, op.forward_cpu(strided), spec_rounding=True)
    x = act_input("swigluoai_and_mul", 3, dtype, seed=11, width=1031).requires_grad_()
    out = op.forward_cpu(x)
    assert out.requires_grad
    act_ref.assert_matches(case, op, x.detach(), out.detach(), spec_rounding=True)
    assert standalone.compiles == built


@pytest.mark.slow
def test_swigluoai_warmup_builds_both_paths():
    """After ``customop.warmup`` (bf16, in the requests' grad mode: Dynamo guards on it),
    swigluoai_and_mul's band calls (1, 3 and 31 rows) and its de-interleaved path (40 rows of
    3400) compile nothing, at widths warm-up did not see."""
    import customop

    with use_config(Config(custom_ops=["all"])):
        op = ACT["swigluoai_and_mul"].build()
    with torch.no_grad():
        rows = customop.warmup([op], dtypes=(torch.bfloat16,))
    assert all(r.outcome == "ran" for r in rows)
    before, built = graphs(), standalone.compiles
    with torch.no_grad():
        for tokens, width in ((1, 1031), (3, 1031), (31, 1031), (40, 1700), (2, 4096), (7, 4096)):
            x = act_input("swigluoai_and_mul", tokens, torch.bfloat16, seed=tokens, width=width)
            act_ref.assert_matches(ACT["swigluoai_and_mul"], op, x, op.forward_cpu(x), spec_rounding=True)
            assert graphs() == before and standalone.compiles == built, (tokens, width)


class _Sub(torch.Tensor):
    pass


@pytest.mark.slow
def test_guard_failures_take_the_dynamo_path():
    """Each failing guard: ``standalone.run`` says no and forward_cpu (through Dynamo) still gives
    the reference's result; a tensor keyword argument says no too."""
    dtype = torch.bfloat16
    op = act_op("situ_and_mul[4,25]")
    fam = op.cpu_tiers.standalone_family(type(op).math_fn)
    built = standalone.compiles
    x = act_input("situ_and_mul[4,25]", 5, dtype, seed=11)
    cases = {
        "non-contiguous": torch.empty(2 * D, 5, dtype=dtype).t().copy_(x),
        "negative bit": torch._neg_view(x),
        "subclass": x.as_subclass(_Sub),
        "requires-grad": x.clone().requires_grad_(),
        "zero rows": x[:0],
        "1-D": x[0],
    }
    for name, t in cases.items():
        assert standalone.run(fam, t, op.math_args()) is None, name
        if name == "negative bit":  # torch.compile ignores the bit itself: no reference (see the norms' test)
            continue
        with torch.no_grad() if name != "requires-grad" else torch.enable_grad():
            out = op.forward_cpu(t)
        plain = t.detach().as_subclass(torch.Tensor)
        act_ref.assert_matches(ACT["situ_and_mul[4,25]"], op, plain, out.detach().as_subclass(torch.Tensor),
                               spec_rounding=True)
        if name == "requires-grad":
            assert out.requires_grad
    # keyword arguments: values only; a tensor among them says no
    quant = quant_op("dynamic per-token")
    qfam = quant.cpu_tiers.standalone_family(input_quant_fp8.quant_fp8)
    assert standalone.run(qfam, x, (None, None), {**quant._math, "extra": torch.ones(1)}) is None
    assert standalone.compiles == built  # nothing above reached a build


def test_a_graph_that_mutates_or_returns_an_input_is_not_compiled():
    def mutates(x):
        x.mul_(2)
        return x + 1

    def returns_a_view(x, w):
        return x * w, w.view(1, -1)

    built = standalone.compiles
    x, w = torch.randn(4, 16), torch.randn(16)
    assert standalone.run(standalone.family(mutates, {}), x.clone(), ()) is None
    assert standalone.run(standalone.family(returns_a_view, {}), x, (w,)) is None
    assert standalone.compiles - built == 2  # built and refused, remembered as None
    assert standalone.run(standalone.family(returns_a_view, {}), x, (w,)) is None
    assert standalone.compiles - built == 2
    # through run_tiered: Dynamo's path, whose result is the caller's storage
    tiers = CpuTiers(1, standalone=True)
    out, view = run_tiered(tiers, returns_a_view, x, w)
    assert view.data_ptr() == w.data_ptr() and torch.equal(out, x * w)


def test_values_holding_tensors_are_refused():
    """Only plain values (scalars, strings, dtypes, tuples of those) are keyed and baked in; a
    tuple holding a tensor, an object or an unhashable value says no before any build."""
    fam = standalone.family(A.fatrelu_and_mul, {})
    x = torch.randn(3, 32)
    built = standalone.compiles
    for value in ((torch.ones(1),), object(), [0.5]):
        assert standalone.run(fam, x, (value,)) is None, value
    qfam = standalone.family(input_quant_fp8.quant_fp8, {})
    with use_config(Config(custom_ops=["all"])):
        quant = quant_ref.build(QUANT["dynamic per-token"], FP8)
    assert standalone.run(qfam, x, (None, None), {**quant._math, "group_shape": (torch.ones(1), 1)}) is None
    assert standalone.compiles == built
