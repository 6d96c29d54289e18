"""Static QuantFP8 on the CPU (issue 18): ``forward_cpu`` compiles ``static_quant`` (q alone) and
returns the caller's scale itself, so the standalone route takes static per-tensor scales (one
element, 1-D or 0-D) and per-channel ``[H]`` ones, with the small-size band below the 64K
threshold (one thread up to 32K elements); compiling ``quant_fp8`` gave a graph returning its scale
input, which the route refuses (Dynamo's path, 0.56-0.92x torch.compile). Fresh inputs at odd
widths, every dtype, q bit for bit against the float64 reference and the Dynamo path; the band's
boundaries on both sides; the static scales the route cannot take ([1, H], per token, per group)
and padding keep their former paths."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from customop.backends.cpu import standalone
from customop.config import Config, use_config
from customop.ops.quantization import GroupShape, QuantFP8, input_quant_fp8
from customop.samples.quant import BY_LABEL as QUANT
from tests.backends.cpu.compile_counting import fresh_compiles, graphs  # noqa: F401  (autouse fixture)
from tests.cases import quant as quant_ref

FP8 = torch.float8_e4m3fn
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ROUTED = ["static per-tensor", "static per-channel"]


def build(label, compile_from=None):
    with use_config(Config(custom_ops=["all"])):
        op = quant_ref.build(QUANT[label], FP8)
    if compile_from is not None:
        op.cpu_tiers = op.cpu_tiers.compiling_from(compile_from)
    return op


def case_input(label, rows, width, dtype, seed):
    case = QUANT[label]
    x = case.input((rows, width), dtype, generator=torch.Generator().manual_seed(seed))
    return x, case.call_kwargs(x, torch.finfo(FP8).max)


def same_q(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.slow
@pytest.mark.parametrize("label", ROUTED)
def test_static_scales_of_one_element_or_hidden_take_the_route(label):
    """1, 7 and 4231 rows of 1031 (odd: the vector tails run): q bit for bit the reference's, the
    returned scale the caller's (a view for per channel), no Dynamo graph, two artifacts per dtype
    (one row, more rows), and bitwise the Dynamo path compiling the same form."""
    case, op = QUANT[label], build(label, compile_from=1)
    dynamo = copy.copy(op)
    dynamo.cpu_tiers = dataclasses.replace(op.cpu_tiers, standalone=False)
    for dtype in DTYPES:
        before, built = graphs(), standalone.compiles
        got = []
        with torch.no_grad():
            for rows in (1, 7, 4231):
                x, kwargs = case_input(label, rows, 1031, dtype, seed=rows)
                out = op.forward_cpu(x, **kwargs)
                quant_ref.check_against_reference(case, x, out, FP8, kwargs)
                got.append((x, kwargs, out[0]))
        assert graphs() == before and standalone.compiles - built == 2, dtype
        with torch.no_grad():
            for x, kwargs, q in got:
                assert same_q(q, dynamo.forward_cpu(x, **kwargs)[0]), (dtype, x.shape)


def test_a_zero_dim_per_tensor_scale_gets_its_own_artifact():
    op = build("static per-tensor", compile_from=1)
    x, kwargs = case_input("static per-tensor", 5, 300, torch.bfloat16, seed=5)
    flat = kwargs["scale"].reshape(())
    before, built = graphs(), standalone.compiles
    with torch.no_grad():
        for scale in (kwargs["scale"], flat, flat):
            q, returned = op.forward_cpu(x, scale)
            assert returned is scale
            assert same_q(q, op.forward_native(x, scale)[0])
    assert standalone.compiles - built == 2 and graphs() == before


def _recording(monkeypatch):
    """(rows, width, thread option) of every ``standalone.run`` call."""
    taken, real_run = [], standalone.run

    def recording_run(fam, x, *args, **kwargs):
        taken.append((tuple(x.shape), fam.options.get("cpp.threads", -1)))
        return real_run(fam, x, *args, **kwargs)

    monkeypatch.setattr(standalone, "run", recording_run)
    return taken


def test_the_band_boundaries_as_shipped(monkeypatch):
    """Per tensor, the shipped tiers: the eager tier up to 8192 elements (``STATIC_EAGER_UP_TO``,
    the route not asked), one-thread artifacts from 8193 to 32767, the threads from 32768, the band
    up to 65535 and the threshold from 65536 (both on the threaded artifacts): each boundary from
    both sides, q bit for bit the spec's, no Dynamo graph."""
    tiers = input_quant_fp8.QUANT_CPU_TIERS
    assert tiers.one_thread_up_to == (1 << 15) - 1 and tiers.compile_from(torch.bfloat16) == 1 << 16
    assert input_quant_fp8.STATIC_EAGER_UP_TO == 1 << 13
    op = build("static per-tensor")
    taken = _recording(monkeypatch)
    before = graphs()
    shapes = [(1, 4096), (2, 4096), (1, 8193), (1, 32767), (1, 32768), (3, 21845), (1, 65535), (1, 65536),
              (16, 4096)]
    with torch.no_grad():
        for shape in shapes:
            x, kwargs = case_input("static per-tensor", *shape, torch.bfloat16, seed=shape[1])
            q, scale = op.forward_cpu(x, **kwargs)
            assert scale is kwargs["scale"] and same_q(q, op.forward_native(x, **kwargs)[0]), shape
    assert taken == [((1, 8193), 1), ((1, 32767), 1), ((1, 32768), -1), ((3, 21845), -1), ((1, 65535), -1), ((1, 65536), -1),
                     ((16, 4096), -1)]
    assert graphs() == before


@pytest.mark.slow
def test_warmup_builds_what_static_requests_take(monkeypatch):
    """``customop.warmup`` (its per-tensor ``[1]`` and per-channel ``[H]`` scales at width 256 and
    one 64K-wide row) builds every artifact the requests take: eager up to 8K elements, the
    one-thread band, the threaded band and the threshold's, one row included; nothing compiles
    on the request path and q is the spec's bit for bit."""
    import customop

    ops = [build(label) for label in ROUTED]
    rows = customop.warmup(ops, dtypes=(torch.bfloat16,))
    assert rows and all(r.outcome == "ran" for r in rows)
    before, built = graphs(), standalone.compiles
    taken = _recording(monkeypatch)
    shapes = ((1, 4096), (2, 4096), (3, 4096), (1, 16384), (1, 40000), (1, 65536), (16, 4096), (600, 4096))
    with torch.no_grad():
        for label, op in zip(ROUTED, ops):
            for shape in shapes:
                x, kwargs = case_input(label, *shape, torch.bfloat16, seed=shape[0] + shape[1])
                got = op(x, **kwargs)
                quant_ref.check_against_reference(QUANT[label], x, got, FP8, kwargs)
    assert graphs() == before and standalone.compiles == built
    want = [(s, 1 if s[0] * s[1] <= (1 << 15) - 1 else -1) for s in shapes if s[0] * s[1] > 1 << 13]
    assert taken == want * 2


def test_static_scales_the_route_cannot_take_keep_their_paths(monkeypatch):
    """A [1, H] per-channel scale, per-token and per-group static scales: below the threshold the
    eager tier without asking the route, from it Dynamo's path; results the reference's."""
    taken = _recording(monkeypatch)
    for label, two_d_scale in (("static per-channel", True), ("static per-token", False),
                               ("static per-group 128", False)):
        op = build(label)
        for rows in (3, 16):  # x 4096: 12K elements (band sizes), then 64K (the threshold)
            x, kwargs = case_input(label, rows, 4096, torch.bfloat16, seed=rows)
            if two_d_scale:
                kwargs["scale"] = kwargs["scale"].view(1, -1)
            before = graphs()
            with torch.no_grad():
                out = op.forward_cpu(x, **kwargs)
            quant_ref.check_against_reference(QUANT[label], x, out, FP8, kwargs)
            assert (graphs() > before) == (rows == 16), (label, rows)  # eager, then Dynamo's graph
    # the band never asked the route; the threshold's calls did (and were refused: Dynamo's path)
    assert all(shape[0] == 16 for shape, _ in taken)


def test_padded_static_quant_keeps_its_path():
    with use_config(Config(custom_ops=["all"])):
        op = QuantFP8(True, GroupShape.PER_TENSOR, num_token_padding=12)
    for rows in (3, 17):
        x = torch.randn(rows, 4096).to(torch.bfloat16)
        scale = torch.tensor([0.01])
        with torch.no_grad():
            q, returned = op.forward_cpu(x, scale)
            want = op.forward_native(x, scale)[0]
        assert returned is scale and q.shape == (max(rows, 12), 4096) and same_q(q, want)


def test_inside_a_callers_compile_static_quant_is_traced():
    op = build("static per-tensor")
    x, kwargs = case_input("static per-tensor", 6, 520, torch.float32, seed=6)
    compiled = torch.compile(op.forward_cpu, fullgraph=True)
    with torch.no_grad():
        q, scale = compiled(x, **kwargs)
        assert same_q(q, op.forward_native(x, **kwargs)[0]) and torch.equal(scale, kwargs["scale"])
