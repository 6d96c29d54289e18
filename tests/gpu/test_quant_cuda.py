"""fp8 quant kernels on the GPU: every kernel mode of the table (``customop/samples/quant.py``)
through ``forward_kernel`` at the real sizes (up to 32768 x 8192), scales exactly and fp8 bits
against the float64 references (``tests/cases/quant.py``, torch's own fp32 -> fp8 cast); strided
and clamping launches; the fused RMSNorm + quant; outputs inside guard-padded buffers; CUDA-graph
capture and replay; compute-sanitizer memcheck over one launch of every quant and rotary kernel
variant (``python -m tests.gpu.test_quant_cuda`` is that launch list).

The references compute in float64 the exact fp32 value the spec rounds (tests/cases/quant.py).
Note: torch's CUDA ``tensor / python_float`` multiplies by the reciprocal instead
(BinaryDivTrueKernel.cu), so the library's reference (customop.math.quant) run on CUDA tensors
gives scales one ulp off in about half the rows; on CPU tensors it divides, and
test_matches_library_reference_on_cpu checks the kernel against it bit for bit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from customop.samples.quant import DTYPES, KERNEL_CASES, NORM_QUANT
from tests.cases import quant as cases

pytestmark = pytest.mark.cuda

FP8, MAX = torch.float8_e4m3fn, 448.0
MIN_SCALE = 1.0 / (MAX * 512.0)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: fp16 and fp32 (covered by the interpreter tier too): a mid size, the odd one, a large one
FEWER = ((16, 8192), (7, 4231), (4096, 8192))


@pytest.fixture(scope="module")
def kernels(cuda_kernels):
    from customop.backends.triton import fused_norm_quant, quant

    return quant, fused_norm_quant


def _x(shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, device="cuda", generator=g) * 3.0
    x.view(-1)[::997] *= 50.0  # outliers: large amax, clamped values under a static scale
    return x.to(dtype)


def fp32(t):
    return t.to(torch.float32)


def ref_scale(amax64):
    return cases.ref_scale(amax64, FP8)


def ref_mul(x, scale, max_=MAX, dtype=FP8):
    inv = fp32(1.0 / scale.double())
    return fp32(x.double() * inv.double()).clamp(-max_, max_).to(dtype)


def assert_bits(got, want, what):
    cases.assert_same_bits(got, want, what)


# ---- the table at real sizes --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: c.label)
def test_real_sizes(kernels, case, dtype):
    op = cases.build(case, FP8, platform=cases.Fp8Cuda(FP8))
    shapes = case.shapes("real")
    if dtype != torch.bfloat16:
        shapes = tuple(s for s in FEWER if s in shapes)
    for shape in shapes:
        x = case.input(shape, dtype, device="cuda")
        kwargs = case.call_kwargs(x, MAX)
        out = cases.forward_kernel(op, x, kwargs)
        torch.cuda.synchronize()
        cases.check_against_reference(case, x, out, FP8, kwargs)
        del x, out


# ---- launches the op never makes ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_per_token_strided(kernels, dtype):
    quant = kernels[0]
    wide = _x((4096, 8192 + 64), dtype)
    x = wide[:, :8192]  # row stride > H (forward_kernel would copy it)
    q, scale = quant.dynamic_per_token_scaled_fp8_quant(x, None, FP8, MAX, MIN_SCALE)
    want_scale = ref_scale(x.double().abs().amax(-1, keepdim=True))
    assert torch.equal(scale, want_scale)
    assert_bits(q, ref_mul(x, want_scale), "q")


def test_static_scale_that_clamps(kernels):
    """A static scale small enough that the outliers saturate at +-448."""
    quant = kernels[0]
    for shape in ((16, 8192), (7, 4231), (4096, 8192), (32768, 8192), (3, 5, 1000)):
        x = _x(shape)
        static_scale = torch.tensor([0.02], device="cuda")
        q_static = quant.static_scaled_fp8_quant(x, static_scale, FP8, MAX)
        assert_bits(q_static, ref_mul(x, static_scale), f"static q {shape}")
        assert (q_static.float().abs() == MAX).any()


@pytest.mark.parametrize("case", NORM_QUANT, ids=lambda c: c.label)
def test_rms_norm_quant(kernels, case):
    """Scales within one bf16 ulp of the float64 reference; fp8 values equal to the reference
    normalised value quantized with the kernel's scale, except at most 1e-4 of them one step away
    (the fp32 sum of squares runs in another order, which can move y by one bf16 ulp)."""
    fused = kernels[1]
    for shape in ((1, 8192), (7, 4231), (4096, 8192), (32768, 8192)):
        x = _x(shape)
        w = case.weight_for(shape[-1], torch.bfloat16, device="cuda")
        ub = torch.tensor([1.5], device="cuda") if case.scale_ub else None
        q, scale = fused.rms_norm_dynamic_per_token_fp8_quant(x, w, 1e-6, ub, FP8, MAX, MIN_SCALE)
        y = cases.ref_rms_norm(x, w, 1e-6, cases.round_to)
        amax = y.double().abs().amax(-1, keepdim=True)
        want_scale = ref_scale(amax if ub is None else amax.clamp(max=1.5))
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
