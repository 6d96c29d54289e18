"""RMSNorm's hand-written CPU kernels (backends/cpu/native, issue 18; the AVX-512 build and the AVX2
one, each test of the math run on every build this CPU has), which serve GemmaRMSNorm too
and weights in fp32: bitwise the spec wherever the
variance's fp32 sum is exact in any order (so the kernel's other summation order cannot show),
within a last-bit variance difference elsewhere; fp32 subnormals, infinities and NaN as the spec
gives them; the layouts and calls it takes or leaves to the compiled tier; the fallback without
the CPU feature or a compiler (logged once); the build cache. Outputs are poisoned (NaN) before
the kernel writes them."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from customop.backends.cpu import native
from customop.backends.cpu.native import loader
from customop.backends.cpu.native import rms_norm as N
from customop.backends.cpu.tiering import warming_up
from customop.config import Config, use_config
from customop.math import layernorm as spec
from customop.ops.layernorm import GemmaRMSNorm, RMSNorm
from customop.testing import assert_close
from tests.backends.cpu.native_builds import ISAS, isa_fixture
from tests.cases.layernorm import ref_fused_add, ref_rms_norm

DTYPES = [torch.bfloat16, torch.float16]

pytestmark = pytest.mark.skipif(not N.entries(), reason="no native kernel on this machine (CPU or compiler)")
isa = isa_fixture(N)  # each math test runs on every build this CPU has


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    """Every output the kernel allocates starts as NaN, and the calls that reach it are counted."""
    monkeypatch.setattr(N, "_empty", lambda shape, dtype: torch.full(shape, float("nan"), dtype=dtype))
    calls = []
    real = N._call
    monkeypatch.setattr(N, "_call", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    return calls


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    """A cache directory of the test's own and a library not yet loaded; the process's state
    (entry points, library) is forgotten again afterwards."""
    monkeypatch.setenv("CUSTOMOP_CACHE_DIR", str(tmp_path))
    N.reset()
    yield tmp_path
    N.reset()


def norm(dtype, hidden, seed=0, cls=RMSNorm, weight_dtype=None):
    """An enabled op with a random weight (of ``weight_dtype``, default x's)."""
    with use_config(Config(custom_ops=["all"])):
        op = cls(hidden).to(weight_dtype or dtype).requires_grad_(False)
    op.weight.copy_(torch.randn(hidden, generator=torch.Generator().manual_seed(seed)) * 0.3
                    + (0 if cls is GemmaRMSNorm else 1))
    return op


def exact_sum_inputs(shape, dtype, seed):
    """x and residual of small multiples of 1/16 scaled per row by a power of two: every square and
    every partial sum of h = x + residual is exact in fp32, whatever the order."""
    gen = torch.Generator().manual_seed(seed)
    scale = 2.0 ** torch.randint(-6, 7, (*shape[:-1], 1), generator=gen)
    return [(torch.randint(-15, 16, shape, generator=gen) / 16 * scale).to(dtype) for _ in range(2)]


def equal(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


FORMS = {"rms_norm": (RMSNorm, None), "rms_norm-fp32_weight": (RMSNorm, torch.float32),
         "gemma": (GemmaRMSNorm, None), "gemma-fp32_weight": (GemmaRMSNorm, torch.float32)}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 4231), (7, 4231), (4231, 7), (7, 1), (3, 5, 64), (1, 64), (2048, 96)],
                         ids=lambda s: "x".join(map(str, s)))
def test_bitwise_the_spec(shape, dtype, form, poisoned, isa):
    """x and weight of the dtype (HF Llama: y rounded before the weight multiply), an fp32 weight
    (no rounding before it), Gemma's 1 + w with either weight."""
    cls, weight_dtype = FORMS[form]
    op = norm(dtype, shape[-1], cls=cls, weight_dtype=weight_dtype)
    x, residual = exact_sum_inputs(shape, dtype, seed=shape[0])
    with torch.no_grad():
        assert equal(op.forward_cpu(x), op.forward_native(x))
        got, want = op.forward_cpu(x, residual), op.forward_native(x, residual)
    assert equal(got[0], want[0]) and equal(got[1], want[1])
    assert len(poisoned) == 2  # both calls ran the kernel


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_random_inputs(dtype, isa):
    """Gaussian rows: the float64 reference's tolerance, and the spec's bits but where the
    variance's last bit (the summation order) moves the first rounding by one unit (times a
    weight above 1: up to two units of the output)."""
    op = norm(dtype, 4231)
    gen = torch.Generator().manual_seed(5)
    x, residual = (torch.randn(64, 4231, generator=gen).to(dtype) for _ in range(2))
    with torch.no_grad():
        plain, fused = op.forward_cpu(x), op.forward_cpu(x, residual)
        want_plain, want_fused = op.forward_native(x), op.forward_native(x, residual)
    assert_close(plain, ref_rms_norm(x, op.weight, op.eps), dtype)
    assert_close(fused, ref_fused_add(x, residual, op.weight, op.eps), dtype)
    assert equal(fused[1], want_fused[1])  # the residual has no variance in it
    for got, want in ((plain, want_plain), (fused[0], want_fused[0])):
        ulps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
        assert ulps.max() <= 2 and (ulps != 0).float().mean() < 1e-3


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_subnormals_infinities_and_nan(dtype, isa):
    """Lanes the hardware bf16 conversion would flush (fp32 subnormals, stored by the integer
    rounding instead), a row of zeros with eps 0 (inf * 0: NaN), an infinite input, tiny weights."""
    tiny = 1e-39 if dtype == torch.bfloat16 else 1e-7  # the dtype's subnormal range
    gen = torch.Generator().manual_seed(2)
    n = 100
    x, residual = exact_sum_inputs((6, n), dtype, seed=3)
    x[1], residual[1] = ((torch.randint(-3, 4, (n,), generator=gen) * tiny).to(dtype) for _ in range(2))
    x[2] = 0
    residual[2] = 0
    x[3, 5] = float("inf")
    w = torch.randn(n, generator=gen).to(dtype)
    w[::3] = tiny * 3
    for eps in (1e-6, 0.0):
        with torch.no_grad():
            got = (N.rms_norm(x, w, eps), *N.fused_add_rms_norm(x, residual, w, eps))
        want = (spec.rms_norm(x, w, eps), *spec.fused_add_rms_norm(x, residual, w, eps))
        for g, e in zip(got, want):
            assert torch.equal(g.isnan(), e.isnan())
            assert equal(torch.where(e.isnan(), 0, g), torch.where(e.isnan(), 0, e))
        if eps:  # the cases were met: subnormal outputs and residuals, NaN
            def subnormal(t):
                return ((t != 0) & (t.abs().float() < torch.finfo(dtype).tiny)).any()
            assert subnormal(want[0]) and subnormal(want[2]) and want[0].isnan().any()


def test_layouts(poisoned, isa):
    """Row-strided 2-D x and residual (slices of wider rows) and 3-D contiguous ones run the
    kernel; a transposed x does not (the eager tier runs it at this size); results as the spec's."""
    dtype = torch.bfloat16
    op = norm(dtype, 64)
    wide, wide_r = exact_sum_inputs((9, 200), dtype, seed=4)
    x, residual = wide[:, 10:74], wide_r[:, 100:164]
    x3, r3 = exact_sum_inputs((2, 3, 64), dtype, seed=6)
    xt = exact_sum_inputs((64, 9), dtype, seed=7)[0].t()
    with torch.no_grad():
        for args in ((x,), (x, residual), (x3,), (x3, r3)):
            got, want = op.forward_cpu(*args), op.forward_native(*args)
            for g, e in zip(got if len(args) == 2 else (got,), want if len(args) == 2 else (want,)):
                assert equal(g, e)
        assert len(poisoned) == 4
        assert_close(op.forward_cpu(xt), op.forward_native(xt), dtype)
    assert len(poisoned) == 5  # asked, and declined: the kernel never wrote


def test_calls_it_leaves_to_the_other_tiers():
    """fp32, a variance subset, a weight neither of x's dtype nor fp32, autograd recording, no
    weight: None from the kernel, and forward_cpu's result is the spec's as before."""
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    assert N.rms_norm(x.float(), w.float(), 1e-6) is None
    assert N.rms_norm(x, w, 1e-6, variance_size=32) is None
    assert N.rms_norm(x, w.half(), 1e-6) is None
    assert N.rms_norm(x, None, 1e-6) is None
    assert N.rms_norm(x.requires_grad_(), w, 1e-6) is None
    with torch.no_grad():
        assert N.rms_norm(x, w, 1e-6) is not None
    op = norm(torch.bfloat16, 64).requires_grad_(True)
    y = op.forward_cpu(x)
    assert y.requires_grad
    assert_close(y, op.forward_native(x), torch.bfloat16)


def test_threads_do_not_change_the_result(isa):
    x = torch.randn(256, 512, dtype=torch.bfloat16)
    w = torch.randn(512, dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = N.rms_norm(x, w, 1e-6)
        torch.set_num_threads(max(threads, 2))
        assert equal(N.rms_norm(x, w, 1e-6), one)
    finally:
        torch.set_num_threads(threads)


def test_tiers_wiring():
    assert RMSNorm.cpu_tiers.native_from == GemmaRMSNorm.cpu_tiers.native_from == 1
    assert native.kernel_for(spec.rms_norm) is N.rms_norm
    assert native.kernel_for(spec.gemma_fused_add_rms_norm) is N.gemma_fused_add_rms_norm
    assert native.kernel_for(spec.layer_norm) is None
    assert RMSNorm.cpu_tiers.compiling_from(1).native_from == float("inf")  # tests of the compiled tier


def test_built_once_then_loaded_from_the_cache(fresh_library):
    builds = loader.builds
    assert set(N.entries()) == set(DTYPES)  # the AVX2 build, and the AVX-512 one with AVX512_BF16, have both
    assert loader.builds == builds + 1
    (built,) = (fresh_library / "native").glob("norms-*.so")
    N.reset()
    assert set(N.entries()) == set(DTYPES)
    assert loader.builds == builds + 1  # the second process-start loads the cached file
    assert list((fresh_library / "native").glob("*")) == [built]  # no temporary file left


def fallback(monkeypatch, caplog, **patches):
    """forward_cpu with the loader patched: the spec's result through the compiled tier, the
    reason logged once."""
    for name, value in patches.items():
        monkeypatch.setattr(loader, name, value)
    op = norm(torch.bfloat16, 64)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO, logger=loader.__name__), torch.no_grad():
        for _ in range(2):
            assert_close(op.forward_cpu(x), ref_rms_norm(x, op.weight, op.eps), torch.bfloat16)
    return [r.getMessage() for r in caplog.records if r.name == loader.__name__]


@pytest.mark.parametrize("flags,wanted,isa_", [
    ({"avx2", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}, "1", "avx512"),
    ({"avx2", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}, "avx2", "avx2"),
    ({"avx2", "f16c", "avx512f"}, "1", "avx2"),
    ({"avx2", "f16c"}, "1", "avx2"),
    ({"avx2", "f16c"}, "anything", "avx2"),
])
def test_the_build_follows_the_cpu_and_the_switch(flags, wanted, isa_):
    assert loader._choose(flags, wanted).isa == isa_


def test_a_build_the_cpu_lacks_is_not_taken():
    assert loader._choose({"avx2", "f16c"}, "avx512") == ("the CPU lacks what the builds need (avx512: avx512bw, "
                                                          "avx512dq, avx512f, avx512vl)")


def test_no_avx2_no_kernel(monkeypatch, caplog, fresh_library):
    (message,) = fallback(monkeypatch, caplog, cpu_flags=lambda: {"sse4_2", "avx"})
    assert "lacks what the builds need (avx512: avx512bw, avx512dq, avx512f, avx512vl; avx2: avx2, f16c)" in message
    assert N.entries() == {}


def test_no_compiler_no_kernel(monkeypatch, caplog, fresh_library):
    (message,) = fallback(monkeypatch, caplog, compiler=lambda: None)
    assert "no C compiler" in message


def test_failed_build_is_logged(monkeypatch, caplog, fresh_library):
    (message,) = fallback(monkeypatch, caplog, _FLAGS=loader._FLAGS + ["-fno-such-flag"])
    assert "building the native CPU norm kernel failed" in message


@pytest.mark.skipif("avx512" not in ISAS, reason="the AVX-512 build needs an AVX-512 CPU")
def test_without_avx512_bf16_only_fp16(monkeypatch, fresh_library, poisoned):
    """The AVX-512 build's bf16 entry needs AVX512_BF16 (the AVX2 build rounds bf16 with integer
    operations and always has it)."""
    flags = loader.cpu_flags() - {"avx512_bf16"}
    monkeypatch.setattr(loader, "cpu_flags", lambda: flags)
    assert set(N.entries()) == {torch.float16}
    op = norm(torch.bfloat16, 64)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        assert_close(op.forward_cpu(x), ref_rms_norm(x, op.weight, op.eps), torch.bfloat16)
        op16 = norm(torch.float16, 64)
        x16, = exact_sum_inputs((8, 64), torch.float16, seed=1)[:1]
        assert equal(op16.forward_cpu(x16), op16.forward_native(x16))


def test_switched_off(monkeypatch, caplog, fresh_library):
    monkeypatch.setenv("CUSTOMOP_CPU_NATIVE", "0")
    (message,) = fallback(monkeypatch, caplog)
    assert "CUSTOMOP_CPU_NATIVE=0" in message


@pytest.mark.slow  # warm-up compiles the call's artifact too
def test_warmup_loads_the_kernel(fresh_library):
    """With ``native_from`` above warm-up's small inputs, warm-up still loads the library (not the
    first large request)."""
    op = norm(torch.bfloat16, 64)
    op.cpu_tiers = dataclasses.replace(RMSNorm.cpu_tiers, native_from=10**9)
    assert N._entries is None
    with warming_up(), torch.no_grad():
        op.forward_cpu(torch.randn(2, 64, dtype=torch.bfloat16))
    assert N._entries
