"""QuantFP8 (``quant_fp8``), the ``customop::`` fp8 entry points and ``rms_norm_quant_fp8`` against
an independent float64 reference (research/op-semantics.md D.4).

Scales are checked against float64 math (rtol 1e-6). ``q`` is checked bit for bit: the reference
recomputes it from the op's own scale with float64 arithmetic that rounds exactly like the float32
spec (a product of two floats is exact in float64, and a float64 quotient rounded to float32 is
the correctly rounded float32 quotient), so any deviation from the rounding order (reciprocal
multiply vs division, where the clamp happens) shows up as flipped bits. The fused RMSNorm path
rounds an intermediate to the input dtype, so it is compared dequantized.
"""

from __future__ import annotations

import math

import pytest
import torch

from customop import Config, use_config
from customop.ops.quantization import GroupShape, QuantFP8, fp8_max, fp8_min_scale, input_quant_fp8, \
    rms_norm_quant_fp8
from customop.math import quant as qm
from customop.platforms import CpuPlatform, CudaPlatform
from customop.samples.quant import dequantize
from customop.testing import assert_close, assert_conforms, forced_platform, randn

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
SHAPES = ((1, 128), (7, 4224), (3, 5, 4096))
SCALE_RTOL = 1e-6


class Fp8Cpu(CpuPlatform):
    """The CPU platform with a chosen fp8 dtype (ROCm's fnuz cannot be forced without a GPU)."""

    def __init__(self, fp8: torch.dtype) -> None:
        self._fp8 = fp8

    def fp8_dtype(self) -> torch.dtype:
        return self._fp8


class Fp8Cuda(CudaPlatform):
    """CUDA counted as runnable: enabled ops take forward_cuda, whose entry points run their
    reference bodies on CPU tensors (the Triton kernels are registered for "cuda" tensors only)."""

    def __init__(self, fp8: torch.dtype = torch.float8_e4m3fn) -> None:
        self._fp8 = fp8

    def fp8_dtype(self) -> torch.dtype:
        return self._fp8

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None


# name -> (constructor kwargs, how the call's extra arguments are built)
MODES = {
    "static-tensor": dict(static=True, group_shape=GroupShape.PER_TENSOR),
    "static-token": dict(static=True, group_shape=GroupShape.PER_TOKEN),
    "static-channel": dict(static=True, group_shape=GroupShape.PER_CHANNEL),
    "static-group128": dict(static=True, group_shape=GroupShape(1, 128)),
    "dynamic-tensor": dict(static=False, group_shape=GroupShape.PER_TENSOR),
    "dynamic-token": dict(static=False, group_shape=GroupShape.PER_TOKEN),
    "dynamic-token-ub": dict(static=False, group_shape=GroupShape.PER_TOKEN),
    "dynamic-token-padded": dict(static=False, group_shape=GroupShape.PER_TOKEN, num_token_padding=12),
    "dynamic-tensor-padded": dict(static=False, group_shape=GroupShape.PER_TENSOR, num_token_padding=12),
    "group64": dict(static=False, group_shape=GroupShape(1, 64)),
    "group128": dict(static=False, group_shape=GroupShape(1, 128)),
    "group128-ue8m0": dict(static=False, group_shape=GroupShape(1, 128), use_ue8m0=True),
    "group128-colmajor": dict(static=False, group_shape=GroupShape(1, 128), column_major_scales=True),
    "group128-ue8m0-colmajor-tma": dict(static=False, group_shape=GroupShape(1, 128), use_ue8m0=True,
                                        column_major_scales=True, tma_aligned_scales=True),
}


def make_op(mode: str, fp8: torch.dtype, platform=None, custom_ops=("all",)) -> QuantFP8:
    with forced_platform(platform or Fp8Cpu(fp8)), use_config(Config(custom_ops=list(custom_ops))):
        return QuantFP8(**MODES[mode])


def call_args(mode: str, x: torch.Tensor, fmax: float) -> dict:
    """The call's scale / scale_ub for ``mode`` (static scales: 1.25x the dynamic ones, so no clamp)."""
    x64 = x.double()
    if mode == "static-tensor":
        return {"scale": (x64.abs().max() / fmax * 1.25).float().reshape(1)}
    if mode == "static-token":
        return {"scale": (x64.abs().amax(-1, keepdim=True) / fmax * 1.25).float()}
    if mode == "static-channel":
        return {"scale": (x64.abs().reshape(-1, x.shape[-1]).amax(0) / fmax * 1.25).float()}
    if mode == "static-group128":
        return {"scale": ref_scale(x, "group", fmax, group_size=128).mul(1.25).float()}
    if mode == "dynamic-token-ub":  # caps about half of the rows
        return {"scale_ub": x64.abs().amax(-1).median().float().reshape(1)}
    return {}


# ---- the independent reference ------------------------------------------------------------------


def ref_scale(x: torch.Tensor, kind: str, fmax: float, group_size: int = 0, scale_ub=None,
              ue8m0: bool = False) -> torch.Tensor:
    """float64 scales: max(amax / MAX, MIN_SCALE), optionally rounded up to a power of two."""
    x64 = x.double().abs()
    if kind == "tensor":
        amax = x64.max().reshape(1)
    elif kind == "token":
        amax = x64.amax(-1, keepdim=True)
        if scale_ub is not None:
            amax = amax.clamp(max=float(scale_ub))
    else:
        groups = math.ceil(x.shape[-1] / group_size)
        padded = torch.zeros(x.shape[:-1] + (groups * group_size,), dtype=torch.float64)
        padded[..., : x.shape[-1]] = x64
        amax = padded.unflatten(-1, (groups, group_size)).amax(-1)
    scale = (amax / fmax).clamp(min=1.0 / (fmax * 512.0))
    if ue8m0:  # the spec rounds the float32 scale up; float64's log2 is exact enough on 24-bit values
        return torch.exp2(torch.ceil(torch.log2(scale.float().double())))
    return scale


def ref_q(x: torch.Tensor, scale: torch.Tensor, fp8: torch.dtype, fmax: float, divide: bool,
          group_size: int | None = None) -> torch.Tensor:
    """fp8 values from the op's float32 scale: float32(x) * float32(1/scale), or float32(x) / scale."""
    s64 = scale.double()
    if not divide:
        s64 = (1.0 / s64).float().double()  # the float32 reciprocal, correctly rounded
    if group_size is not None:
        s64 = s64.repeat_interleave(group_size, dim=-1)[..., : x.shape[-1]]
    value = x.double() / s64 if divide else x.double() * s64
    return value.float().clamp(-fmax, fmax).to(fp8)


def assert_same_bits(q: torch.Tensor, expected: torch.Tensor, what: str = "q") -> None:
    assert q.dtype == expected.dtype and q.shape == expected.shape, (q.dtype, q.shape, expected.dtype, expected.shape)
    bad = q.view(torch.uint8) != expected.view(torch.uint8)
    if bad.any():
        idx = bad.nonzero()[:5].tolist()
        got = [q[tuple(i)].float().item() for i in idx]
        want = [expected[tuple(i)].float().item() for i in idx]
        raise AssertionError(f"{what}: {int(bad.sum())} of {q.numel()} fp8 values differ; "
                             f"at {idx}: got {got}, want {want}")


def check_against_reference(mode: str, x: torch.Tensor, out, fp8: torch.dtype, kwargs: dict) -> None:
    q, scale = out
    fmax = fp8_max(fp8)
    cfg = MODES[mode]
    group = cfg["group_shape"].col if cfg["group_shape"].is_per_group() else None
    if cfg["static"]:
        assert scale is kwargs["scale"]
    else:
        kind = "group" if group else ("token" if cfg["group_shape"].is_per_token() else "tensor")
        want = ref_scale(x, kind, fmax, group or 0, kwargs.get("scale_ub"), cfg.get("use_ue8m0", False))
        assert scale.dtype == torch.float32 and scale.shape == want.shape, (scale.shape, want.shape)
        assert_close(scale, want, torch.float64, atol=0.0, rtol=SCALE_RTOL, what="scale")
    # only dynamic per-group divides; static per-group scales are repeated over their groups
    expected = ref_q(x, scale, fp8, fmax, divide=group is not None and not cfg["static"], group_size=group)
    rows = x.shape[0]
    padding = cfg.get("num_token_padding")
    if padding is not None and padding > rows:
        assert q.shape == (padding,) + tuple(x.shape[1:])
        assert not q[rows:].float().any(), "padding rows must be zero"
        q = q[:rows]
    assert_same_bits(q, expected)
    if cfg.get("column_major_scales"):
        assert scale.stride(-2) == 1, f"column-major scales expected, strides {scale.stride()}"
    if cfg.get("tma_aligned_scales") and x.dim() == 2:
        assert scale.stride(-1) == math.ceil(x.shape[0] / 4) * 4, scale.stride()


# ---- the parametrized base: every mode x dtype x fp8 dtype x shape --------------------------------


@pytest.fixture
def eager_cpu(monkeypatch):
    """forward_cpu's eager branch at any size: compiling every case would take minutes; the
    compiled branch has its own tests below."""
    monkeypatch.setattr(QuantFP8, "cpu_tiers", QuantFP8.cpu_tiers.compiling_from(math.inf))


# 3-D inputs in one input dtype only: the rank changes no arithmetic, and this keeps the file fast.
CASES = [(dtype, shape) for dtype in DTYPES for shape in SHAPES if len(shape) == 2 or dtype == torch.bfloat16]


@pytest.mark.parametrize("dtype, shape", CASES, ids=[f"{d}-{'x'.join(map(str, s))}" for d, s in CASES])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("fp8", FP8, ids=str)
def test_native_and_cpu_match_reference(dtype, shape, fp8, mode, eager_cpu):
    x = randn(*shape, dtype=dtype, scale=3.0, generator=torch.Generator().manual_seed(list(MODES).index(mode)))
    op = make_op(mode, fp8)
    kwargs = call_args(mode, x, fp8_max(fp8))
    check_against_reference(mode, x, op.forward_native(x, **kwargs), fp8, kwargs)
    check_against_reference(mode, x, op(x, **kwargs), fp8, kwargs)


@pytest.mark.parametrize("mode", ["group128", "group128-ue8m0-colmajor-tma", "static-group128"])
def test_group_hidden_not_a_multiple_of_the_group_is_zero_padded(mode):
    x = randn(7, 4231, dtype=torch.bfloat16, scale=3.0, generator=torch.Generator().manual_seed(1))
    op = make_op(mode, torch.float8_e4m3fn)
    kwargs = call_args(mode, x, 448.0)
    out = op.forward_native(x, **kwargs)
    assert out[1].shape == (7, 34)
    check_against_reference(mode, x, out, torch.float8_e4m3fn, kwargs)


# ---- exact constants and special values ---------------------------------------------------------


def test_constants():
    assert fp8_max(torch.float8_e4m3fn) == 448.0
    assert fp8_max(torch.float8_e4m3fnuz) == 224.0  # deliberately not finfo's 240
    assert fp8_min_scale(torch.float8_e4m3fn) == 1.0 / (448.0 * 512.0)
    assert fp8_min_scale(torch.float8_e4m3fnuz) == 1.0 / (224.0 * 512.0)
    assert GroupShape.PER_TENSOR == (-1, -1) and GroupShape.PER_TOKEN == (1, -1)
    assert GroupShape.PER_CHANNEL == (-1, 1) and GroupShape(1, 128).is_per_group()
    assert not GroupShape.PER_TOKEN.is_per_group() and GroupShape.PER_CHANNEL.is_per_channel()


@pytest.mark.parametrize("fp8", FP8, ids=str)
def test_saturation_zero_rows_and_ue8m0_powers_of_two(fp8):
    fmax = fp8_max(fp8)
    x = torch.tensor([[1000.0, -1000.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]])
    q, _ = make_op("static-tensor", fp8)(x, scale=torch.ones(1))
    assert q[0, :2].float().tolist() == [fmax, -fmax]  # clamped at 448 / 224, never 240
    q, scale = make_op("dynamic-token", fp8)(x)
    assert scale[1].item() == torch.tensor(1.0 / (fmax * 512.0)).float().item() and not q[1].float().any()
    x = torch.cat([randn(3, 128, scale=5.0), torch.zeros(1, 128)]).reshape(2, 256)
    _, scale = make_op("group128-ue8m0", fp8)(x)
    mantissa, _ = torch.frexp(scale)
    assert (mantissa == 0.5).all(), scale  # every scale, the all-zero group's too, is a power of two


# ---- the kernel wiring (forward_cuda on CPU tensors runs the entry points' reference bodies) -------


@pytest.mark.parametrize("fp8", FP8, ids=str)
def test_conforms_through_samples(fp8, eager_cpu):
    assert_conforms(QuantFP8, platform=Fp8Cpu(fp8), dtypes=[torch.bfloat16])
    assert_conforms(QuantFP8, platform=Fp8Cuda(fp8))


@pytest.mark.parametrize("mode", list(MODES))
def test_forward_cuda_matches_native_bit_for_bit(mode):
    x = randn(3, 5, 4096, dtype=torch.bfloat16, scale=3.0, generator=torch.Generator().manual_seed(2))
    op = make_op(mode, torch.float8_e4m3fnuz, platform=Fp8Cuda(torch.float8_e4m3fnuz))
    assert op.forward_method_name == "forward_cuda"
    kwargs = call_args(mode, x, 224.0)
    q, scale = op(x, **kwargs)
    q_ref, scale_ref = op.forward_native(x, **kwargs)
    assert_same_bits(q, q_ref)
    assert torch.equal(scale, scale_ref)


@pytest.mark.parametrize("mode, entry", [
    ("static-tensor", "static_scaled_fp8_quant"), ("dynamic-tensor", "dynamic_scaled_fp8_quant"),
    ("dynamic-token-ub", "dynamic_per_token_scaled_fp8_quant"), ("group64", "per_token_group_fp8_quant"),
])
def test_forward_cuda_calls_its_entry_point(mode, entry, monkeypatch):
    calls = []
    real = getattr(torch.ops.customop, entry)
    monkeypatch.setattr(torch.ops.customop, entry, lambda *a: calls.append(a) or real(*a))
    x = randn(4, 256, dtype=torch.float16)
    make_op(mode, torch.float8_e4m3fn, platform=Fp8Cuda())(x, **call_args(mode, x, 448.0))
    assert len(calls) == 1 and calls[0][0].shape == (4, 256)


def test_static_per_channel_on_cuda_runs_native(monkeypatch):
    monkeypatch.setattr(torch.ops.customop, "static_scaled_fp8_quant", None)  # must not be reached
    x = randn(4, 256)
    op = make_op("static-channel", torch.float8_e4m3fn, platform=Fp8Cuda())
    q, _ = op(x, **call_args("static-channel", x, 448.0))
    assert q.shape == (4, 256)


# ---- rms_norm + per-token quant -----------------------------------------------------------------


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype, with_weight", [(torch.float32, True), (torch.bfloat16, True), (torch.float16, False)])
def test_rms_norm_quant_fp8(dtype, with_weight, platform, eager_cpu):
    gen = torch.Generator().manual_seed(3)
    x = randn(7, 4224, dtype=dtype, generator=gen)
    weight = (1 + 0.1 * randn(4224, generator=gen)).to(dtype) if with_weight else None
    ub = torch.tensor([9.0])
    with forced_platform(Fp8Cuda() if platform == "cuda" else Fp8Cpu(torch.float8_e4m3fn)):
        q, scale = rms_norm_quant_fp8(x, weight, 1e-6, scale_ub=ub)
    x64 = x.double()
    y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * (weight.double() if with_weight else 1.0)
    want_scale = (y.abs().amax(-1, keepdim=True).clamp(max=9.0) / 448.0).clamp(min=1 / (448 * 512))
    in_dtype_eps = torch.finfo(dtype).eps
    assert_close(scale, want_scale, torch.float64, atol=0.0, rtol=2 * in_dtype_eps + SCALE_RTOL, what="scale")
    # one fp8 rounding (2^-4 relative), the input-dtype rounding of the normalised value, and the cap
    assert_close(dequantize(q, scale), y.clamp(-9.0, 9.0), torch.float64, atol=float(scale.max()) * 2**-9,
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
    ("dynamic-token", torch.ones(2, 8, dtype=torch.int32), {}, TypeError, "QuantFP8: x"),
    ("dynamic-token", torch.ones(2, 8).to(torch.float8_e4m3fn), {}, TypeError, "QuantFP8: x"),
    ("static-tensor", torch.ones(2, 8), {}, ValueError, "QuantFP8: scale"),
    ("dynamic-token", torch.ones(2, 8), {"scale": torch.ones(1)}, ValueError, "QuantFP8: scale"),
    ("dynamic-tensor", torch.ones(2, 8), {"scale_ub": torch.ones(1)}, ValueError, "QuantFP8: scale_ub"),
    ("dynamic-token", torch.ones(2, 8), {"scale_ub": torch.ones(2)}, ValueError, "QuantFP8: scale_ub"),
    ("static-token", torch.ones(2, 8), {"scale": torch.ones(3, 1)}, ValueError, "QuantFP8: static"),
    ("static-channel", torch.ones(2, 8), {"scale": torch.ones(7)}, ValueError, "QuantFP8: static"),
    ("group128-colmajor", torch.ones(256), {}, ValueError, "column_major_scales"),
])
def test_bad_calls(mode, x, kwargs, err, match):
    op = make_op(mode, torch.float8_e4m3fn)
    with pytest.raises(err, match=match):
        op(x, **kwargs)


def test_bad_calls_on_the_kernel_path():
    op = make_op("group128", torch.float8_e4m3fn, platform=Fp8Cuda())
    with pytest.raises(ValueError, match="QuantFP8: .*multiple of the group size 128"):
        op(torch.ones(2, 200))
    op = make_op("static-tensor", torch.float8_e4m3fn, platform=Fp8Cuda())
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
           ("static-tensor", "dynamic-tensor-padded", "dynamic-token-ub", "group128-ue8m0-colmajor-tma")}
    x = randn(6, 512, dtype=torch.bfloat16, scale=3.0)
    extra = {m: call_args(m, x, MAX) for m in ops}

    def run(x):
        return [ops[m](x, **extra[m]) for m in ops] + [rms_norm_quant_fp8(x, None, 1e-6)]

    # aot_eager: graph breaks and fake-tensor tracing are Dynamo's and AOTAutograd's business;
    # Inductor's code for the pieces around the opaque ops is covered by the forward_cpu tests.
    with forced_platform(platform):
        eager, compiled = run(x), torch.compile(run, fullgraph=True, backend="aot_eager")(x)
    for (q, s), (q_ref, s_ref) in zip(compiled, eager):
        assert_same_bits(q, q_ref)
        assert torch.equal(s, s_ref) and s.stride() == s_ref.stride()


COMPILED_CASES = [("dynamic-token-ub", torch.bfloat16, FN), ("group128-ue8m0-colmajor-tma", torch.float16,
                  torch.float8_e4m3fnuz), ("static-tensor", torch.float32, FN), ("dynamic-tensor-padded",
                  torch.bfloat16, torch.float8_e4m3fnuz)]


@pytest.mark.slow
@pytest.mark.parametrize("mode, dtype, fp8", COMPILED_CASES, ids=[c[0] for c in COMPILED_CASES])
def test_forward_cpu_compiled_branch_matches_reference(mode, dtype, fp8, monkeypatch):
    """forward_cpu's Inductor code rounds exactly like the spec (no reciprocal for division, no FMA)."""
    monkeypatch.setattr(QuantFP8, "cpu_tiers", QuantFP8.cpu_tiers.compiling_from(0))
    x = randn(7, 4224, dtype=dtype, scale=3.0, generator=torch.Generator().manual_seed(4))
    op = make_op(mode, fp8)
    kwargs = call_args(mode, x, fp8_max(fp8))
    check_against_reference(mode, x, op(x, **kwargs), fp8, kwargs)


@pytest.mark.slow
def test_large_shape_and_compiled_native_when_disabled():
    x = randn(512, 8192, dtype=torch.bfloat16, scale=3.0, generator=torch.Generator().manual_seed(5))
    # Enabled on the CPU: forward_cpu, compiled at this size; the graph compiled for 7x4224 above
    # serves it (token and hidden dims are dynamic), so this costs no compile when run after it.
    op = make_op("dynamic-token-ub", FN)
    kwargs = call_args("dynamic-token-ub", x, MAX)
    check_against_reference("dynamic-token-ub", x, op(x, **kwargs), FN, kwargs)
    op = make_op("group128", FN, custom_ops=("none",))  # compile_native=True: torch.compile(forward_native)
    assert op._forward_method is not op.forward_native
    check_against_reference("group128", x, op(x), FN, {})
    # the fused RMSNorm + quant on the CPU platform: its composition, compiled at this size
    with forced_platform(Fp8Cpu(FN)):
        q, scale = rms_norm_quant_fp8(x, None, 1e-6)
    y = qm.rms_norm(x, None, 1e-6)  # checked against float64 in test_rms_norm_quant_fp8
    check_against_reference("dynamic-token", y, (q, scale), FN, {})
