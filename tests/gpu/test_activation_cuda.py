"""Activation kernels on the GPU at real sizes (up to 32768 tokens), against float64 (float32 for
the largest) references; CUDA-graph capture and replay; inputs inside NaN-guarded buffers."""

from __future__ import annotations

import pytest
import torch

from tests.backends.triton.references import (
    ref_fatrelu_and_mul, ref_gelu_and_mul, ref_gelu_and_mul_sparse, ref_gelu_fast, ref_gelu_new, ref_mul_and_silu,
    ref_quick_gelu, ref_relu2, ref_silu_and_mul, ref_swigluoai_and_mul, ref_xielu,
)
from tests.gpu.conftest import assert_close_on_device

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

D = 14336  # the *_and_mul width (intermediate size); elementwise ops use hidden sizes
# (launcher name, reference, extra args, gated)
CASES = {
    "silu_and_mul": ("silu_and_mul", ref_silu_and_mul, (), True),
    "mul_and_silu": ("mul_and_silu", ref_mul_and_silu, (), True),
    "gelu_and_mul[none]": ("gelu_and_mul", ref_gelu_and_mul, ("none",), True),
    "gelu_and_mul[tanh]": ("gelu_and_mul", ref_gelu_and_mul, ("tanh",), True),
    "gelu_and_mul_sparse[none]": ("gelu_and_mul_sparse", ref_gelu_and_mul_sparse, (0.8416, "none"), True),
    "gelu_and_mul_sparse[tanh]": ("gelu_and_mul_sparse", ref_gelu_and_mul_sparse, (1.6449, "tanh"), True),
    "fatrelu_and_mul": ("fatrelu_and_mul", ref_fatrelu_and_mul, (0.25,), True),
    "swigluoai_and_mul": ("swigluoai_and_mul", ref_swigluoai_and_mul, (1.702, 7.0), True),
    "gelu_new": ("gelu_new", ref_gelu_new, (), False),
    "gelu_fast": ("gelu_fast", ref_gelu_fast, (), False),
    "quick_gelu": ("quick_gelu", ref_quick_gelu, (), False),
    "relu2": ("relu2", ref_relu2, (), False),
    "xielu": ("xielu", ref_xielu, "xielu", False),
}
# rows x width: decode, odd masks, a mid size, and the largest (32768 tokens)
GATED_SHAPES = ((1, 2 * D), (16, 2 * D), (7, 2 * 4231), (4096, 2 * D), (32768, 2 * D))
UNARY_SHAPES = ((1, 4096), (16, 8192), (7, 4231), (4096, 8192), (32768, 8192))


def _extra(case, dtype):
    extra = CASES[case][2]
    if extra == "xielu":
        return (torch.tensor([0.8], dtype=dtype, device="cuda"), torch.tensor([1.3], dtype=dtype, device="cuda"), 0.5, -1e-6)
    return extra


def _reference(case, x, extra):
    """float64, or float32 when the input is over 2**27 elements (bounds the temporaries)."""
    ref_dtype = torch.float64 if x.numel() <= 1 << 27 else torch.float32
    extra = tuple(e.to(ref_dtype) if isinstance(e, torch.Tensor) else e for e in extra)
    return CASES[case][1](x.to(ref_dtype), *extra)


def _launcher(kernels, case):
    return getattr(kernels[0], CASES[case][0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", sorted(CASES))
def test_real_sizes(compiled_kernels, case, dtype, poison_empty):
    launcher = _launcher(compiled_kernels, case)
    gated = CASES[case][3]
    extra = _extra(case, dtype)
    shapes = GATED_SHAPES if gated else UNARY_SHAPES
    if dtype != torch.bfloat16:
        # every size in the dtype that matters; fp16/fp32 (covered in CI too) on an aligned and
        # an odd shape, which bounds the number of kernel variants to compile
        shapes = (shapes[1], shapes[2])
    for shape in shapes:
        x = (torch.randn(shape, device="cuda") * 2).to(dtype)
        out = launcher(x, *extra)
        torch.cuda.synchronize()
        assert_close_on_device(out, _reference(case, x, extra).to(dtype), f"{case} {shape}")
        del x, out


@pytest.mark.parametrize("case", sorted(CASES))
def test_cuda_graph_replay_matches_eager(compiled_kernels, case):
    launcher = _launcher(compiled_kernels, case)
    gated = CASES[case][3]
    extra = _extra(case, torch.bfloat16)
    x = torch.randn((16, 2 * D) if gated else (16, 8192), device="cuda", dtype=torch.bfloat16)
    eager = launcher(x, *extra)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on the capture stream
        launcher(x, *extra)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = launcher(x, *extra)
    x.copy_(torch.randn_like(x))  # replay must read the new contents of the captured input
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, launcher(x, *extra))
    assert not torch.equal(captured, eager)


@pytest.mark.parametrize("case", ["silu_and_mul", "gelu_and_mul_sparse[none]", "swigluoai_and_mul", "gelu_new"])
def test_input_inside_nan_guarded_buffer(compiled_kernels, case, poison_empty):
    """The input is a window of a NaN-filled buffer (rows strided past the window, for the
    gated ops): a read outside the window would put NaN into the output."""
    launcher = _launcher(compiled_kernels, case)
    gated = CASES[case][3]
    extra = _extra(case, torch.bfloat16)
    rows, width, pad = 257, (2 * 4231 if gated else 4231), 64
    buf = torch.full((rows + 2, width + 2 * pad), float("nan"), device="cuda", dtype=torch.bfloat16)
    x = buf[1:-1, pad:pad + width] if gated else buf[1:-1, pad:pad + width].contiguous()
    x.copy_(torch.randn(rows, width, device="cuda"))
    if not gated:  # elementwise ops take contiguous input: guard a flat window instead
        flat = torch.full((rows * width + 2 * pad,), float("nan"), device="cuda", dtype=torch.bfloat16)
        flat[pad:-pad].copy_(x.flatten())
        x = flat[pad:-pad].view(rows, width)
    out = launcher(x, *extra)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    assert_close_on_device(out, _reference(case, x, extra).to(torch.bfloat16), case)
