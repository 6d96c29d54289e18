"""The RMSNorm forms that forward_cpu's compiled tier runs for bf16 (backends/cpu/exact_rounding.py):
the fp32 rounding helper against torch's own bf16 conversion (every significand of a few
binades, ties and their neighbours in every binade it claims), the compiled forms bitwise against
the spec compiled with emulate_precision_casts (the graph they replace) and against the eager spec,
and the tier wiring."""

from __future__ import annotations

import pytest
import torch

from customop.backends.cpu import compile_cache
from customop.backends.cpu import exact_rounding as er
from customop.math import layernorm as spec
from customop.ops.layernorm import RMS_NORM_CPU_TIERS


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
