"""fp8 quant Triton kernels under TRITON_INTERPRET=1 (CPU tensors): every mode of the table
(``customop/samples/quant.py``) that has a kernel, through ``forward_kernel`` (the launcher as the
CPU kernel of its ``customop::`` op), against the float64 references (``tests/cases/quant.py``);
then the launchers directly (strided layouts, clamping static scales, 1-D input, the looped rows,
zeros, a partial last group, the fused RMSNorm + quant) and through ``torch.ops.customop``.

How fp8 outputs are compared: the references compute, in float64, the exact fp32 value the kernel
must round (scale = fp32(amax / max) is correctly rounded because double rounding through float64
is innocuous for one fp32 division; likewise 1/scale, x * inv and x / s), then round it to fp8
with a one-line Triton cast kernel. Under the interpreter that cast has the interpreter's own
fp32->fp8 bug (the rounding carry into the exponent is dropped: 7.84 -> 4.0), so the comparison is
bit-exact and still tests the kernel's math; on a GPU the same helper is the hardware cast. Exact
bits against torch's own cast are checked on the H200 (tests/gpu/test_quant_cuda.py). Outputs are
poisoned before each launch (conftest's ``poison_empty``: NaN, which is 0x7f in e4m3fn and 0x80 in
e4m3fnuz, values the clamped kernels never write).
"""

from __future__ import annotations

import functools

import pytest
import torch
import triton
import triton.language as tl

from customop.backends.triton import fused_norm_quant, quant
from customop.backends.triton._tuning import override
from customop.samples.quant import CASES, DTYPES, FP8_DTYPES, KERNEL_CASES, NORM_QUANT
from tests.backends.triton.conftest import as_cpu_kernel
from tests.cases import quant as cases

pytestmark = pytest.mark.interpret

FP8 = [pytest.param(torch.float8_e4m3fn, 448.0, id="e4m3fn"),
       pytest.param(torch.float8_e4m3fnuz, 224.0, id="e4m3fnuz")]
LAUNCHERS = {**quant.KERNELS, **fused_norm_quant.KERNELS}


def min_scale_of(fp8_max: float) -> float:
    return 1.0 / (fp8_max * 512.0)


# ---- helpers ---------------------------------------------------------------------------------


@triton.jit
def _cast_kernel(v_ptr, o_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(o_ptr + offs, tl.load(v_ptr + offs, mask=offs < n).to(o_ptr.dtype.element_ty), mask=offs < n)


def triton_cast(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 -> fp8 the way a Triton kernel rounds (the interpreter's bug included)."""
    v = v.to(torch.float32).contiguous()
    out = torch.empty(v.shape, dtype=dtype, device=v.device)
    block = 65536
    _cast_kernel[(triton.cdiv(max(v.numel(), 1), block),)](v, out, v.numel(), BLOCK=block)
    return out


@functools.cache
def interpreter_handles(dtype: torch.dtype) -> bool:
    """Whether this triton's interpreter can store ``dtype``: 3.6/3.7.1 cannot map e4m3fnuz
    (``fp8e4b8``) and raise; 3.9 can. The GPU compile for fnuz (gfx942) is checked in
    test_aot_rotary_quant.py either way."""
    try:
        triton_cast(torch.ones(1), dtype)
        return True
    except Exception:  # the interpreter's "fail to convert fp8e4b8 to ir type"
        return False


@pytest.fixture(autouse=True)
def _skip_unsupported_fp8(request):
    params = request.node.callspec.params if hasattr(request.node, "callspec") else {}
    dtype = params.get("fp8_dtype")
    if dtype is not None and not interpreter_handles(dtype):
        pytest.skip(f"triton {triton.__version__}'s interpreter has no {dtype}")


def fp32(t64: torch.Tensor) -> torch.Tensor:
    return t64.to(torch.float32)


def ref_scale(amax: torch.Tensor, fp8_max: float, min_scale: float) -> torch.Tensor:
    """``max(fp32(amax / max), fp32(min_scale))``, amax exact (given as float64)."""
    return torch.maximum(fp32(amax / fp8_max), torch.tensor(min_scale, dtype=torch.float32))


def ref_quant_mul(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, fp8_max: float) -> torch.Tensor:
    """``clamp(fp32(x) * fp32(1/scale))`` rounded to fp8 (the reciprocal-multiply modes)."""
    inv = fp32(1.0 / scale.double())
    pre = fp32(x.double() * inv.double()).clamp(-fp8_max, fp8_max)
    return triton_cast(pre, fp8_dtype)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str = "q") -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    bad = got.view(torch.uint8) != want.view(torch.uint8)
    if bad.any():
        idx = bad.nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {int(bad.sum())} of {got.numel()} fp8 values differ; first at {idx}: "
                             f"got {got.float()[bad][:5].tolist()}, want {want.float()[bad][:5].tolist()}")


def sample(shape, dtype, seed=0, layout="contiguous") -> torch.Tensor:
    """Normal values with a few outliers; ``layout="strided"`` gives a column slice of a wider
    tensor (row stride > H)."""
    g = torch.Generator().manual_seed(seed)
    wide = (*shape[:-1], shape[-1] + 24) if layout == "strided" else shape
    x = torch.randn(wide, generator=g) * 3.0
    x.view(-1)[:: 97] *= 40.0
    x = x.to(dtype)
    return x[..., : shape[-1]] if layout == "strided" else x


# ---- the table, through forward_kernel -----------------------------------------------------------

KERNEL_PARAMS = [pytest.param(c, s, id=f"{c.label}-{'x'.join(map(str, s))}")
                 for c in KERNEL_CASES for s in c.shapes("small")]


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case,shape", KERNEL_PARAMS)
def test_kernel_matches_reference(case, shape, dtype, fp8_dtype, poison_empty):
    """Scales exactly and q bit for bit (through the interpreter's own fp8 cast), padding rows,
    the scales' layout."""
    x = case.input(shape, dtype, generator=torch.Generator().manual_seed(CASES.index(case)))
    op = cases.build(case, fp8_dtype)
    kwargs = case.call_kwargs(x, cases.FP8_MAX[fp8_dtype])
    with as_cpu_kernel(case.kernel, LAUNCHERS[f"customop::{case.kernel}"]) as calls:
        out = cases.forward_kernel(op, x, kwargs)
    assert len(calls) == 1, "forward_kernel did not reach the Triton launcher"
    cases.check_against_reference(case, x, out, fp8_dtype, kwargs, cast=triton_cast, ties_either_way=True)


# ---- per token (layouts the op never passes: forward_kernel makes x contiguous) ------------------


def ref_per_token(x, scale_ub, fp8_dtype, fp8_max, min_scale):
    amax = x.double().abs().amax(dim=-1, keepdim=True)
    if scale_ub is not None:
        amax = torch.minimum(amax, scale_ub.double().reshape(()))
    scale = ref_scale(amax, fp8_max, min_scale)
    return ref_quant_mul(x, scale, fp8_dtype, fp8_max), scale


@pytest.mark.parametrize("fp8_dtype,fp8_max", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,layout,use_ub", [
    ((7, 4224), "strided", True),   # a row that is not a power of two, row stride > H
])
def test_per_token(poison_empty, dtype, fp8_dtype, fp8_max, shape, layout, use_ub):
    x = sample(shape, dtype, layout=layout)
    x[..., 0, :] = 0  # an all-zero row gets min_scale
    ub = torch.tensor([20.0]) if use_ub else None
    ms = min_scale_of(fp8_max)
    q, scale = quant.dynamic_per_token_scaled_fp8_quant(x, ub, fp8_dtype, fp8_max, ms)
    want_q, want_scale = ref_per_token(x, ub, fp8_dtype, fp8_max, ms)
    assert scale.shape == (*shape[:-1], 1) and scale.dtype == torch.float32 and q.is_contiguous()
    assert torch.equal(scale, want_scale)
    assert_same_bits(q, want_q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_token_looped_rows(poison_empty, dtype):
    """Rows wider than a register tile: the chunked three-pass path (forced with a small chunk)."""
    x = sample((5, 3000), dtype, seed=3)
    ub = torch.tensor([30.0])
    with override("rows", single_tile=False, block_n=1024, block_m=1):
        q, scale = quant.dynamic_per_token_scaled_fp8_quant(x, ub, torch.float8_e4m3fn, 448.0, min_scale_of(448.0))
    want_q, want_scale = ref_per_token(x, ub, torch.float8_e4m3fn, 448.0, min_scale_of(448.0))
    assert torch.equal(scale, want_scale)
    assert_same_bits(q, want_q)


# ---- per tensor --------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8_dtype,fp8_max", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,layout", [((33, 4224), "contiguous"), ((9, 1000), "strided"), ((5,), "contiguous")])
def test_dynamic_per_tensor(poison_empty, dtype, fp8_dtype, fp8_max, shape, layout):
    """(33, 4224) runs kernel 1 as a persistent loop (more tiles than partials) and kernel 2 over
    its tiles in reverse (the table's sizes are all below 32768 elements: the one-program kernel);
    a strided view; a 1-D input."""
    x = sample(shape, dtype, seed=1, layout=layout)
    ms = min_scale_of(fp8_max)
    q, scale = quant.dynamic_scaled_fp8_quant(x, fp8_dtype, fp8_max, ms)
    want_scale = ref_scale(x.double().abs().amax().reshape(1), fp8_max, ms)
    assert scale.shape == (1,) and torch.equal(scale, want_scale)
    assert_same_bits(q, ref_quant_mul(x, want_scale, fp8_dtype, fp8_max))


def test_dynamic_per_tensor_zeros(poison_empty):
    x = torch.zeros(4, 100, dtype=torch.bfloat16)
    q, scale = quant.dynamic_scaled_fp8_quant(x, torch.float8_e4m3fn, 448.0, min_scale_of(448.0))
    assert scale.item() == torch.tensor(min_scale_of(448.0), dtype=torch.float32).item()
    assert (q.float() == 0).all()


@pytest.mark.parametrize("fp8_dtype,fp8_max", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,layout", [((7, 4224), "contiguous"), ((3, 5, 64), "strided")])
def test_static(poison_empty, dtype, fp8_dtype, fp8_max, shape, layout):
    x = sample(shape, dtype, seed=2, layout=layout)
    scale = torch.tensor([0.0371])  # small enough that the outliers clamp at +-max
    q = quant.static_scaled_fp8_quant(x, scale, fp8_dtype, fp8_max)
    assert q.shape == x.shape and q.dtype == fp8_dtype
    assert_same_bits(q, ref_quant_mul(x, scale, fp8_dtype, fp8_max))
    assert (q.float().abs() == fp8_max).any()


# ---- per token group ---------------------------------------------------------------------------


def ref_group(x, group_size, column_major, ue8m0, fp8_dtype, fp8_max, min_scale):
    hidden = x.shape[-1]
    groups = -(-hidden // group_size)
    pad = torch.zeros(*x.shape[:-1], groups * group_size - hidden, dtype=torch.float64)
    xg = torch.cat((x.double(), pad), dim=-1).unflatten(-1, (groups, group_size))
    scale = ref_scale(xg.abs().amax(dim=-1, keepdim=True), fp8_max, min_scale)
    if ue8m0:  # 2^ceil(log2 s), exactly: frexp gives s = m * 2^e with m in [0.5, 1)
        mantissa, exponent = torch.frexp(scale.double())
        scale = fp32(torch.ldexp(torch.ones_like(mantissa), torch.where(mantissa == 0.5, exponent - 1, exponent)))
    pre = fp32(xg / scale.double()).clamp(-fp8_max, fp8_max).flatten(-2)[..., :hidden]
    scales = scale.squeeze(-1)
    if column_major:
        scales = scales.transpose(-2, -1).contiguous().transpose(-2, -1)
    return triton_cast(pre, fp8_dtype), scales


def test_group_partial_last_group(poison_empty):
    """H not a multiple of G (the launcher pads like the spec; the op entry point rejects it)."""
    x = sample((3, 200), torch.bfloat16, seed=5)
    q, scales = quant.per_token_group_fp8_quant(x, 64, True, False, torch.float8_e4m3fn, 448.0, min_scale_of(448.0))
    want_q, want_scales = ref_group(x, 64, True, False, torch.float8_e4m3fn, 448.0, min_scale_of(448.0))
    assert torch.equal(scales, want_scales)
    assert_same_bits(q, want_q)


# ---- fused rms_norm + per-token quant ------------------------------------------------------------


def _round_like_interpreter(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 first, then to ``dtype``; the interpreter truncates fp32 -> bf16 (not round to nearest)."""
    v = fp32(v)
    if dtype == torch.bfloat16:
        return (v.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
    return v.to(dtype)


#: a size per row of the table's NORM_QUANT: an odd row length, several rows per program, one
#: row, a 3-D input
NORM_QUANT_SHAPES = ((7, 4224), (33, 256), (1, 4096), (2, 3, 384))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case,shape", list(zip(NORM_QUANT, NORM_QUANT_SHAPES)), ids=lambda v: getattr(v, "label", None))
def test_rms_norm_quant(poison_empty, dtype, case, shape):
    """Scales within 2 bf16 ulps of the float64 reference; q against the reference normalised
    value quantized with the kernel's own scale: equal bits except where the kernel's fp32
    normalisation (summed in another order) lands one ulp of x's dtype away, which may move an
    fp8 value by one step (or two, through the interpreter's dropped carry)."""
    x = sample(shape, dtype, seed=6)
    eps = 1e-6
    weight = case.weight_for(shape[-1], dtype)
    ub = torch.tensor([1.5]) if case.scale_ub else None
    q, scale = fused_norm_quant.rms_norm_dynamic_per_token_fp8_quant(x, weight, eps, ub, torch.float8_e4m3fn,
                                                                     448.0, min_scale_of(448.0))
    y = cases.ref_rms_norm(x, weight, eps, _round_like_interpreter)
    _, want_scale = ref_per_token(y, ub, torch.float8_e4m3fn, 448.0, min_scale_of(448.0))
    assert scale.shape == (*shape[:-1], 1)
    torch.testing.assert_close(scale, want_scale, rtol=2 ** -7, atol=0)
    want_q = ref_quant_mul(y, scale, torch.float8_e4m3fn, 448.0)
    got, want = q.float(), want_q.float()
    differ = got != want
    assert differ.float().mean() < 2e-3, f"{int(differ.sum())} of {got.numel()} differ"
    assert ((got - want).abs() <= want.abs() * 0.5 + 2 ** -9)[differ].all()


def test_rms_norm_quant_looped_rows(poison_empty):
    x = sample((3, 3000), torch.float32, seed=7)
    weight = torch.randn(3000) * 0.5 + 1
    with override("rows", single_tile=False, block_n=1024, block_m=1):
        q, scale = fused_norm_quant.rms_norm_dynamic_per_token_fp8_quant(x, weight, 1e-5, None, torch.float8_e4m3fn,
                                                                         448.0, min_scale_of(448.0))
    y = cases.ref_rms_norm(x, weight, 1e-5, _round_like_interpreter)
    _, want_scale = ref_per_token(y, None, torch.float8_e4m3fn, 448.0, min_scale_of(448.0))
    torch.testing.assert_close(scale, want_scale, rtol=1e-6, atol=0)
    differ = q.float() != ref_quant_mul(y, scale, torch.float8_e4m3fn, 448.0).float()
    assert differ.float().mean() < 2e-3


# ---- through torch.ops.customop, with the launchers registered for CPU tensors -----------------


@pytest.fixture
def cpu_kernels():
    """The Triton launchers as the CPU kernels of the customop:: quant ops, for this test only."""
    lib = torch.library.Library("customop", "IMPL")
    for name, launcher in LAUNCHERS.items():
        lib.impl(name.split("::")[1], launcher, "CPU")
    yield
    lib._destroy()


def _op_cases():
    x = sample((5, 256), torch.bfloat16, seed=8)
    f8, mx, ms = torch.float8_e4m3fn, 448.0, min_scale_of(448.0)
    return {
        "static_scaled_fp8_quant": (x, torch.tensor([0.05]), f8, mx),
        "dynamic_scaled_fp8_quant": (x, f8, mx, ms),
        "dynamic_per_token_scaled_fp8_quant": (x, torch.tensor([9.0]), f8, mx, ms),
        "per_token_group_fp8_quant": (x, 128, True, True, f8, mx, ms),
        "rms_norm_dynamic_per_token_fp8_quant": (x, torch.rand(256).to(torch.bfloat16) + 0.5, 1e-6, None, f8, mx, ms),
    }


def _bits(out):
    return [t.view(torch.uint8) if t.dtype.itemsize == 1 else t for t in (out if isinstance(out, tuple) else (out,))]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_op_cases()))
def test_through_torch_ops(cpu_kernels, name):
    """Dispatch reaches the launcher (same bits as a direct call); opcheck passes; the op runs
    under torch.compile(fullgraph=True)."""
    args = _op_cases()[name]
    op = getattr(torch.ops.customop, name)
    direct = LAUNCHERS[f"customop::{name}"](*args)
    for got, want in zip(_bits(op(*args)), _bits(direct)):
        assert torch.equal(got, want)
    torch.library.opcheck(op.default, args)
    compiled = torch.compile(lambda *a: op(*a), backend="aot_eager", fullgraph=True)
    for got, want in zip(_bits(compiled(*args)), _bits(direct)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("tokens", [0, 3])
def test_per_token_launchers_reject_a_two_element_cap_like_the_schema(tokens):
    """The launchers' message is the library op's, also for an empty x (which returns early)."""
    x, cap = torch.randn(tokens, 16), torch.ones(2)
    fp8 = torch.float8_e4m3fn
    with pytest.raises(ValueError, match=r"customop::dynamic_per_token_scaled_fp8_quant: scale_ub must have one "
                                         r"element, got shape \(2,\)"):
        quant.dynamic_per_token_scaled_fp8_quant(x, cap, fp8, 448.0, 1e-6)
    with pytest.raises(ValueError, match=r"customop::rms_norm_dynamic_per_token_fp8_quant: scale_ub must have one"):
        fused_norm_quant.rms_norm_dynamic_per_token_fp8_quant(x, None, 1e-6, cap, fp8, 448.0, 1e-6)
