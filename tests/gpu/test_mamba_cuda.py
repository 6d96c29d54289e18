"""State-space kernels on the GPU (``pytest -m cuda``): every case of the table
(``customop/samples/mamba.py``) at its real sizes (Mamba-1 as FalconMamba-7B, Mamba-2 as
Mamba-2-2.7B and a Nemotron-H-like layer with 8 groups, LFM2's short conv) on the real batches
(decode 64 and 256 with CUDA-graph padding rows, prefill 1 x 4096, 8 mixed requests of 1-700
tokens behind 16 decodes) through ``forward_kernel``, against the float64 references
(``tests/cases/mamba.py``): outputs and every cache slot. Then CUDA-graph capture and replay of a
decode step and of a prefill, caches inside NaN-guarded buffers, and compute-sanitizer memcheck
over one launch of every kernel variant (this module run as a script:
``python -m tests.gpu.test_mamba_cuda`` launches them).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.cuda

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: bf16 on every case; fp32 and fp16 on the first case of each op (the interpreter tier runs
#: every case in every dtype at small sizes)
BASE = ("mamba_mixer", "mamba_mixer2", "short_conv")


@pytest.fixture(scope="module")
def mamba_kernels():
    """``{"customop::<op>": launcher}`` of the state-space kernels, compiled and registered for CUDA."""
    import triton

    from customop.backend_loader import load_backend
    from customop.backends.triton import mamba_conv, mamba_norm, mamba_scan, mamba_ssd

    load_backend("cuda")
    table = {}
    for module in (mamba_conv, mamba_scan, mamba_ssd, mamba_norm):
        jitted = [v for k, v in vars(module).items() if k.endswith("_kernel") and hasattr(v, "run")]
        if not jitted or not all(isinstance(k, triton.runtime.jit.JITFunction) for k in jitted):
            pytest.fail(f"{module.__name__}: the Triton kernels were imported under TRITON_INTERPRET=1")
        for name, launcher in module.KERNELS.items():
            assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA"), f"{name} has no CUDA kernel"
            table[name] = launcher
    return table


def close_on_device(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, atol: float, rtol: float,
                    what: str = "") -> None:
    """``customop.testing.assert_close`` evaluated on the GPU in row blocks (a cache here is up to
    a gigabyte); only the first failing row goes to the CPU for the report. NaN must match NaN."""
    from customop.testing import mismatch_report

    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    g, w = got.reshape(-1, got.shape[-1]), want.reshape(-1, want.shape[-1])
    for start in range(0, g.shape[0], 4096):
        gc, wc = g[start:start + 4096].double(), w[start:start + 4096].double()
        bad = ~((gc - wc).abs() <= atol + rtol * wc.abs()) & ~(gc.isnan() & wc.isnan())
        if bad.any():
            row = start + int(bad.any(dim=1).nonzero()[0])
            report = mismatch_report(g[row:row + 1].cpu(), w[row:row + 1].cpu(), atol, rtol)
            raise AssertionError(f"{what} ({got.dtype}, shape {tuple(got.shape)}), first bad row {row}: {report}")


def build(case, dtype, seed=0):
    from customop.config import Config, use_config

    with use_config(Config(custom_ops=["all"])):
        return case.build("real", dtype, torch.Generator().manual_seed(seed), device="cuda")


def _params():
    from customop.samples.mamba import BATCHES, CASES, DTYPES

    return [pytest.param(c, b, d, id=f"{c.label}-{b.label}-{d}") for c in CASES for b in BATCHES["real"]
            for d in DTYPES if d == torch.bfloat16 or c.label in BASE]


@pytest.mark.parametrize("case,batch,dtype", _params())
def test_real_sizes(mamba_kernels, case, batch, dtype, poison_empty):
    from tests.cases.mamba import assert_matches, reference

    op = build(case, dtype)
    h, *caches, meta = case.inputs(op, batch, dtype, torch.Generator().manual_seed(1), device="cuda")
    expected = reference(case, op, batch, h, *caches)
    with torch.no_grad():
        out = op.forward_kernel(h, *caches, meta)
    torch.cuda.synchronize()
    assert_matches((out, *caches), expected, dtype, what=f"{case.label} {batch.label}", close=close_on_device)


def _capture(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up: compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.parametrize("label,batch", [("mamba_mixer", "decode 64"), ("mamba_mixer2", "decode 256 (+2 padding)"),
                                         ("short_conv", "decode 64"), ("mamba_mixer2[1 group]", "prefill 8x512 mixed")])
def test_cuda_graph_replay_matches_eager(mamba_kernels, label, batch):
    """A step captured once (no host sync on the route: the chunk table and the token -> request
    map are built on the device) and replayed on new inputs and reset caches gives what an eager
    call gives on the same inputs and caches."""
    from customop.samples.mamba import BATCHES, BY_LABEL

    case, batch = BY_LABEL[label], next(b for b in BATCHES["real"] if b.label == batch)
    op = build(case, torch.bfloat16)
    h, *caches, meta = case.inputs(op, batch, torch.bfloat16, torch.Generator().manual_seed(1), device="cuda")
    initial = [c.clone() for c in caches]
    with torch.no_grad():
        graph, captured = _capture(lambda: op.forward_kernel(h, *caches, meta))
        h.copy_(torch.randn_like(h))
        for c, c0 in zip(caches, initial):
            c.copy_(c0)
        graph.replay()
        torch.cuda.synchronize()
        replayed, replayed_caches = captured.clone(), [c.clone() for c in caches]
        for c, c0 in zip(caches, initial):
            c.copy_(c0)
        eager = op.forward_kernel(h, *caches, meta)
    assert torch.equal(replayed, eager)
    assert all(torch.equal(r, c) for r, c in zip(replayed_caches, caches))


def test_caches_inside_guarded_buffers(mamba_kernels):
    """The caches are windows of NaN-filled buffers (slots, columns and channels strided past the
    window): the kernels write only the requests' slots inside the window."""
    from customop.samples.mamba import BATCHES, BY_LABEL
    from tests.cases.mamba import assert_matches, reference

    case, batch = BY_LABEL["mamba_mixer2"], BATCHES["real"][3]
    op = build(case, torch.bfloat16)
    h, conv, ssm, meta = case.inputs(op, batch, torch.bfloat16, torch.Generator().manual_seed(1), device="cuda")
    conv_buf = torch.full((conv.shape[0] + 2, conv.shape[1] + 2, conv.shape[2] + 64), float("nan"),
                          dtype=conv.dtype, device="cuda")
    ssm_buf = torch.full((ssm.shape[0] + 2, *ssm.shape[1:3], ssm.shape[3] + 8), float("nan"), dtype=ssm.dtype,
                         device="cuda")
    conv_w, ssm_w = conv_buf[1:-1, 1:-1, 32:-32], ssm_buf[1:-1, ..., 4:-4]
    conv_w.copy_(conv)
    ssm_w.copy_(ssm)
    expected = reference(case, op, batch, h, conv_w, ssm_w)
    with torch.no_grad():
        out = op.forward_kernel(h, conv_w, ssm_w, meta)
    torch.cuda.synchronize()
    assert_matches((out, conv_w, ssm_w), expected, torch.bfloat16, what="guarded", close=close_on_device)
    for buf, window in ((conv_buf, (slice(1, -1), slice(1, -1), slice(32, -32))),
                        (ssm_buf, (slice(1, -1), slice(None), slice(None), slice(4, -4)))):
        inside = torch.zeros_like(buf, dtype=torch.bool)
        inside[window] = True
        assert buf[~inside].isnan().all(), "a kernel wrote outside its window"


def _sanitizer() -> str | None:
    return shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.path.exists(p)), None)


def test_memcheck_clean():
    if _sanitizer() is None:
        pytest.skip("compute-sanitizer is not installed")
    proc = subprocess.run([_sanitizer(), "--tool", "memcheck", "--error-exitcode", "1",
                           sys.executable, "-m", "tests.gpu.test_mamba_cuda"],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800,
                          env=dict(os.environ, TRITON_INTERPRET="0"))
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0 and "ERROR SUMMARY: 0 errors" in proc.stdout + proc.stderr, tail


def main() -> int:
    """One launch of every kernel variant at small odd sizes, next to other allocations (so that
    an out-of-bounds access lands on memory memcheck watches): every case and small batch
    through forward_kernel, and the conv at every kernel width on padding and empty requests."""
    from customop.backend_loader import load_backend
    from customop.backends.triton import mamba_conv
    from customop.samples.mamba import BATCHES, CASES

    load_backend("cuda")
    launches = 0
    with torch.no_grad():
        for case in CASES:
            from customop.config import Config, use_config

            with use_config(Config(custom_ops=["all"])):
                op = case.build("small", torch.bfloat16, torch.Generator().manual_seed(0), device="cuda")
            for batch in BATCHES["small"] + BATCHES["check"]:
                h, *caches, meta = case.inputs(op, batch, torch.bfloat16, device="cuda")
                op.forward_kernel(h, *caches, meta)
                launches += 1
        for K in (2, 3, 4, 5, 6):
            x, w = torch.randn(11, 37, device="cuda"), torch.randn(37, K, device="cuda")
            cache = torch.randn(5, K + 1, 37, device="cuda").transpose(1, 2)
            qsl = torch.tensor([0, 1, 1, 9, 11], dtype=torch.int32, device="cuda")
            slots = torch.tensor([1, 2, 3, -1], device="cuda")
            mamba_conv.causal_conv1d_fn(x, w, None, cache, qsl, slots, torch.ones(4, dtype=torch.bool, device="cuda"),
                                        True, 0)
            mamba_conv.causal_conv1d_update(x[:4], cache, w, None, torch.tensor([0, 4, -1, 2], device="cuda"), False, 0)
            launches += 2
    torch.cuda.synchronize()
    print(f"test_mamba_cuda: {launches} forward_kernel calls and conv launches done")
    return 0


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "0"
    sys.exit(main())
