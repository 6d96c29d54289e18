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
