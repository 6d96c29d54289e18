"""``CpuTiers.one_thread_up_to``: compiled calls of up to that many elements run standalone
artifacts compiled for one thread (Inductor's ``cpp.threads=1``: no OpenMP region, which on a
loaded machine can wait milliseconds for its second thread). They are the same graph, so their
results are bitwise the two-thread artifacts'; and a call of the small-size band
(``compiled_up_to``) that the standalone route does not take runs the eager tier, not Dynamo's
path (which would compile a graph and cost ~20-40 us a call at these sizes)."""

from __future__ import annotations

import pytest
import torch

from customop.backends.cpu import standalone
from customop.backends.cpu.tiering import ONE_THREAD
from customop.config import Config, use_config
from customop.ops import activation as A
from customop.ops.quantization import GroupShape, QuantFP8, input_quant_fp8
from customop.testing import assert_close
from tests.backends.cpu.compile_counting import fresh_compiles, graphs  # noqa: F401  (autouse fixture)


def enabled(cls, *args):
    with use_config(Config(custom_ops=["all"])):
        return cls(*args)


def test_tiers_wiring():
    for cls in (A.NewGELU, A.FastGELU):
        tiers = cls.cpu_tiers
        # every size below the 16K threshold runs compiled, up to 8K for one thread
        assert tiers.runs_compiled(1, torch.bfloat16) and tiers.runs_compiled((1 << 14) - 1, torch.float32)
        assert tiers.one_thread_up_to == 1 << 13 and tiers.compile_from(torch.bfloat16) == 1 << 14
    tiers = input_quant_fp8.QUANT_CPU_TIERS
    assert tiers.runs_compiled(1, torch.bfloat16) and tiers.one_thread_up_to == (1 << 15) - 1
    assert tiers.compile_from(torch.bfloat16) == 1 << 16 and not tiers.runs_compiled(0, torch.bfloat16)
    plain = tiers.compiling_from(1)  # experiments: one set of artifacts
    assert plain.one_thread_up_to == 0 and plain.compiled_up_to == 0
    fam = A.NewGELU.cpu_tiers.standalone_family(A.gelu_new, one_thread=True)
    assert fam.options["cpp.threads"] == 1 == ONE_THREAD["cpp.threads"]
    assert fam is not A.NewGELU.cpu_tiers.standalone_family(A.gelu_new)
    assert fam is A.NewGELU.cpu_tiers.standalone_family(A.gelu_new, one_thread=True)  # cached


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_one_thread_artifacts_are_bitwise_the_threaded_ones(dtype):
    cases = [(enabled(A.NewGELU), A.gelu_new), (enabled(A.FastGELU), A.gelu_fast)]
    quants = [enabled(QuantFP8, False, g) for g in (GroupShape.PER_TOKEN, GroupShape.PER_TENSOR, GroupShape(1, 128))]
    with torch.no_grad():
        for rows in (1, 7, 300):
            x = (torch.randn(rows, 1031) * 3).to(dtype)  # odd: the vector loops' tails run too
            for op, fn in cases:
                one, two = (standalone.run(op.cpu_tiers.standalone_family(fn, t), x, (), {}) for t in (True, False))
                assert torch.equal(one, two), (fn.__name__, rows)
                assert_close(one, op.forward_native(x), dtype)
            x = (torch.randn(rows, 9 * 128) * 3).to(dtype)  # per-group 128: no padding (a padded
            for op in quants:                                  # width keeps Dynamo's path)
                one, two = (standalone.run(op.cpu_tiers.standalone_family(input_quant_fp8.quant_fp8, t), x,
                                           (None, None), op._math, two_d_only=True) for t in (True, False))
                assert torch.equal(one[0].view(torch.uint8), two[0].view(torch.uint8)), (op.group_shape, rows)
                assert torch.equal(one[1], two[1])
                want = op.forward_native(x)
                assert torch.equal(one[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(one[1], want[1])


def test_small_calls_take_the_one_thread_artifacts_and_large_ones_the_threads(monkeypatch):
    op = enabled(A.NewGELU)
    quant = enabled(QuantFP8, False, GroupShape.PER_TOKEN)
    taken = []
    real_run = standalone.run

    def recording_run(fam, x, *args, **kwargs):
        taken.append((x.shape[0], fam.options.get("cpp.threads", -1)))
        return real_run(fam, x, *args, **kwargs)

    monkeypatch.setattr(standalone, "run", recording_run)
    with torch.no_grad():
        for rows in (1, 2, 3, 4, 16):  # 4096 wide: gelu_new one thread up to 8K, threshold 16K; quant 64K
            x = torch.randn(rows, 4096).to(torch.bfloat16)
            assert_close(op(x), op.forward_native(x), torch.bfloat16)
            got, want = quant(x), quant.forward_native(x)
            assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
    assert taken == [(1, 1), (1, 1), (2, 1), (2, 1), (3, -1), (3, 1), (4, -1), (4, 1), (16, -1), (16, -1)]


def test_band_calls_the_route_refuses_run_the_eager_tier(monkeypatch):
    """Below the threshold a strided or autograd-recording x, a 1-D x and QuantFP8's static per-token
    scale (``[T, 1]``: neither x's rows nor ``[hidden]``, which the route refuses) run eagerly: no
    Dynamo graph; the static QuantFP8 does not even ask the route (its refusal costs ~5 us a call)."""
    op = enabled(A.FastGELU)
    static = enabled(QuantFP8, True, GroupShape.PER_TOKEN)
    dynamic = enabled(QuantFP8, False, GroupShape.PER_TOKEN)
    before = graphs()
    wide = torch.randn(4, 2048).to(torch.bfloat16)
    for x in (wide[:, ::2], wide[0], torch.randn(3, 1024, requires_grad=True)):
        got = op(x)
        assert_close(got, op.forward_native(x), x.dtype)
        assert got.requires_grad == x.requires_grad
    with torch.no_grad():
        x = torch.randn(3, 4096).to(torch.bfloat16)
        scale = torch.rand(3, 1) + 0.01
        real_run, asked = standalone.run, []
        monkeypatch.setattr(standalone, "run", lambda *a, **k: asked.append(a) or real_run(*a, **k))
        got, want = static(x, scale), static.forward_native(x, scale)
        assert not asked
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and got[1] is scale
        got, want = dynamic(x.view(1, 3, 4096)), dynamic.forward_native(x.view(1, 3, 4096))  # 3-D: 2-D only
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
    assert graphs() == before
