"""The norm forms that forward_cpu's compiled tier runs for bf16 (backends/cpu/exact_rounding.py),
RMSNorm's and Mamba-2's grouped gated norm's: the fp32 rounding helper against torch's own bf16
conversion (every significand of a few binades, ties and their neighbours in every binade it
claims), the compiled forms bitwise against the spec compiled with emulate_precision_casts (the
graph they replace) and against the eager spec, the ops' compiled tier against the float64
reference, and the tier wiring."""

from __future__ import annotations

import pytest
import torch

from customop.backends.cpu import compile_cache
from customop.backends.cpu import exact_rounding as er
from customop.config import Config, use_config
from customop.math import layernorm as spec
from customop.math import mamba as mamba_spec
from customop.ops.layernorm import RMS_NORM_CPU_TIERS
from customop.ops.mamba import Mixer2RMSNormGated
from customop.ops.mamba.mixer2 import NORM_CPU_TIERS
from customop.samples.mamba import NORM_CASES
from customop.testing import assert_close
from tests.cases.mamba import norm_reference


def _floats(bits: torch.Tensor) -> torch.Tensor:
    """int64 bit patterns (0 .. 2^32-1) as fp32 values."""
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def _check_rounding(y: torch.Tensor) -> None:
    want = y.to(torch.bfloat16).float()
    got = er.round_to_bf16(y)
    bad = got.view(torch.int32) != want.view(torch.int32)
    assert not bad.any(), f"{int(bad.sum())} of {y.numel()} differ, e.g. {y[bad][:4].tolist()} -> {got[bad][:4].tolist()}"


@pytest.mark.parametrize("exponent", [1, 100, 127, 150, 237])
def test_round_to_bf16_every_significand(exponent):
    """All 2^23 significands of a binade, both signs, bitwise equal to ``.to(bf16).float()``."""
    mantissas = torch.arange(1 << 23, dtype=torch.int64)
    for sign in (0, 1 << 31):
        _check_rounding(_floats(mantissas | (exponent << 23) | sign))


def test_round_to_bf16_ties_in_every_binade():
    """Exact ties (low half 0x8000, odd and even high halves) and their neighbours in every binade
    from 2^-126 to 2^111, and zeros."""
    high = torch.randint(0, 1 << 7, (64,), generator=torch.Generator().manual_seed(0)) << 16
    exponents = torch.arange(1, 238, dtype=torch.int64)[:, None, None] << 23
    low = torch.tensor([0x8000, 0x7FFF, 0x8001, 0x0000, 0xFFFF], dtype=torch.int64)
    bits = (exponents | high[None, :, None] | low[None, None, :]).flatten()
    bits = torch.cat([bits, bits | (1 << 31)])
    _check_rounding(_floats(bits))
    _check_rounding(torch.tensor([0.0, -0.0]))
    # outside the documented range: NaN for NaN and for infinities (a normalised value never is one)
    assert er.round_to_bf16(torch.tensor([float("nan"), float("inf"), float("-inf")])).isnan().all()


def _compiled_pair(fn):
    emulated = compile_cache.compiled(fn, **compile_cache.EMULATE_CASTS)
    form = compile_cache.compiled(er.compiled_form(fn), **compile_cache.EMULATE_CASTS, **er.EXACT_ROUNDING_OPTIONS)
    return emulated, form


@pytest.mark.parametrize("variance_size", [None, 200], ids=["full", "var200"])
def test_compiled_forms_equal_emulated_spec(variance_size):
    """Compiled, the forms give the bits of the spec compiled with emulate_precision_casts (same
    Inductor reduction), on an odd width, with a random weight, for rms_norm and the fused add;
    and the plain compile (no emulation) differs, or this test could not see a lost rounding."""
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        x, residual = (torch.randn(9, 1031, generator=gen).to(torch.bfloat16) for _ in range(2))
        weight = (torch.randn(1031, generator=gen) * 0.5 + 1).to(torch.bfloat16)
        emulated, form = _compiled_pair(spec.rms_norm)
        want = emulated(x, weight, 1e-6, variance_size)
        assert torch.equal(form(x, weight, 1e-6, variance_size), want)
        assert (torch.compile(spec.rms_norm)(x, weight, 1e-6, variance_size) != want).float().mean() > 0.02
        # the eager spec: equal but for the reduction order (an fp32 ulp of the mean)
        assert (want != spec.rms_norm(x, weight, 1e-6, variance_size)).float().mean() < 0.005
        emulated, form = _compiled_pair(spec.fused_add_rms_norm)
        for got, exp in zip(form(x, residual, weight, 1e-6, variance_size),
                            emulated(x, residual, weight, 1e-6, variance_size)):
            assert torch.equal(got, exp)


def test_forms_fall_back_to_the_spec_outside_bf16():
    """Other dtype pairs run the spec itself (the emulation then does the rounding)."""
    gen = torch.Generator().manual_seed(2)
    for x_dtype, w_dtype in [(torch.float16, torch.float16), (torch.bfloat16, torch.float32),
                             (torch.float32, torch.bfloat16)]:
        x = torch.randn(3, 64, generator=gen).to(x_dtype)
        w = torch.randn(64, generator=gen).to(w_dtype)
        assert torch.equal(er.rms_norm(x, w, 1e-6), spec.rms_norm(x, w, 1e-6))
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    assert torch.equal(er.rms_norm(x, None, 1e-6), spec.rms_norm(x, None, 1e-6))


def test_rms_norm_tiers_compile_the_forms():
    """RMSNorm's tiers (emulate_casts) compile the exact-rounding forms; specs without a form are
    compiled themselves."""
    assert er.compiled_form(spec.rms_norm) is er.rms_norm
    assert er.compiled_form(spec.fused_add_rms_norm) is er.fused_add_rms_norm
    assert er.compiled_form(spec.gemma_rms_norm) is spec.gemma_rms_norm
    fn = RMS_NORM_CPU_TIERS.compiled(spec.rms_norm)
    assert fn is compile_cache.compiled(er.rms_norm, **compile_cache.EMULATE_CASTS, **er.EXACT_ROUNDING_OPTIONS)
    assert RMS_NORM_CPU_TIERS.compiled(spec.gemma_rms_norm) is compile_cache.compiled(
        spec.gemma_rms_norm, **compile_cache.EMULATE_CASTS)


# ---- Mamba-2's grouped gated norm (customop/math/mamba.py, mixer2_gated_rms_norm) ---------------

def _gated_inputs(rows, hidden, gen, dtype=torch.bfloat16, w_dtype=torch.bfloat16):
    x, gate = (torch.randn(rows, hidden, generator=gen).to(dtype) for _ in range(2))
    weight = (torch.randn(hidden, generator=gen) * 0.2 + 1).to(w_dtype)
    return x, gate, weight


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance in bf16 ulps between differing pairs of one sign (0 if equal)."""
    bad = a != b
    assert not (a[bad].signbit() ^ b[bad].signbit()).any()
    return int((a[bad].view(torch.int16).int() - b[bad].view(torch.int16).int()).abs().max()) if bad.any() else 0


@pytest.mark.slow
@pytest.mark.parametrize("groups", [1, 8])
def test_gated_norm_form_equals_spec(groups):
    """bf16 x and weight, odd row counts (1, 7, 4231; Dynamo's one-row graph and the dynamic one):
    the form run eagerly is bitwise the eager spec; compiled, it is bitwise the spec compiled with
    emulate_precision_casts (the graph it replaces), and against the eager spec differs only where
    Inductor's reduction order moves a group's fp32 mean by an ulp that then flips the bf16 rounding
    of the normalised value (a few outputs per million; one ulp there, at most two after the
    weight multiply's rounding); the plain compile differs in ~25% of outputs, or this test
    could not see a lost rounding. Without a weight the form is the spec."""
    hidden, eps = 1024, 1e-6
    gen = torch.Generator().manual_seed(4 + groups)
    emulated, form = _compiled_pair(mamba_spec.mixer2_gated_rms_norm)
    with torch.no_grad():
        for rows in (1, 7, 4231):
            x, gate, weight = _gated_inputs(rows, hidden, gen)
            args = (x, gate, weight, eps, hidden // groups)
            eager = mamba_spec.mixer2_gated_rms_norm(*args)
            assert torch.equal(er.mixer2_gated_rms_norm(*args), eager)
            got = form(*args)
            assert got.dtype == torch.bfloat16 and torch.equal(got, emulated(*args)), rows
            assert (got != eager).float().mean() < 1e-4 and _ulps_apart(got, eager) <= 2, rows
            if rows > 1:
                plain = torch.compile(mamba_spec.mixer2_gated_rms_norm, dynamic=False)(*args)
                assert (plain != eager).float().mean() > 0.02
            no_weight = (x, gate, None, eps, hidden // groups)
            assert torch.equal(er.mixer2_gated_rms_norm(*no_weight), mamba_spec.mixer2_gated_rms_norm(*no_weight))


def test_gated_norm_form_falls_back_to_the_spec_outside_bf16():
    """fp16, fp32 and mixed dtype pairs run the spec itself (the emulation then does the rounding)."""
    gen = torch.Generator().manual_seed(6)
    for x_dtype, w_dtype in [(torch.float16, torch.float16), (torch.float32, torch.float32),
                             (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)]:
        x, gate, weight = _gated_inputs(5, 96, gen, x_dtype, w_dtype)
        for w in (weight, None):
            for group_size in (96, 24):
                args = (x, gate, w, 1e-5, group_size)
                assert torch.equal(er.mixer2_gated_rms_norm(*args), mamba_spec.mixer2_gated_rms_norm(*args))


def test_gated_norm_tiers_compile_the_form():
    """Mixer2RMSNormGated's tiers (emulate_casts) compile the exact-rounding form."""
    assert er.compiled_form(mamba_spec.mixer2_gated_rms_norm) is er.mixer2_gated_rms_norm
    assert NORM_CPU_TIERS.emulate_casts
    assert NORM_CPU_TIERS.compiled(mamba_spec.mixer2_gated_rms_norm) is compile_cache.compiled(
        er.mixer2_gated_rms_norm, **compile_cache.EMULATE_CASTS, **er.EXACT_ROUNDING_OPTIONS)


@pytest.mark.slow
@pytest.mark.parametrize("groups", [1, 8])
def test_gated_norm_forward_cpu_compiled_tier(groups):
    """The op's forward_cpu at compiled sizes (odd rows, bf16 x and weight) against the float64
    reference of tests/ops/test_mamba.py, and bitwise what the emulated compile of the spec gives."""
    case = NORM_CASES[0]
    hidden = 1024
    rows = int(Mixer2RMSNormGated.cpu_tiers.compile_from(torch.bfloat16)) // hidden + 3
    with use_config(Config(custom_ops=["all"])):
        op = case.build(hidden, groups, torch.bfloat16, torch.Generator().manual_seed(groups))
    emulated = compile_cache.compiled(mamba_spec.mixer2_gated_rms_norm, **compile_cache.EMULATE_CASTS)
    with torch.no_grad():
        for n in (rows, 2 * rows + 1):
            x, gate = case.inputs(n, hidden, torch.bfloat16, torch.Generator().manual_seed(n))
            got = op.forward_cpu(x, gate)
            assert_close(got, norm_reference(op, x, gate), torch.bfloat16)
            assert torch.equal(got, emulated(x, gate, op.weight, op.variance_epsilon, op._group_size()))
