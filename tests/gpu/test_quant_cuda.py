"""fp8 quant kernels on the GPU at real sizes (up to 32768 x 8192): exact fp8 bits and scales
against references written here; outputs inside guard-padded buffers; CUDA-graph capture and
replay; compute-sanitizer memcheck over one launch of every quant and rotary kernel variant
(``python -m tests.gpu.test_quant_cuda`` is that launch list).

The references compute in float64 the exact fp32 value the spec rounds: ``fp32(amax / max)`` (a
true division; float64 then fp32 is innocuous double rounding for one operation), ``fp32(1 /
scale)``, ``fp32(x * inv)`` or ``fp32(x / s)``, then torch's own fp32 -> fp8 cast. Note: torch's
CUDA ``tensor / python_float`` multiplies by the reciprocal instead (BinaryDivTrueKernel.cu), so
the library's reference (customop.math.quant) run on CUDA tensors gives scales one ulp off in about half
the rows; on CPU tensors it divides, and test_matches_library_reference_on_cpu checks the kernel
against it bit for bit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FP8, MAX = torch.float8_e4m3fn, 448.0
MIN_SCALE = 1.0 / (MAX * 512.0)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPES = ((1, 8192), (16, 8192), (7, 4231), (256, 4096), (4096, 8192), (32768, 8192))


@pytest.fixture(scope="module")
def kernels():
    import triton

    from customop.backends.triton import fused_norm_quant, quant

    if not isinstance(quant.row_quant_kernel, triton.runtime.jit.JITFunction):
        pytest.fail("the Triton kernels were imported under TRITON_INTERPRET=1: "
                    "run `pytest -m cuda tests/gpu` on its own")
    return quant, fused_norm_quant


def _x(shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, device="cuda", generator=g) * 3.0
    x.view(-1)[::997] *= 50.0  # outliers: large amax, clamped values under a static scale
    return x.to(dtype)


def fp32(t):
    return t.to(torch.float32)


def ref_scale(amax64, max_=MAX, min_scale=MIN_SCALE):
    return torch.maximum(fp32(amax64 / max_), torch.tensor(min_scale, dtype=torch.float32, device=amax64.device))


def ref_mul(x, scale, max_=MAX, dtype=FP8):
    inv = fp32(1.0 / scale.double())
    return fp32(x.double() * inv.double()).clamp(-max_, max_).to(dtype)


def assert_bits(got, want, what):
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    bad = got.view(torch.uint8) != want.view(torch.uint8)
    if bad.any():
        idx = bad.nonzero()[:4].tolist()
        raise AssertionError(f"{what}: {int(bad.sum())} of {got.numel()} fp8 values differ, first at {idx}: "
                             f"got {got.float()[bad][:4].tolist()} want {want.float()[bad][:4].tolist()}")


# ---- exact bits at real sizes ----------------------------------------------------------------


def test_per_token(kernels):
    quant = kernels[0]
    for i, shape in enumerate(SHAPES):
        ub = torch.tensor([40.0], device="cuda") if i % 2 else None  # scale_ub on every other shape
        x = _x(shape)
        q, scale = quant.dynamic_per_token_scaled_fp8_quant(x, ub, FP8, MAX, MIN_SCALE)
        amax = x.double().abs().amax(-1, keepdim=True)
        if ub is not None:
            amax = amax.clamp(max=40.0)
        want_scale = ref_scale(amax)
        assert torch.equal(scale, want_scale), f"scales {shape}"
        assert_bits(q, ref_mul(x, want_scale), f"q {shape}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_per_token_other_dtypes_and_strided(kernels, dtype):
    quant = kernels[0]
    wide = _x((4096, 8192 + 64), dtype)
    x = wide[:, :8192]  # row stride > H
    q, scale = quant.dynamic_per_token_scaled_fp8_quant(x, None, FP8, MAX, MIN_SCALE)
    want_scale = ref_scale(x.double().abs().amax(-1, keepdim=True))
    assert torch.equal(scale, want_scale)
    assert_bits(q, ref_mul(x, want_scale), "q")


def test_per_tensor_dynamic_and_static(kernels):
    quant = kernels[0]
    for shape in SHAPES + ((3, 5, 1000),):
        x = _x(shape)
        q, scale = quant.dynamic_scaled_fp8_quant(x, FP8, MAX, MIN_SCALE)
        want_scale = ref_scale(x.double().abs().amax().reshape(1))
        assert torch.equal(scale, want_scale), f"scale {shape}"
        assert_bits(q, ref_mul(x, want_scale), f"dynamic q {shape}")
        static_scale = torch.tensor([0.02], device="cuda")
        q_static = quant.static_scaled_fp8_quant(x, static_scale, FP8, MAX)
        assert_bits(q_static, ref_mul(x, static_scale), f"static q {shape}")


@pytest.mark.parametrize("column_major,ue8m0", [(False, False), (True, True), (True, False)])
def test_per_token_group(kernels, column_major, ue8m0):
    quant = kernels[0]
    for shape, group in (((32768, 8192), 128), ((4096, 7168), 128), ((7, 4224), 64), ((1, 8192), 128)):
        x = _x(shape)
        q, scales = quant.per_token_group_fp8_quant(x, group, column_major, ue8m0, FP8, MAX, MIN_SCALE)
        xg = x.double().unflatten(-1, (-1, group))
        s = ref_scale(xg.abs().amax(-1, keepdim=True))
        if ue8m0:
            mant, exp = torch.frexp(s.double())
            s = fp32(torch.ldexp(torch.ones_like(mant), torch.where(mant == 0.5, exp - 1, exp)))
        want_q = fp32(xg / s.double()).clamp(-MAX, MAX).flatten(-2).to(FP8)
        want_scales = s.squeeze(-1)
        assert scales.shape == want_scales.shape
        if column_major:
            assert scales.stride() == (1, shape[0]), scales.stride()
        assert torch.equal(scales, want_scales), f"scales {shape}"
        assert_bits(q, want_q, f"q {shape}")


@pytest.mark.parametrize("weight", ["same", "fp32", None])
def test_rms_norm_quant(kernels, weight):
    """Scales within one bf16 ulp of the float64 reference; fp8 values equal to the reference
    normalised value quantized with the kernel's scale, except at most 1e-4 of them one step away
    (the fp32 sum of squares runs in another order, which can move y by one bf16 ulp)."""
    fused = kernels[1]
    for shape in ((1, 8192), (7, 4231), (4096, 8192), (32768, 8192)):
        x = _x(shape)
        w = None if weight is None else (torch.randn(shape[-1], device="cuda") * 0.2 + 1).to(
            torch.bfloat16 if weight == "same" else torch.float32)
        q, scale = fused.rms_norm_dynamic_per_token_fp8_quant(x, w, 1e-6, None, FP8, MAX, MIN_SCALE)
        xd = x.double()
        y = fp32(xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + fp32(torch.tensor(1e-6)).item()))
        if w is not None:
            y = fp32(y.to(w.dtype).double() * w.double()).to(w.dtype)
        y = y.to(x.dtype)
        want_scale = ref_scale(y.double().abs().amax(-1, keepdim=True))
        torch.testing.assert_close(scale, want_scale, rtol=2 ** -7, atol=0)
        got, want = q.float(), ref_mul(y, scale).float()
        differ = got != want
        assert differ.sum() <= max(2, 1e-4 * got.numel()), f"{int(differ.sum())} of {got.numel()} differ ({shape})"
        assert ((got - want).abs() <= 0.125 * want.abs() + 2 ** -9)[differ].all()


def test_matches_library_reference_on_cpu(kernels):
    """The spec (customop.math.quant) on CPU tensors, where ``amax / fp8_max``
    is a true division: equal bits."""
    from customop.math import quant as qm

    quant = kernels[0]
    x = _x((512, 8192))
    xc = x.cpu()
    for got, want in (
        (quant.dynamic_per_token_scaled_fp8_quant(x, None, FP8, MAX, MIN_SCALE),
         qm.dynamic_per_token_scaled_fp8_quant(xc, None, FP8, MAX, MIN_SCALE)),
        (quant.dynamic_scaled_fp8_quant(x, FP8, MAX, MIN_SCALE), qm.dynamic_scaled_fp8_quant(xc, FP8, MAX, MIN_SCALE)),
        (quant.per_token_group_fp8_quant(x, 128, True, True, FP8, MAX, MIN_SCALE),
         qm.per_token_group_fp8_quant(xc, 128, True, True, FP8, MAX, MIN_SCALE)),
        (quant.per_token_group_fp8_quant(x, 128, False, False, FP8, MAX, MIN_SCALE),
         qm.per_token_group_fp8_quant(xc, 128, False, False, FP8, MAX, MIN_SCALE)),
    ):
        assert torch.equal(got[1].cpu(), want[1])
        assert_bits(got[0].cpu(), want[0], "q vs customop.math.quant on CPU")


# ---- guard-padded outputs and CUDA graphs --------------------------------------------------


def _launches(quant, fused, x, w, ub):
    static_scale = torch.tensor([0.05], device=x.device)  # made here: no host copy inside a capture
    return {
        "static": lambda: (quant.static_scaled_fp8_quant(x, static_scale, FP8, MAX),),
        "per_tensor": lambda: quant.dynamic_scaled_fp8_quant(x, FP8, MAX, MIN_SCALE),
        "per_token": lambda: quant.dynamic_per_token_scaled_fp8_quant(x, ub, FP8, MAX, MIN_SCALE),
        "group": lambda: quant.per_token_group_fp8_quant(x, 64, False, False, FP8, MAX, MIN_SCALE),
        "group_cm_ue8m0": lambda: quant.per_token_group_fp8_quant(x, 64, True, True, FP8, MAX, MIN_SCALE),
        "rms_norm_quant": lambda: fused.rms_norm_dynamic_per_token_fp8_quant(x, w, 1e-6, ub, FP8, MAX, MIN_SCALE),
    }


def test_outputs_inside_guarded_buffers(kernels, monkeypatch):
    """Every output the launchers allocate sits between two guard zones of poison bytes; after
    each launch the guards are intact and the outputs equal an unguarded run."""
    quant, fused = kernels
    x, w, ub = _x((37, 4224)), torch.rand(4224, device="cuda").bfloat16() + 0.5, torch.tensor([30.0], device="cuda")
    plain = {name: run() for name, run in _launches(quant, fused, x, w, ub).items()}
    guards, real_empty = [], torch.empty

    def guarded_empty(*size, dtype=None, device=None, **kwargs):
        shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else tuple(size)
        numel, pad = 1, 4096
        for n in shape:
            numel *= n
        raw = real_empty(numel * (dtype or torch.float32).itemsize + 2 * pad, dtype=torch.uint8, device=device)
        raw.fill_(0xA5)
        guards.append(raw)
        return raw[pad: pad + numel * (dtype or torch.float32).itemsize].view(dtype or torch.float32).view(shape)

    monkeypatch.setattr(torch, "empty", guarded_empty)
    for name, run in _launches(quant, fused, x, w, ub).items():
        guards.clear()
        outs = run()
        torch.cuda.synchronize()
        for raw in guards:
            assert (raw[:4096] == 0xA5).all() and (raw[-4096:] == 0xA5).all(), f"{name}: guard bytes overwritten"
        for got, want in zip(outs, plain[name]):
            assert torch.equal(got.view(torch.uint8) if got.dtype == FP8 else got,
                               want.view(torch.uint8) if want.dtype == FP8 else want), name


@pytest.mark.parametrize("tokens", [1, 16, 4096])
def test_cuda_graph_replay(kernels, tokens):
    quant, fused = kernels
    x = _x((tokens, 8192))
    w, ub = torch.rand(8192, device="cuda").bfloat16() + 0.5, torch.tensor([30.0], device="cuda")
    for name, run in _launches(quant, fused, x, w, ub).items():
        run()  # compile and warm the allocator outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = run()
        x.copy_(_x((tokens, 8192), seed=tokens + 1))
        eager = run()
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(captured, eager):
            assert torch.equal(got.view(torch.uint8) if got.dtype == FP8 else got,
                               want.view(torch.uint8) if want.dtype == FP8 else want), f"{name} T={tokens}"
        x.copy_(_x((tokens, 8192)))


# ---- compute-sanitizer -------------------------------------------------------------------------


def _sanitizer() -> str | None:
    return shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.path.exists(p)), None)


@pytest.mark.skipif(_sanitizer() is None, reason="compute-sanitizer is not installed")
def test_memcheck_quant_and_rotary():
    proc = subprocess.run([_sanitizer(), "--tool", "memcheck", "--error-exitcode", "1",
                           sys.executable, "-m", "tests.gpu.test_quant_cuda"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, TRITON_INTERPRET="0"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "ERROR SUMMARY: 0 errors" in out, out[-6000:]


def launch_all() -> int:
    """One launch of every quant variant on small odd shapes, next to other allocations."""
    from customop.backends.triton import _tuning, fused_norm_quant, quant

    launches = 0
    ub = torch.tensor([30.0], device="cuda")
    for shape in ((7, 4231), (33, 100), (2, 8192), (9, 640), (3, 5, 256)):
        x = _x(shape)
        w = torch.rand(shape[-1], device="cuda").bfloat16() + 0.5
        launches += len([fn() for fn in _launches(quant, fused_norm_quant, x, w, ub).values()])
    strided = _x((9, 1100))[:, :1000]
    quant.dynamic_scaled_fp8_quant(strided, FP8, MAX, MIN_SCALE)
    quant.per_token_group_fp8_quant(strided, 100, True, False, FP8, MAX, MIN_SCALE)
    with _tuning.override("rows", single_tile=False, block_n=1024, block_m=1):  # the looped row variants
        x = _x((3, 3000))
        quant.dynamic_per_token_scaled_fp8_quant(x, ub, FP8, MAX, MIN_SCALE)
        fused_norm_quant.rms_norm_dynamic_per_token_fp8_quant(x, x[0].clone(), 1e-6, ub, FP8, MAX, MIN_SCALE)
    return launches + 4


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "0"
    from tests.gpu import test_rotary_cuda

    n = launch_all() + test_rotary_cuda.launch_all()
    torch.cuda.synchronize()
    print(f"quant + rotary: {n} launches done")
