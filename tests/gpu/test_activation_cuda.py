"""Activation kernels on the GPU: every case of the table (``customop/samples/activation.py``)
through ``forward_kernel`` at the real sizes (up to 32768 tokens) against the float64 references
(``tests/cases/activation.py``; float32 for the largest); CUDA-graph capture and replay; inputs
inside NaN-guarded buffers."""

from __future__ import annotations

import pytest
import torch

from customop.samples.activation import BY_LABEL, CASES, DTYPES
from tests.cases.activation import reference
from tests.gpu.conftest import assert_close_on_device

pytestmark = pytest.mark.cuda


def build(case):
    return case.build().to("cuda")  # xielu's parameters go with it


def make_input(case, shape, dtype):
    """``case.input``'s distribution, drawn on the GPU (the CPU generator is slow at these sizes)."""
    return (torch.randn(shape, device="cuda") * case.scale).to(dtype)


def _reference(case, x, op):
    """float64, or float32 when the input is over 2**27 elements (bounds the temporaries)."""
    return reference(case, x.to(torch.float64 if x.numel() <= 1 << 27 else torch.float32), op)


def _launch(kernels, case, op, x):
    """The launcher called directly (strided inputs, graph capture), with forward_kernel's arguments."""
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in op.math_args())
    return kernels[f"customop::{case.op}"](x, *args)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_real_sizes(cuda_kernels, case, dtype, poison_empty):
    op = build(case)
    shapes = case.shapes("real")
    if dtype != torch.bfloat16:
        # every size in the dtype that matters; fp16/fp32 (covered by the interpreter tier too) on
        # an aligned and an odd shape, which bounds the number of kernel variants to compile
        shapes = (shapes[1], shapes[2])
    for shape in shapes:
        x = make_input(case, shape, dtype)
        with torch.no_grad():
            out = op.forward_kernel(x)
        torch.cuda.synchronize()
        assert out.dtype == dtype and out.is_contiguous()
        assert_close_on_device(out, _reference(case, x, op).to(dtype), f"{case.label} {shape}")
        del x, out


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_cuda_graph_replay_matches_eager(cuda_kernels, case):
    op = build(case)
    x = make_input(case, case.shapes("real")[1], torch.bfloat16)  # 16 tokens
    eager = _launch(cuda_kernels, case, op, x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on the capture stream
        _launch(cuda_kernels, case, op, x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _launch(cuda_kernels, case, op, x)
    x.copy_(torch.randn_like(x))  # replay must read the new contents of the captured input
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, _launch(cuda_kernels, case, op, x))
    assert not torch.equal(captured, eager)


@pytest.mark.parametrize("label", ["silu_and_mul", "gelu_and_mul_sparse[0.95]", "swigluoai_and_mul",
                                   "swiglustep_and_mul", "silu_and_mul_with_clamp[1.702,1]", "situ_and_mul[4,25]",
                                   "gelu_new", "gelu"])
def test_input_inside_nan_guarded_buffer(cuda_kernels, label, poison_empty):
    """The input is a window of a NaN-filled buffer (rows strided past the window, for the
    gated ops): a read outside the window would put NaN into the output."""
    case = BY_LABEL[label]
    op = build(case)
    rows, width, pad = 257, (2 * 4231 if case.gated else 4231), 64
    buf = torch.full((rows + 2, width + 2 * pad), float("nan"), device="cuda", dtype=torch.bfloat16)
    x = buf[1:-1, pad:pad + width] if case.gated else buf[1:-1, pad:pad + width].contiguous()
    x.copy_(torch.randn(rows, width, device="cuda") * case.scale)
    if not case.gated:  # elementwise ops take contiguous input: guard a flat window instead
        flat = torch.full((rows * width + 2 * pad,), float("nan"), device="cuda", dtype=torch.bfloat16)
        flat[pad:-pad].copy_(x.flatten())
        x = flat[pad:-pad].view(rows, width)
    out = _launch(cuda_kernels, case, op, x)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    assert_close_on_device(out, _reference(case, x, op).to(torch.bfloat16), label)


def _bf16_ulp(ref: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |ref| (8 significant bits), floored at the smallest normal."""
    mag = ref.abs().clamp(min=torch.finfo(torch.bfloat16).tiny)
    return torch.exp2(torch.floor(torch.log2(mag)) - 7)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("beta,linear_beta", [(4.0, 25.0), (-4.0, None), (-0.5, -3.0), (1e-3, None), (100.0, -0.7)])
def test_situ_bf16_hardware_tanh_within_one_ulp(beta, linear_beta, seed, poison_empty):
    """bf16 situ_and_mul on NVIDIA takes the hardware tanh (tanh.approx.f32, relative error <=
    2**-10.99): against float64, each output within one bf16 ulp of the exact value (rounding
    alone allows half), over gate and up from 1e-30 to 100 of both signs, negative / tiny /
    large betas. Below that, an absolute floor for what fp32 cannot hold on any path: sigmoid(a)
    under FLT_MIN (a < -87; 1 + exp(-a) overflows to inf) and products that pass below FLT_MIN
    before the up half multiplies them lose up to FLT_MIN * |beta| * |up| (e.g. beta -4, a -90,
    b 100: 3.3e-37 becomes 0, Inductor's sigmoid gives 0 as well)."""
    from customop.backends.triton import activation as kernels

    if torch.version.hip is not None:
        pytest.skip("the hardware tanh is NVIDIA's (inline PTX)")
    mag = torch.logspace(-30, 2, 4095, dtype=torch.float64, device="cuda")
    vals = torch.cat([mag, -mag, torch.zeros(2, dtype=torch.float64, device="cuda")])
    shuffled = vals[torch.randperm(vals.numel(), device="cuda", generator=torch.Generator("cuda").manual_seed(seed))]
    x = torch.stack([torch.cat([vals, shuffled]), torch.cat([shuffled, vals])]).to(torch.bfloat16)
    assert kernels._fast_tanh(x)
    out = kernels.situ_and_mul(x, beta, linear_beta)
    torch.cuda.synchronize()
    ref = reference(BY_LABEL["situ_and_mul"], x.double(), _situ(beta, linear_beta))
    up = abs(linear_beta) if linear_beta is not None else x[:, vals.numel():].double().abs().max().item()
    floor = torch.finfo(torch.float32).tiny * max(abs(beta), 1.0) * max(up, 1.0)
    err = ((out.double() - ref).abs() - floor).clamp(min=0) / _bf16_ulp(ref)
    assert not out.isnan().any()
    assert err.max().item() <= 1.0, f"max error {err.max().item():.3f} bf16 ulp"


def _situ(beta, linear_beta):
    from customop.ops.activation import SituAndMul

    return SituAndMul(beta, linear_beta)
