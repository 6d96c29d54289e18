"""QuantFP8 (``quant_fp8``): every mode of the table (``customop/samples/quant.py``) on forward_native
and forward_cpu against the float64 references (``tests/cases/quant.py``): scales exactly, ``q``
bit for bit (recomputed from the op's own scale with float64 arithmetic that rounds exactly like
the float32 spec, so any deviation from the rounding order shows up as flipped bits); the
``customop::`` fp8 entry points, the kernel wiring, and ``rms_norm_quant_fp8`` (which rounds an
intermediate to the input dtype, so it is compared dequantized).
"""

from __future__ import annotations

import math

import pytest
import torch

from customop import Config, use_config
from customop.ops.quantization import GroupShape, QuantFP8, fp8_max, fp8_min_scale, rms_norm_quant_fp8
from customop.math import quant as qm
from customop.samples.quant import BY_LABEL, CASES, DTYPES, FP8_DTYPES, NORM_QUANT, dequantize
from customop.testing import assert_close, assert_conforms, forced_platform, randn
from tests.cases.quant import Fp8Cpu, Fp8Cuda, assert_same_bits, build, check_against_reference, forward_kernel

SCALE_RTOL = 1e-6


def make_op(label: str, fp8: torch.dtype, platform=None, custom_ops=("all",)) -> QuantFP8:
    with use_config(Config(custom_ops=list(custom_ops))):
        return build(BY_LABEL[label], fp8, platform)


def call_args(label: str, x: torch.Tensor, fp8: torch.dtype) -> dict:
    return BY_LABEL[label].call_kwargs(x, fp8_max(fp8))


def check(label, x, out, fp8, kwargs):
    check_against_reference(BY_LABEL[label], x, out, fp8, kwargs)


# ---- the table: every mode x fp8 dtype x input dtype x size --------------------------------------


@pytest.fixture
def eager_cpu(monkeypatch):
    """forward_cpu's eager branch at any size: compiling every case would take minutes; the
    compiled branch has its own tests below."""
    monkeypatch.setattr(QuantFP8, "cpu_tiers", QuantFP8.cpu_tiers.compiling_from(math.inf))


def _params():
    # 3-D inputs in one input dtype only: the rank changes no arithmetic, and this keeps the file fast.
    for case in CASES:
        for dtype in DTYPES:
            for shape in case.shapes("small"):
                if len(shape) == 2 or dtype == torch.bfloat16:
                    yield pytest.param(case, dtype, shape, id=f"{case.label}-{dtype}-{'x'.join(map(str, shape))}")


@pytest.mark.parametrize("case, dtype, shape", list(_params()))
@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=str)
def test_native_and_cpu_match_reference(case, dtype, shape, fp8, eager_cpu):
    x = case.input(shape, dtype, generator=torch.Generator().manual_seed(CASES.index(case)))
    with use_config(Config(custom_ops=["all"])):
        op = build(case, fp8)
    kwargs = case.call_kwargs(x, fp8_max(fp8))
    check_against_reference(case, x, op.forward_native(x, **kwargs), fp8, kwargs)
    check_against_reference(case, x, op(x, **kwargs), fp8, kwargs)


@pytest.mark.parametrize("case", [c for c in CASES if c.kernel], ids=lambda c: c.label)
@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=str)
def test_forward_kernel_wiring(case, fp8):
    """forward_kernel (what forward_cuda/_xpu/_tpu run) on CPU tensors reaches its entry point's
    reference body: the arguments it builds and its reshapes (leading dims, padding, TMA-aligned
    scales) give the reference's result."""
    for shape in case.shapes("small"):
        x = case.input(shape, torch.bfloat16, generator=torch.Generator().manual_seed(2))
        op = build(case, fp8)
        kwargs = case.call_kwargs(x, fp8_max(fp8))
        check_against_reference(case, x, forward_kernel(op, x, kwargs), fp8, kwargs)


@pytest.mark.parametrize("label", ["per-group 128", "per-group 128 ue8m0 column-major tma", "static per-group 128"])
def test_group_hidden_not_a_multiple_of_the_group_is_zero_padded(label):
    x = BY_LABEL[label].input((7, 4231), torch.bfloat16, generator=torch.Generator().manual_seed(1))
    op = make_op(label, torch.float8_e4m3fn)
    kwargs = call_args(label, x, torch.float8_e4m3fn)
    out = op.forward_native(x, **kwargs)
    assert out[1].shape == (7, 34)
    check(label, x, out, torch.float8_e4m3fn, kwargs)


# ---- exact constants and special values ---------------------------------------------------------


def test_constants():
    assert fp8_max(torch.float8_e4m3fn) == 448.0
    assert fp8_max(torch.float8_e4m3fnuz) == 224.0  # deliberately not finfo's 240
    assert fp8_min_scale(torch.float8_e4m3fn) == 1.0 / (448.0 * 512.0)
    assert fp8_min_scale(torch.float8_e4m3fnuz) == 1.0 / (224.0 * 512.0)
    assert GroupShape.PER_TENSOR == (-1, -1) and GroupShape.PER_TOKEN == (1, -1)
    assert GroupShape.PER_CHANNEL == (-1, 1) and GroupShape(1, 128).is_per_group()
    assert not GroupShape.PER_TOKEN.is_per_group() and GroupShape.PER_CHANNEL.is_per_channel()


@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=str)
def test_saturation_zero_rows_and_ue8m0_powers_of_two(fp8):
    fmax = fp8_max(fp8)
    x = torch.tensor([[1000.0, -1000.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]])
    q, _ = make_op("static per-tensor", fp8)(x, scale=torch.ones(1))
    assert q[0, :2].float().tolist() == [fmax, -fmax]  # clamped at 448 / 224, never 240
    q, scale = make_op("dynamic per-token", fp8)(x)
    assert scale[1].item() == torch.tensor(1.0 / (fmax * 512.0)).float().item() and not q[1].float().any()
    x = torch.cat([randn(3, 128, scale=5.0), torch.zeros(1, 128)]).reshape(2, 256)
    _, scale = make_op("per-group 128 ue8m0", fp8)(x)
    mantissa, _ = torch.frexp(scale)
    assert (mantissa == 0.5).all(), scale  # every scale, the all-zero group's too, is a power of two


# ---- vLLM 0.33's shapes: static scales as returned, empty inputs ------------------------------------


def _paths(op):
    """forward_native, forward_cpu (eager tier: these inputs are small) and forward_kernel (the
    entry points' reference bodies on CPU tensors); positional, as forward_kernel takes them."""
    return {"forward_native": op.forward_native, "forward_cpu": op.forward_cpu, "forward_kernel": op.forward_kernel}


@pytest.mark.parametrize("label, x_shape, scale_shape, want", [
    ("static per-channel", (5, 24), (24,), (1, 24)),  # vLLM 0.33: [H] comes back [1, H]
    ("static per-channel", (2, 3, 24), (24,), (1, 24)),
    ("static per-channel", (5, 24), (1, 24), (1, 24)),
    ("static per-channel", (5, 1), (1,), (1, 1)),  # one element, not per tensor: (1, 1)
    ("static per-token", (1, 24), (1, 1), (1, 1)),
    ("static per-token", (3, 24), (3, 1), (3, 1)),
    ("static per-tensor", (5, 24), (1,), (1,)),  # per tensor: as given
    ("static per-tensor", (5, 24), (), ()),
])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_static_scale_is_returned_in_vllm_033_shape(label, x_shape, scale_shape, want, dtype):
    x = randn(*x_shape, dtype=dtype, scale=3.0)
    scale = torch.rand(scale_shape, generator=torch.Generator().manual_seed(1)) * 0.05 + 0.01
    op = make_op(label, torch.float8_e4m3fn)
    q_ref = (x.double() / scale.double().reshape(scale_shape if scale.dim() else ())).clamp(-448, 448)
    for path, run in _paths(op).items():
        q, got = run(x, scale, None)
        assert got.shape == want, (path, got.shape)
        assert got.data_ptr() == scale.data_ptr() and torch.equal(got.reshape(-1), scale.reshape(-1)), path
        assert q.shape == x.shape and q.dtype == torch.float8_e4m3fn, path
        # q is the quantization of x by the given scale: one e4m3 rounding (2^-4 relative)
        assert_close(q.double(), q_ref, torch.float64, atol=2**-9, rtol=2**-4, what=f"{path} q")


@pytest.mark.parametrize("shape", [(0, 8), (0,), (2, 0, 8), (3, 0)], ids=str)
@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=str)
@pytest.mark.parametrize("padding", [None, 12])
def test_dynamic_per_tensor_with_no_element(shape, fp8, padding):
    """Empty outputs and the scale of an all-zero tensor (MIN_SCALE, shape [1]) on every path,
    as the Triton kernel returns (its interpreter run is in the test below)."""
    op = make_op("dynamic per-tensor", fp8)
    op.num_token_padding = op._math["num_token_padding"] = padding
    x = torch.empty(shape, dtype=torch.bfloat16)
    want_q = (max(padding, shape[0]),) + shape[1:] if padding else shape
    for path, run in _paths(op).items():
        q, scale = run(x, None, None)
        assert q.shape == want_q and q.dtype == fp8 and not q.float().any(), (path, q.shape)
        assert scale.shape == (1,) and scale.dtype == torch.float32, (path, scale.shape)
        assert scale.item() == torch.tensor(fp8_min_scale(fp8), dtype=torch.float32).item(), path


@pytest.mark.interpret
@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 8)], ids=str)
def test_dynamic_per_tensor_with_no_element_on_the_triton_kernel(shape):
    from customop.backends.triton import quant as triton_quant
    from tests.backends.triton.conftest import as_cpu_kernel

    op = make_op("dynamic per-tensor", torch.float8_e4m3fn)
    x = torch.empty(shape, dtype=torch.float16)
    want_q, want_scale = op.forward_native(x)
    with as_cpu_kernel("customop::dynamic_scaled_fp8_quant", triton_quant.dynamic_scaled_fp8_quant) as calls:
        q, scale = op.forward_kernel(x, None, None)
    assert calls and q.shape == want_q.shape and q.dtype == want_q.dtype
    assert scale.shape == want_scale.shape and torch.equal(scale, want_scale)


# ---- the kernel wiring (forward_cuda on CPU tensors runs the entry points' reference bodies) -------


@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=str)
def test_conforms_through_samples(fp8, eager_cpu):
    assert_conforms(QuantFP8, platform=Fp8Cpu(fp8), dtypes=[torch.bfloat16])
    assert_conforms(QuantFP8, platform=Fp8Cuda(fp8))


@pytest.mark.parametrize("mode", list(BY_LABEL))
def test_forward_cuda_matches_native_bit_for_bit(mode):
    x = BY_LABEL[mode].input((3, 5, 4096), torch.bfloat16, generator=torch.Generator().manual_seed(2))
    op = make_op(mode, torch.float8_e4m3fnuz, platform=Fp8Cuda(torch.float8_e4m3fnuz))
    assert op.forward_method_name == "forward_cuda"
    kwargs = call_args(mode, x, torch.float8_e4m3fnuz)
    q, scale = op(x, **kwargs)
    q_ref, scale_ref = op.forward_native(x, **kwargs)
    assert_same_bits(q, q_ref)
    assert torch.equal(scale, scale_ref)


@pytest.mark.parametrize("mode, entry", [
    ("static per-tensor", "static_scaled_fp8_quant"), ("dynamic per-tensor", "dynamic_scaled_fp8_quant"),
    ("dynamic per-token scale_ub", "dynamic_per_token_scaled_fp8_quant"), ("per-group 64", "per_token_group_fp8_quant"),
])
def test_forward_cuda_calls_its_entry_point(mode, entry, monkeypatch):
    calls = []
    real = getattr(torch.ops.customop, entry)
    monkeypatch.setattr(torch.ops.customop, entry, lambda *a: calls.append(a) or real(*a))
    x = randn(4, 256, dtype=torch.float16)
    make_op(mode, torch.float8_e4m3fn, platform=Fp8Cuda())(x, **call_args(mode, x, torch.float8_e4m3fn))
    assert len(calls) == 1 and calls[0][0].shape == (4, 256)


def test_static_per_channel_on_cuda_runs_native(monkeypatch):
    monkeypatch.setattr(torch.ops.customop, "static_scaled_fp8_quant", None)  # must not be reached
    x = randn(4, 256)
    op = make_op("static per-channel", torch.float8_e4m3fn, platform=Fp8Cuda())
    q, _ = op(x, **call_args("static per-channel", x, torch.float8_e4m3fn))
    assert q.shape == (4, 256)


# ---- rms_norm + per-token quant -----------------------------------------------------------------


UB = 1.5  # caps most rows: the normalised values reach ~4


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", NORM_QUANT, ids=lambda c: c.label)
def test_rms_norm_quant_fp8(case, dtype, platform, eager_cpu):
    gen = torch.Generator().manual_seed(3)
    x = randn(7, 4224, dtype=dtype, generator=gen)
    weight = case.weight_for(4224, dtype, generator=gen)
    ub = torch.tensor([UB]) if case.scale_ub else None
    cap = UB if case.scale_ub else math.inf
    with forced_platform(Fp8Cuda() if platform == "cuda" else Fp8Cpu(torch.float8_e4m3fn)):
        q, scale = rms_norm_quant_fp8(x, weight, 1e-6, scale_ub=ub)
    x64 = x.double()
    y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * (weight.double() if weight is not None else 1.0)
    want_scale = (y.abs().amax(-1, keepdim=True).clamp(max=cap) / 448.0).clamp(min=1 / (448 * 512))
    in_dtype_eps = torch.finfo(dtype).eps
    assert_close(scale, want_scale, torch.float64, atol=0.0, rtol=2 * in_dtype_eps + SCALE_RTOL, what="scale")
    # one fp8 rounding (2^-4 relative), the input-dtype rounding of the normalised value, and the cap
    assert_close(dequantize(q, scale), y.clamp(-cap, cap), torch.float64, atol=float(scale.max()) * 2**-9,
                 rtol=2**-4 + 4 * in_dtype_eps, what="dequantized q")


# ---- bad inputs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(static=False, group_shape=GroupShape.PER_CHANNEL), "group_shape"),
    (dict(static=False, group_shape=(128, 128)), "group_shape"),
    (dict(static=False, group_shape=GroupShape.PER_TOKEN, column_major_scales=True), "column_major_scales"),
    (dict(static=True, group_shape=GroupShape(1, 128), use_ue8m0=True), "use_ue8m0"),
    (dict(static=False, group_shape=GroupShape(1, 128), tma_aligned_scales=True), "tma_aligned_scales"),
    (dict(static=False, group_shape=GroupShape.PER_TOKEN, num_token_padding=-1), "num_token_padding"),
    (dict(static=False, group_shape=(0, 4)), "row"),
])
def test_bad_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantFP8(**kwargs)


@pytest.mark.parametrize("mode, x, kwargs, err, match", [
    ("dynamic per-token", torch.ones(2, 8, dtype=torch.int32), {}, TypeError, "QuantFP8: x"),
    ("dynamic per-token", torch.ones(2, 8).to(torch.float8_e4m3fn), {}, TypeError, "QuantFP8: x"),
    ("static per-tensor", torch.ones(2, 8), {}, ValueError, "QuantFP8: scale"),
    ("dynamic per-token", torch.ones(2, 8), {"scale": torch.ones(1)}, ValueError, "QuantFP8: scale"),
    ("dynamic per-tensor", torch.ones(2, 8), {"scale_ub": torch.ones(1)}, ValueError, "QuantFP8: scale_ub"),
    ("dynamic per-token", torch.ones(2, 8), {"scale_ub": torch.ones(2)}, ValueError, "QuantFP8: scale_ub"),
    ("static per-token", torch.ones(2, 8), {"scale": torch.ones(3, 1)}, ValueError, "QuantFP8: static"),
    ("static per-channel", torch.ones(2, 8), {"scale": torch.ones(7)}, ValueError, "QuantFP8: static"),
    ("per-group 128 column-major", torch.ones(256), {}, ValueError, "column_major_scales"),
])
def test_bad_calls(mode, x, kwargs, err, match):
    op = make_op(mode, torch.float8_e4m3fn)
    with pytest.raises(err, match=match):
        op(x, **kwargs)


def test_bad_calls_on_the_kernel_path():
    op = make_op("per-group 128", torch.float8_e4m3fn, platform=Fp8Cuda())
    with pytest.raises(ValueError, match="QuantFP8: .*multiple of the group size 128"):
        op(torch.ones(2, 200))
    op = make_op("static per-tensor", torch.float8_e4m3fn, platform=Fp8Cuda())
    with pytest.raises(TypeError, match="QuantFP8: scale must be float32"):
        op(torch.ones(2, 8), scale=torch.ones(1, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="QuantFP8: the kernels take x"):
        op(torch.ones(2, 8, dtype=torch.float64), scale=torch.ones(1))
    with pytest.raises(ValueError, match="per_token_group_fp8_quant.*group_size=128"):
        torch.ops.customop.per_token_group_fp8_quant(torch.ones(2, 200), 128, False, False, torch.float8_e4m3fn,
                                                     448.0, 1e-5)
    with pytest.raises(ValueError, match="rms_norm_quant_fp8: weight"):
        rms_norm_quant_fp8(torch.ones(2, 8), torch.ones(7), 1e-6)


# ---- torch.library: opcheck and torch.compile ------------------------------------------------------

FN, MAX, MIN_SCALE = torch.float8_e4m3fn, 448.0, fp8_min_scale(torch.float8_e4m3fn)
OPCHECK_CASES = [
    ("static_scaled_fp8_quant", lambda x: (x, torch.tensor([0.01]), FN, MAX)),
    ("dynamic_scaled_fp8_quant", lambda x: (x, FN, MAX, MIN_SCALE)),
    ("dynamic_per_token_scaled_fp8_quant", lambda x: (x, None, FN, MAX, MIN_SCALE)),
    ("dynamic_per_token_scaled_fp8_quant", lambda x: (x, torch.tensor([1.5]), torch.float8_e4m3fnuz, 224.0,
                                                      fp8_min_scale(torch.float8_e4m3fnuz))),
    ("per_token_group_fp8_quant", lambda x: (x, 64, False, False, FN, MAX, MIN_SCALE)),
    ("per_token_group_fp8_quant", lambda x: (x, 128, True, True, FN, MAX, MIN_SCALE)),
    ("rms_norm_dynamic_per_token_fp8_quant", lambda x: (x, torch.ones(256, dtype=x.dtype), 1e-6, None, FN, MAX,
                                                        MIN_SCALE)),
    ("rms_norm_dynamic_per_token_fp8_quant", lambda x: (x, None, 1e-5, torch.tensor([2.0]), FN, MAX, MIN_SCALE)),
]


@pytest.mark.parametrize("name, make_args", OPCHECK_CASES, ids=[c[0] for c in OPCHECK_CASES])
def test_opcheck(name, make_args):
    x = randn(5, 256, dtype=torch.bfloat16, scale=3.0)
    torch.library.opcheck(getattr(torch.ops.customop, name).default, make_args(x))


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.slow
def test_kernel_path_compiles_fullgraph(fresh_dynamo):
    """Every entry point through forward_cuda (and the fused function) in one fullgraph compile."""
    platform = Fp8Cuda()
    ops = {m: make_op(m, FN, platform=platform) for m in
           ("static per-tensor", "dynamic per-tensor padded 12", "dynamic per-token scale_ub", "per-group 128 ue8m0 column-major tma")}
    x = randn(6, 512, dtype=torch.bfloat16, scale=3.0)
    extra = {m: call_args(m, x, FN) for m in ops}

    def run(x):
        return [ops[m](x, **extra[m]) for m in ops] + [rms_norm_quant_fp8(x, None, 1e-6)]

    # aot_eager: graph breaks and fake-tensor tracing are Dynamo's and AOTAutograd's business;
    # Inductor's code for the pieces around the opaque ops is covered by the forward_cpu tests.
    with forced_platform(platform):
        eager, compiled = run(x), torch.compile(run, fullgraph=True, backend="aot_eager")(x)
    for (q, s), (q_ref, s_ref) in zip(compiled, eager):
        assert_same_bits(q, q_ref)
        assert torch.equal(s, s_ref) and s.stride() == s_ref.stride()


COMPILED_CASES = [("dynamic per-token scale_ub", torch.bfloat16, FN), ("per-group 128 ue8m0 column-major tma", torch.float16,
                  torch.float8_e4m3fnuz), ("static per-tensor", torch.float32, FN), ("dynamic per-tensor padded 12",
                  torch.bfloat16, torch.float8_e4m3fnuz)]


@pytest.mark.slow
@pytest.mark.parametrize("mode, dtype, fp8", COMPILED_CASES, ids=[c[0] for c in COMPILED_CASES])
def test_forward_cpu_compiled_branch_matches_reference(mode, dtype, fp8, monkeypatch):
    """forward_cpu's Inductor code rounds exactly like the spec (no reciprocal for division, no FMA)."""
    monkeypatch.setattr(QuantFP8, "cpu_tiers", QuantFP8.cpu_tiers.compiling_from(0))
    x = randn(7, 4224, dtype=dtype, scale=3.0, generator=torch.Generator().manual_seed(4))
    op = make_op(mode, fp8)
    kwargs = call_args(mode, x, fp8)
    check(mode, x, op(x, **kwargs), fp8, kwargs)


@pytest.mark.slow
def test_large_shape_and_compiled_native_when_disabled():
    x = randn(512, 8192, dtype=torch.bfloat16, scale=3.0, generator=torch.Generator().manual_seed(5))
    # Enabled on the CPU: forward_cpu, compiled at this size; the graph compiled for 7x4224 above
    # serves it (token and hidden dims are dynamic), so this costs no compile when run after it.
    op = make_op("dynamic per-token scale_ub", FN)
    kwargs = call_args("dynamic per-token scale_ub", x, FN)
    check("dynamic per-token scale_ub", x, op(x, **kwargs), FN, kwargs)
    op = make_op("per-group 128", FN, custom_ops=("none",))  # compile_native=True: torch.compile(forward_native)
    assert op._forward_method is not op.forward_native
    check("per-group 128", x, op(x), FN, {})
    # the fused RMSNorm + quant on the CPU platform: its composition, compiled at this size
    with forced_platform(Fp8Cpu(FN)):
        q, scale = rms_norm_quant_fp8(x, None, 1e-6)
    y = qm.rms_norm(x, None, 1e-6)  # checked against float64 in test_rms_norm_quant_fp8
    check("dynamic per-token", y, (q, scale), FN, {})
