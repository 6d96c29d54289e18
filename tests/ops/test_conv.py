"""Conv family (``conv2d``, ``conv3d``): every case of the table (``customop/samples/conv.py``) on
forward_native and forward_cpu against the float64 references (``tests/cases/conv.py``),
forward_kernel's wiring (the library ops' reference on CPU tensors), the linear form against
``F.conv*`` in float64, loading a regular conv checkpoint, the constructor's rules, bad inputs on
every path, opcheck, torch.compile(fullgraph=True) and the conformance suite.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F

from customop.config import Config, use_config
from customop.ops import linear as linear_module
from customop.ops.conv import Conv2dLayer, Conv3dLayer, _unfold_runs, patch_gemm_cpu, patch_linear, patch_rows
from customop.samples.conv import BY_LABEL, CASES, DTYPES
from customop.testing import assert_close, assert_conforms, assert_same_error, forced_platform, randn
from tests.cases.conv import reference

PARAMS = [pytest.param(c, s, id=f"{c.label}-{'x'.join(map(str, s))}") for c in CASES for s in c.shapes["small"]]
GEN = lambda seed=0: torch.Generator().manual_seed(seed)  # noqa: E731


def build(case, dtype, custom_ops=("all",)):
    with use_config(Config(custom_ops=list(custom_ops))):
        return case.build(dtype, generator=GEN())


def check_path(case, shape, path, dtype):
    op = build(case, dtype)
    x = case.input(shape, dtype, generator=GEN(1))
    before = x.clone()
    got = getattr(op, path)(x)
    assert got.dtype == dtype
    assert_close(got, reference(op, x), dtype, what=f"{case.label} {path}")
    assert torch.equal(x, before), "the input was written"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", ["forward_native", "forward_cpu"])
@pytest.mark.parametrize("case,shape", PARAMS)
def test_matches_float64_reference(case, shape, path, dtype):
    check_path(case, shape, path, dtype)


@pytest.mark.parametrize("case,shape", PARAMS)
def test_forward_kernel_wiring(case, shape):
    """forward_kernel (what forward_cuda/_xpu/_tpu run) on CPU tensors reaches the library op's
    reference with the right arguments."""
    check_path(case, shape, "forward_kernel", torch.bfloat16)


@pytest.mark.parametrize("label,shape", [("patch14", (2, 3, 31, 45)), ("patch16 no bias", (1, 3, 48, 64)),
                                         ("qwen2-vl (2,14,14)", (5, 3, 2, 14, 14)),
                                         ("qwen2-vl (2,14,14)", (1, 3, 5, 30, 29)),
                                         ("patch (1,16,16) no bias", (2, 3, 3, 33, 48))])
def test_linear_form_equals_the_convolution_in_float64(label, shape):
    """The fast path is exact: in float64 the GEMM over unfolded patches and F.conv* agree to
    rounding, remainders that do not fill a patch included (they are dropped by both)."""
    case = BY_LABEL[label]
    op = case.build(torch.float64, generator=GEN())
    assert op.enable_linear
    x = case.input(shape, torch.float64, generator=GEN(1))
    conv = (F.conv2d if op.num_dim == 2 else F.conv3d)(x, op.weight, op.bias, op.stride)
    assert_close(patch_linear(x, op.weight, op.bias), conv, torch.float64)


def test_enable_linear_follows_the_patch_rule():
    expected = {"patch14": True, "patch16 no bias": True, "qwen2-vl (2,14,14)": True, "patch (1,16,16) no bias": True,
                "k3 same": False, "k4 s2 p1 groups2": False, "k3 p1 reflect": False, "k3 p1": False,
                "k(2,2,2) s(1,2,2)": False,
                "k2 s2 dilation2": False}  # vLLM's rule says True and would compute it wrongly
    assert {c.label: c.build(torch.float32).enable_linear for c in CASES} == expected


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_loads_a_regular_conv_checkpoint(case):
    """nn.Conv2d/nn.Conv3d's state dict loads as is, and the layer then computes what the module does."""
    init = {k: v for k, v in case.init.items()}
    module = (torch.nn.Conv2d if case.op == "conv2d" else torch.nn.Conv3d)(**init)
    op = case.op_class(**init)
    op.load_state_dict(module.state_dict())
    x = case.input(case.shapes["small"][0], torch.float32, generator=GEN(2))
    with torch.no_grad():
        assert_close(op.forward_cpu(x), module(x), torch.float32)


GATHERED = [((3, 3, 31, 42), (14, 14)), ((1, 3, 45, 48), (16, 16)), ((5, 3, 29, 28), (14, 14)),
            ((3, 3, 5, 29, 42), (2, 14, 14)), ((1, 3, 3, 16, 32), (1, 16, 16))]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,kernel", GATHERED, ids=lambda v: "x".join(map(str, v)))
def test_forward_cpu_gathered_unfold(shape, kernel, dtype, threads):
    """forward_cpu's index_select unfold (images cut into patches, odd sizes and batch counts,
    remainders dropped): close to the float64 reference, bitwise the spec's rows, and bitwise
    the spec's linear form on the same GEMM (``patch_gemm_cpu``), on both of its branches (one
    thread: dim 1; more: dim 0 per image), with and without autograd."""
    assert _unfold_runs(shape, kernel) is not None, "the gathered route is not taken"
    seed = sum(shape) + len(kernel) + threads
    with use_config(Config(custom_ops=["all"])):
        op = (Conv2dLayer if len(kernel) == 2 else Conv3dLayer)(3, 37, kernel, stride=kernel, params_dtype=dtype)
    op.weight.data.copy_(torch.randn(op.weight.shape, generator=GEN(seed)) * 0.05)
    op.bias.data.copy_(torch.randn(op.bias.shape, generator=GEN(seed + 1)))
    x = torch.randn(shape, generator=GEN(seed + 2)).to(dtype)
    runs = _unfold_runs(shape, kernel)
    assert torch.equal(x.view(shape[0], -1, kernel[-1]).index_select(1, runs).view(-1, op.input_size),
                       patch_rows(x, kernel))
    before, old = x.clone(), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            got, spec = op.forward_cpu(x), op.forward_native(x)
            same_gemm = patch_linear(x, op.weight, op.bias, linear=patch_gemm_cpu)
        with torch.no_grad():
            assert torch.equal(op.forward_cpu(x), same_gemm)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(x, before), "the input was written"
    assert got.dtype == dtype and got.shape == spec.shape and got.stride() == spec.stride()
    assert torch.equal(got, same_gemm)
    assert_close(got, reference(op, x), dtype, what=f"forward_cpu gathered {shape} {kernel}")
    xg = x.clone().requires_grad_()
    op.forward_cpu(xg).float().square().sum().backward()
    xs = x.clone().requires_grad_()
    patch_linear(xs, op.weight, op.bias, linear=patch_gemm_cpu).float().square().sum().backward()
    assert torch.equal(xg.grad, xs.grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape,kernel", [((1, 3, 14, 14), (14, 14)), ((3, 3, 31, 45), (14, 14)),
                                          ((7, 3, 2, 14, 14), (2, 14, 14))], ids=lambda v: "x".join(map(str, v)))
def test_forward_cpu_runs_half_precision_patches_in_fp32_where_the_table_says(shape, kernel, dtype, monkeypatch):
    """Where ``FP32_GEMM_FROM_ROWS`` sends half-precision GEMMs to fp32 (AVX2 CPUs; set here for
    this dtype from one row, so every CPU runs it): the patch GEMM is the fp32 product of the
    spec's rows rounded once, close to the float64 reference; one patch, a cut image and
    Qwen2-VL's view-unfolded patches (7 of them)."""
    monkeypatch.setattr(linear_module, "FP32_GEMM_FROM_ROWS", {dtype: 1})
    with use_config(Config(custom_ops=["all"])):
        op = (Conv2dLayer if len(kernel) == 2 else Conv3dLayer)(3, 33, kernel, stride=kernel, params_dtype=dtype)
    op.weight.data.copy_(torch.randn(op.weight.shape, generator=GEN(3)) * 0.05)
    op.bias.data.copy_(torch.randn(op.bias.shape, generator=GEN(4)))
    x = torch.randn(shape, generator=GEN(5)).to(dtype)
    with torch.inference_mode():
        got = op.forward_cpu(x)
        rows = patch_rows(x, kernel).float()
        fp32 = F.linear(rows, op.weight.float().reshape(op.out_channels, -1), op.bias.float()).to(dtype)
    want = fp32.view(shape[0], *(s // k for s, k in zip(shape[2:], kernel)), -1).movedim(-1, 1)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got, want)
    assert_close(got, reference(op, x), dtype, what=f"forward_cpu fp32 GEMM {shape} {kernel}")


@pytest.mark.parametrize("shape,kernel", [((5, 3, 2, 14, 14), (2, 14, 14)), ((7, 1, 15, 14), (14, 14)),
                                          ((2, 3, 31, 45), (14, 14))], ids=lambda v: "x".join(map(str, v)))
def test_forward_cpu_keeps_the_spec_where_the_unfold_is_a_view_or_runs_do_not_tile(shape, kernel):
    """Qwen2-VL's patches (and a one-channel cropped image) unfold as a view: nothing to gather;
    a width that is not a multiple of the kernel leaves runs straddling patches: the spec copies."""
    with torch.inference_mode():
        assert _unfold_runs(shape, kernel) is None
    assert _unfold_runs(shape, kernel) is None


# ---- constructor -----------------------------------------------------------------------------------


def test_constructor_matches_vllm():
    op = Conv3dLayer(3, 1280, (2, 14, 14), stride=(2, 14, 14), bias=False, params_dtype=torch.bfloat16)
    assert (op.kernel_size, op.stride, op.padding, op.dilation, op.groups) == ((2, 14, 14), (2, 14, 14), (0, 0, 0), (1, 1, 1), 1)
    assert op.enable_linear and op.input_size == 3 * 2 * 14 * 14 and op.bias is None
    assert op.weight.shape == (1280, 3, 2, 14, 14) and op.weight.dtype == torch.bfloat16
    assert Conv2dLayer(3, 8, 4, padding="same").padding == (2, 2)  # k // 2, as vLLM (torch's "same" is asymmetric)
    assert Conv2dLayer(3, 8, (3, 5), padding="valid").padding == (0, 0)
    assert Conv2dLayer(3, 8, 3).weight.dtype == torch.get_default_dtype()
    assert (Conv2dLayer.name, Conv3dLayer.name) == ("conv2d", "conv3d")


@pytest.mark.parametrize("kwargs,match", [
    ({"padding": "full"}, "padding must be an int, 2 ints, 'same' or 'valid'"),
    ({"groups": 2}, "groups=2 must divide in_channels=3"),
    ({"padding_mode": "mirror"}, "padding_mode must be one of"),
    ({"kernel_size": (3, 3, 3)}, "kernel_size must be an int or 2 ints"),
    ({"stride": 0}, "kernel_size, stride and dilation must be positive"),
    ({"out_channels": 0}, "out_channels must be a positive int"),
])
def test_bad_constructor_arguments(kwargs, match):
    args = {"in_channels": 3, "out_channels": 8, "kernel_size": 3, **kwargs}
    with pytest.raises(ValueError, match=f"customop.conv2d: {match}"):
        Conv2dLayer(**args)


# ---- bad inputs ---------------------------------------------------------------------------------------


def _bad_inputs():
    yield "rank", ValueError, r"x has shape \(3, 28, 28\), expected \[batch, 3, \.\.\., \.\.\.\]", randn(3, 28, 28)
    yield "channels", ValueError, r"x has shape \(1, 4, 28, 28\)", randn(1, 4, 28, 28)
    yield "dtype", TypeError, "x has dtype torch.bfloat16, expected the weight's torch.float32", randn(1, 3, 28, 28, dtype=torch.bfloat16)
    yield "int", TypeError, "x has dtype torch.int64", torch.ones(1, 3, 28, 28, dtype=torch.long)
    yield "device", ValueError, "x is on meta", torch.ones(1, 3, 28, 28, device="meta")
    yield "too small", ValueError, r"x's spatial size \(13, 28\) \(padded by \(0, 0\)\) is smaller than the kernel's span \(14, 14\)", randn(1, 3, 13, 28)
    yield "not a tensor", TypeError, "x must be a torch.Tensor", [[1.0]]


BAD = list(_bad_inputs())


@pytest.mark.parametrize("what,error,match,x", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_raise_the_same_clear_error_on_every_path(what, error, match, x):
    op = BY_LABEL["patch14"].build(torch.float32, generator=GEN())
    assert assert_same_error(op, (x,), error, f"customop.conv2d: {match}") == \
        ["forward_native", "forward_cpu", "forward_kernel"]


# ---- torch.library: schemas, opcheck, compile -------------------------------------------------------


def test_schemas_are_the_backend_contract():
    for name in ("conv2d", "conv3d"):
        assert str(getattr(torch.ops.customop, name).default._schema) == (
            f"customop::{name}(Tensor x, Tensor weight, Tensor? bias, int[] stride, int[] padding, int[] dilation, "
            "int groups, str padding_mode) -> Tensor")


@pytest.mark.parametrize("label", ["patch14", "patch16 no bias", "qwen2-vl (2,14,14)", "k4 s2 p1 groups2",
                                   "k3 p1 reflect", "k2 s2 dilation2", "k3 p1"])
def test_opcheck(label):
    """Real and fake outputs agree in shape and strides: a permuted view for the linear form, a
    contiguous tensor for the convolution."""
    case = BY_LABEL[label]
    op = case.build(torch.float32, generator=GEN())
    x = case.input(case.shapes["check"][0], torch.float32, generator=GEN(1))
    args = (x, op.weight.detach(), None if op.bias is None else op.bias.detach(), list(op.stride),
            list(op.padding), list(op.dilation), op.groups, op.padding_mode)
    torch.library.opcheck(getattr(torch.ops.customop, case.op).default, args)


@pytest.mark.parametrize("label", ["patch14", "qwen2-vl (2,14,14)", "k4 s2 p1 groups2"])
@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_compiles_fullgraph_without_graph_break(platform, label):
    case = BY_LABEL[label]
    counter = torch._dynamo.testing.CompileCounter()
    with forced_platform(platform), use_config(Config(custom_ops=[f"+{case.op}"])):
        op = case.build(torch.float32, generator=GEN())
    assert op.forward_method_name == f"forward_{platform}"
    x = case.input(case.shapes["check"][0], torch.float32, generator=GEN(1))
    with torch._dynamo.config.patch(recompile_limit=64):
        got = torch.compile(lambda x: op(x) * 2, backend=counter, fullgraph=True)(x)
    assert_close(got, reference(op, x) * 2, torch.float32)
    assert counter.frame_count == 1 and counter.op_count > 0


def test_library_op_under_inductor():
    case = BY_LABEL["qwen2-vl (2,14,14)"]
    op = case.build(torch.float32, generator=GEN())
    x = case.input((37, 3, 2, 14, 14), torch.float32, generator=GEN(1))
    got = torch.compile(lambda x: op.forward_kernel(x) + 1, fullgraph=True)(x)
    assert_close(got, reference(op, x) + 1, torch.float32)


def test_autograd_records_through_the_spec():
    """The library ops have no backward: while autograd records, forward_kernel runs the spec."""
    case = BY_LABEL["patch14"]
    op = case.op_class(**case.init_kwargs(torch.float32))
    op.load_state_dict(case.weights(torch.float32, generator=GEN()))
    x = case.input((1, 3, 28, 28), torch.float32, generator=GEN(1)).requires_grad_()
    op.forward_kernel(x).square().sum().backward()
    assert x.grad is not None and op.weight.grad is not None and op.weight.grad.abs().sum() > 0


# ---- conformance ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [Conv2dLayer, Conv3dLayer], ids=lambda c: c.name)
def test_conforms(cls):
    assert_conforms(cls)


@pytest.mark.parametrize("path", ["forward_native", "forward_cpu", "forward_kernel"])
@pytest.mark.parametrize("layer,shape", [(Conv2dLayer, (0, 3, 28, 42)), (Conv3dLayer, (0, 3, 2, 28, 28))],
                         ids=["2d", "3d"])
def test_a_batch_of_no_images(layer, shape, path):
    """No images in: an empty output of F.conv*'s shape on every path (the linear form once failed
    to infer its channel count from zero elements)."""
    kernel = (14, 14) if layer is Conv2dLayer else (2, 14, 14)
    with use_config(Config(custom_ops=["all"])):
        op = layer(3, 8, kernel_size=kernel, stride=kernel)
    x = torch.randn(shape)
    conv = F.conv2d if layer is Conv2dLayer else F.conv3d
    want = conv(x, op.weight, op.bias, stride=kernel)
    got = getattr(op, path)(x)
    assert got.shape == want.shape and got.dtype == want.dtype
