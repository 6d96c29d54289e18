"""Patch-embedding convolutions on the GPU (``conv2d``, ``conv3d``): the real patch embeddings of the
table (``customop/samples/conv.py``: Qwen2-VL's 3x(2,14,14) -> 1280 over 4096 and 16384
patches, CLIP's and SigLIP's 2-D patches) and every small case, through ``forward_kernel`` on CUDA
tensors, against float64 references computed on the device; the linear form against cuDNN's
convolution; CUDA-graph capture and replay; conformance."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from customop.samples.conv import CASES, DTYPES, REAL_CASES
from tests.cases.conv import reference
from tests.gpu.conftest import assert_close_on_device

pytestmark = pytest.mark.cuda


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[B, O, *grid]`` as ``[B * grid, O]`` rows for the row-wise comparison helper."""
    return t.movedim(1, -1).reshape(-1, t.shape[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", REAL_CASES + CASES, ids=lambda c: c.label)
def test_real_sizes(case, dtype):
    shapes = case.shapes["real"] if "real" in case.shapes else case.shapes["small"]
    op = case.build(dtype, device="cuda", generator=_gen())
    for shape in shapes:
        x = case.input(shape, dtype, device="cuda", generator=_gen(1))
        expected = reference(op, x)
        got = op.forward_kernel(x)
        torch.cuda.synchronize()
        assert got.dtype == dtype and got.shape == expected.shape
        assert_close_on_device(_rows(got), _rows(expected).to(dtype), f"{case.label} {shape}")


@pytest.mark.parametrize("case", REAL_CASES, ids=lambda c: c.label)
def test_linear_form_agrees_with_cudnn(case):
    """bf16: the GEMM form and cuDNN's convolution each round once from fp32 accumulation."""
    op = case.build(torch.bfloat16, device="cuda", generator=_gen())
    x = case.input(case.shapes["real"][0], torch.bfloat16, device="cuda", generator=_gen(1))
    conv = (F.conv2d if op.num_dim == 2 else F.conv3d)(x, op.weight, op.bias, op.stride)
    assert_close_on_device(_rows(op.forward_kernel(x)), _rows(conv), case.label)


def test_cuda_graph_replay_matches_eager():
    case = REAL_CASES[0]
    op = case.build(torch.bfloat16, device="cuda", generator=_gen())
    x = case.input(case.shapes["real"][0], torch.bfloat16, device="cuda", generator=_gen(1))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        op.forward_kernel(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = op.forward_kernel(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, op.forward_kernel(x))


@pytest.mark.parametrize("name", ["Conv2dLayer", "Conv3dLayer"])
def test_conforms_on_the_gpu(name):
    from customop.ops import conv
    from customop.testing import assert_conforms

    assert_conforms(getattr(conv, name), platform="cuda", device="cuda")
