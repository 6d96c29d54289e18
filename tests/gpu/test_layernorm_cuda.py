"""Norm kernels on the GPU at real sizes (up to 32768 x 8192), against float64 references;
in-place contracts; CUDA-graph capture and replay; in-place writes inside NaN-guarded buffers."""

from __future__ import annotations

import pytest
import torch

from tests.backends.triton.references import ref_fused_add, ref_gated, ref_gemma, ref_rms_norm
from tests.gpu.conftest import assert_close_on_device

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

EPS = 1e-6
SHAPES = ((1, 8192), (16, 4096), (7, 4231), (33, 128), (4096, 8192), (32768, 8192), (2, 65536))


def _x(shape, dtype, scale=1.0, offset=0.0):
    return (torch.randn(shape, device="cuda") * scale + offset).to(dtype)


@pytest.mark.parametrize("weight", ["same", "fp32", None])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_rms_norm_and_gemma(compiled_kernels, dtype, weight, poison_empty):
    norm = compiled_kernels[1]
    # every size in bf16; fp16/fp32 (covered in CI too) on fewer, to bound the variants to compile
    for shape in SHAPES if dtype == torch.bfloat16 else ((16, 4096), (7, 4231), (2, 65536)):
        x = _x(shape, dtype, 3.0)
        w = None if weight is None else _x(shape[-1:], dtype if weight == "same" else torch.float32, 0.5, 1.0)
        assert_close_on_device(norm.rms_norm(x, w, EPS), ref_rms_norm(x, w, EPS).to(dtype), f"rms_norm {shape}")
        if w is not None:
            assert_close_on_device(norm.gemma_rms_norm(x, w, EPS), ref_gemma(x, w, EPS).to(dtype), f"gemma {shape}")


@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_fused_add_in_place(compiled_kernels, dtype, gemma):
    norm = compiled_kernels[1]
    launcher = norm.gemma_fused_add_rms_norm if gemma else norm.fused_add_rms_norm
    for shape in SHAPES:
        x, r = _x(shape, dtype, 2.0), _x(shape, dtype, 2.0)
        w = _x(shape[-1:], dtype, 0.5, 0.0 if gemma else 1.0)
        want_out, want_res = ref_fused_add(x, r, w, EPS, gemma)
        launcher(x, r, w, EPS)
        assert_close_on_device(r, want_res.to(dtype), f"residual {shape}")
        assert_close_on_device(x, want_out.to(dtype), f"out {shape}")
        del want_out, want_res


@pytest.mark.parametrize("sigmoid", [False, True])
@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_rms_norm_gated(compiled_kernels, norm_before_gate, sigmoid, poison_empty):
    norm = compiled_kernels[1]
    for shape, group in (((4096, 8192), 8192), ((4096, 8192), 1024), ((7, 4231), 4231), ((1, 4096), 128),
                         ((2, 65536), 65536)):
        x, z = _x(shape, torch.bfloat16, 2.0), _x(shape, torch.bfloat16, 2.0)
        w = _x(shape[-1:], torch.float32, 0.5, 1.0)
        out = norm.rms_norm_gated(x, w, z, 1e-5, group, norm_before_gate, sigmoid)
        assert_close_on_device(out, ref_gated(x, w, z, 1e-5, group, norm_before_gate, sigmoid).bfloat16(), f"gated {shape}/{group}")
    x, w = _x((16, 4096), torch.bfloat16), _x((4096,), torch.float32)
    assert_close_on_device(norm.rms_norm_gated(x, w, None, 1e-5, 4096, False, False),
                           ref_gated(x, w, None, 1e-5, 4096, False, False).bfloat16(), "gated without z")


def _capture(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.parametrize("name", ["rms_norm", "gemma_rms_norm", "rms_norm_gated", "fused_add_rms_norm", "gemma_fused_add_rms_norm"])
def test_cuda_graph_replay_matches_eager(compiled_kernels, name):
    norm = compiled_kernels[1]
    launcher = getattr(norm, name)
    x, r, z = (_x((16, 8192), torch.bfloat16, 2.0) for _ in range(3))
    w = _x((8192,), torch.bfloat16, 0.5, 1.0)
    in_place = "fused_add" in name
    args = {"rms_norm_gated": (x, w, z, 1e-5, 8192, False, False)}.get(name, (x, r, w, EPS) if in_place else (x, w, EPS))
    graph, captured = _capture(lambda: launcher(*args))
    fresh_x, fresh_r = torch.randn_like(x), torch.randn_like(r)
    x.copy_(fresh_x)
    r.copy_(fresh_r)
    graph.replay()
    torch.cuda.synchronize()
    if in_place:
        got = (x.clone(), r.clone())
        x.copy_(fresh_x)
        r.copy_(fresh_r)
        launcher(*args)
        assert torch.equal(got[0], x) and torch.equal(got[1], r)
    else:
        assert torch.equal(captured, launcher(*args))


@pytest.mark.parametrize("name", ["fused_add_rms_norm", "gemma_fused_add_rms_norm"])
def test_in_place_writes_stay_inside_guarded_buffers(compiled_kernels, name):
    """x and residual are windows of NaN-filled buffers with rows strided past the window: the
    padding stays NaN and the window holds the right values."""
    launcher = getattr(compiled_kernels[1], name)
    rows, hidden, pad = 4099, 8192, 64
    xbuf = torch.full((rows + 2, hidden + 2 * pad), float("nan"), device="cuda", dtype=torch.bfloat16)
    rbuf = torch.full_like(xbuf, float("nan"))
    x, r = xbuf[1:-1, pad:pad + hidden], rbuf[1:-1, pad:pad + hidden]
    x.copy_(torch.randn(rows, hidden, device="cuda"))
    r.copy_(torch.randn(rows, hidden, device="cuda"))
    w = _x((hidden,), torch.bfloat16, 0.5, 1.0)
    want_out, want_res = ref_fused_add(x, r, w, EPS, gemma="gemma" in name)
    launcher(x, r, w, EPS)
    torch.cuda.synchronize()
    assert_close_on_device(x, want_out.bfloat16(), "out")
    assert_close_on_device(r, want_res.bfloat16(), "residual")
    for buf in (xbuf, rbuf):
        inside = torch.zeros_like(buf, dtype=torch.bool)
        inside[1:-1, pad:pad + hidden] = True
        assert buf[~inside].isnan().all(), "a kernel wrote outside its window"
