"""silu_and_mul's and mul_and_silu's aligned artifacts (``CpuTiers.aligned_widths``,
``standalone._aligned_artifact``): calls of two or more rows whose x is a multiple of 64 wide run a
width-dynamic artifact traced as 64 x a symbol (no per-row vector tail in its code); other widths
and one-row calls the shared one.
Fresh random inputs at odd row counts in every dtype the ops take, against the float64 reference
and bitwise against the shared artifact; warm-up builds the aligned artifact, so no request
compiles."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import customop
from customop.backends.cpu import standalone
from customop.config import Config, use_config
from customop.ops import activation as A
from customop.samples.activation import BY_LABEL as ACT
from tests.backends.cpu.compile_counting import fresh_compiles, graphs  # noqa: F401  (autouse fixture)
from tests.cases import activation as act_ref

#: the ops with ``aligned_widths`` and the dtypes each is tested in (each build takes a second or two)
CASES = [("silu_and_mul", (torch.bfloat16, torch.float16, torch.float32, torch.float64)),
         ("mul_and_silu", (torch.float32, torch.bfloat16))]
#: output widths: x 128 and 8320 wide (multiples of 64), 2062 and 14 wide (not)
ALIGNED, UNALIGNED = (64, 4160), (1031, 7)


def _op(label, aligned=True):
    """The op compiling from one element, with or without its aligned artifacts."""
    with use_config(Config(custom_ops=["all"])):
        op = ACT[label].build()
    op.cpu_tiers = dataclasses.replace(op.cpu_tiers.compiling_from(1), aligned_widths=aligned)
    return op


def _input(label, rows, width, dtype, seed):
    return ACT[label].input((rows, 2 * width), dtype, generator=torch.Generator().manual_seed(seed))


def _aligned_artifacts(op, dtype=None):
    """The aligned artifacts hanging off the op's shared width-dynamic ones (of ``dtype``: the
    first item of their keys)."""
    fam = op.cpu_tiers.standalone_family(op.compiled_fn or type(op).math_fn)
    return [a.aligned for k, a in fam.artifacts.items()
            if isinstance(a, standalone.Widths) and a.aligned and dtype in (None, k[0])]


def test_which_ops_take_aligned_widths():
    assert A.SiluAndMul.cpu_tiers.aligned_widths and A.MulAndSilu.cpu_tiers.aligned_widths
    # measured within 0.5% (the other gated ops), or one flat loop with no per-row tail (gelu_new)
    for cls in (A.GeluAndMul, A.FatreluAndMul, A.SwigluStepAndMul, A.SiluAndMulWithClamp, A.NewGELU):
        assert not cls.cpu_tiers.aligned_widths, cls.__name__


@pytest.mark.slow
@pytest.mark.parametrize("label,dtypes", CASES, ids=[c[0] for c in CASES])
def test_aligned_widths_run_their_artifact(label, dtypes):
    """Aligned widths at 3 and 257 rows take the aligned artifact (its verdict for the width is
    recorded), within tolerance of the float64 reference and bitwise the shared artifact's result
    (the same vector code without the tail test); one-row calls and other widths take the shared
    one. Builds: the shared one, its aligned one and the one-row one per dtype, nothing more."""
    op, plain = _op(label), _op(label, aligned=False)
    with torch.no_grad():
        for dtype in dtypes:
            before, built = graphs(), standalone.compiles
            for width in ALIGNED + UNALIGNED:
                for rows in (3, 257, 1):
                    x = _input(label, rows, width, dtype, seed=width + rows)
                    out = op.forward_cpu(x)
                    act_ref.assert_matches(ACT[label], op, x, out, spec_rounding=True)
                    if rows > 1 and width in ALIGNED:
                        served = [a for a in _aligned_artifacts(op, dtype) if a.verdicts.get(2 * width)]
                        assert len(served) == 1 and served[0].quantum == standalone._ALIGNED, (width, rows)
            assert standalone.compiles - built == 3 and graphs() == before, dtype
            for width in ALIGNED:
                x = _input(label, 257, width, dtype, seed=width)
                assert torch.equal(op.forward_cpu(x), plain.forward_cpu(x)), (dtype, width)


@pytest.mark.slow
def test_warmup_builds_the_aligned_artifact():
    """After ``customop.warmup`` at its defaults (width 256), requests of aligned and other widths
    from 1 row up compile nothing on either route, and the aligned ones at compiled sizes (from 128K
    elements in bf16, 512K in fp32) run the aligned artifact."""
    with use_config(Config(custom_ops=["all"])):
        op = A.SiluAndMul()
    dtypes = (torch.bfloat16, torch.float32)
    assert all(r.outcome == "ran" for r in customop.warmup([op], dtypes=dtypes))
    before, built = graphs(), standalone.compiles
    with torch.no_grad():
        for dtype in dtypes:
            for width, counts in ((14336, (1, 3, 40)), (64 * 3, (1, 3, 1500)), (7, (1, 3, 40)), (2116, (1, 3, 200))):
                for rows in counts:
                    x = torch.randn(rows, 2 * width).to(dtype)
                    act_ref.assert_matches(ACT["silu_and_mul"], op, x, op(x), spec_rounding=True)
                    assert standalone.compiles == built and graphs() == before, (dtype, width, rows)
    served = {w for a in _aligned_artifacts(op) for w, ok in a.verdicts.items() if ok}
    assert {2 * 14336, 2 * 64 * 3} <= served and not served & {14, 2 * 2116}
