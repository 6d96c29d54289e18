"""Norm kernels on the GPU: every case of the table (``customop/samples/layernorm.py``) through
``forward_kernel`` at the real sizes (up to 32768 x 8192 and rows of 65536) against the float64
references (``tests/cases/layernorm.py``); in-place contracts; CUDA-graph capture and replay;
in-place writes inside NaN-guarded buffers."""

from __future__ import annotations

import pytest
import torch

from customop.samples.layernorm import CASES, DTYPES, SCALE, SIZES
from tests.cases.layernorm import ref_fused_add, ref_fused_add_nemotron, reference
from tests.gpu.conftest import assert_close_on_device

pytestmark = pytest.mark.cuda

EPS = 1e-6
#: fp16, and fp32 outside the base rows (all covered by the interpreter tier too), on fewer sizes:
#: a mid one, the odd one and the widest rows, which bounds the kernel variants to compile
FEWER = ((16, 4096), (7, 4231), (2, 65536))


def _x(shape, dtype, scale=1.0, offset=0.0):
    return (torch.randn(shape, device="cuda") * scale + offset).to(dtype)


def shapes_for(case, dtype):
    return SIZES["real"] if dtype == torch.bfloat16 or (dtype == torch.float32 and case.base) else FEWER


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_real_sizes(cuda_kernels, case, dtype, poison_empty):
    for shape in shapes_for(case, dtype):
        op = case.build(shape[-1], dtype).to("cuda")
        args = tuple(_x(shape, dtype, SCALE) for _ in case.arguments)  # drawn on the GPU: x, residual or z
        expected_out, expected_residual = reference(case, op, *args)
        got = op.forward_kernel(*args, **case.call_kwargs)
        torch.cuda.synchronize()
        if expected_residual is not None:  # the fused adds (FusedRMSNormGated's with prenorm)
            if case.in_place:
                assert got[0] is args[0] and got[1] is args[1], "the fused add writes in place"
            assert_close_on_device(got[1], expected_residual.to(dtype), f"{case.label} residual {shape}")
            got = got[0]
        assert got.dtype == dtype
        assert_close_on_device(got, expected_out.to(dtype), f"{case.label} {shape}")
        del args, got, expected_out, expected_residual


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


@pytest.mark.parametrize("name", ["rms_norm", "gemma_rms_norm", "rms_norm_gated", "fused_add_rms_norm", "gemma_fused_add_rms_norm",
                                  "layer_norm", "nemotron_layer_norm", "fused_add_nemotron_layer_norm",
                                  "fused_rms_norm_gated", "fused_add_rms_norm_gated"])
def test_cuda_graph_replay_matches_eager(cuda_kernels, name):
    launcher = cuda_kernels[f"customop::{name}"]
    x, r, z = (_x((16, 8192), torch.bfloat16, 2.0) for _ in range(3))
    w, b = _x((8192,), torch.bfloat16, 0.5, 1.0), _x((8192,), torch.bfloat16, 0.5)
    in_place = name in ("fused_add_rms_norm", "gemma_fused_add_rms_norm", "fused_add_nemotron_layer_norm")
    args = {"rms_norm_gated": (x, w, z, 1e-5, 8192, False, False), "layer_norm": (x, w, b, 1e-5),
            "nemotron_layer_norm": (x, w, b, 1e-5), "fused_add_nemotron_layer_norm": (x, r, w, b, 1e-5),
            "fused_rms_norm_gated": (x, z, w, 1e-5, False), "fused_add_rms_norm_gated": (x, z, r, w, 1e-5, True),
            }.get(name, (x, r, w, EPS) if in_place else (x, w, EPS))
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
        again = launcher(*args)
        for c, e in zip(*((captured, again) if isinstance(again, tuple) else ((captured,), (again,)))):
            assert torch.equal(c, e)


@pytest.mark.parametrize("name", ["fused_add_rms_norm", "gemma_fused_add_rms_norm", "fused_add_nemotron_layer_norm"])
def test_in_place_writes_stay_inside_guarded_buffers(cuda_kernels, name):
    """x and residual are windows of NaN-filled buffers with rows strided past the window: the
    padding stays NaN and the window holds the right values."""
    launcher = cuda_kernels[f"customop::{name}"]
    rows, hidden, pad = 4099, 8192, 64
    xbuf = torch.full((rows + 2, hidden + 2 * pad), float("nan"), device="cuda", dtype=torch.bfloat16)
    rbuf = torch.full_like(xbuf, float("nan"))
    x, r = xbuf[1:-1, pad:pad + hidden], rbuf[1:-1, pad:pad + hidden]
    x.copy_(torch.randn(rows, hidden, device="cuda"))
    r.copy_(torch.randn(rows, hidden, device="cuda"))
    w = _x((hidden,), torch.bfloat16, 0.5, 1.0)
    if "nemotron" in name:
        b = _x((hidden,), torch.bfloat16, 0.5)
        want_out, want_res = ref_fused_add_nemotron(x, r, w, b, EPS)
        launcher(x, r, w, b, EPS)
    else:
        want_out, want_res = ref_fused_add(x, r, w, EPS, gemma="gemma" in name)
        launcher(x, r, w, EPS)
    torch.cuda.synchronize()
    assert_close_on_device(x, want_out.bfloat16(), "out")
    assert_close_on_device(r, want_res.bfloat16(), "residual")
    for buf in (xbuf, rbuf):
        inside = torch.zeros_like(buf, dtype=torch.bool)
        inside[1:-1, pad:pad + hidden] = True
        assert buf[~inside].isnan().all(), "a kernel wrote outside its window"
