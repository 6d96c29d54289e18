"""Float64 references of the fp8 quant table (``customop/samples/quant.py``), written from the
formulas, not from ``customop.math``; every tier judges its path with them, bit for bit.

Scales: the exact float32 value ``max(fp32(amax / MAX), fp32(MIN_SCALE))`` (a float64 quotient
rounded to float32 is the correctly rounded float32 quotient; ue8m0 rounds it up to a power of
two), computed with tensor-by-tensor division (torch's CUDA ``tensor / python_float`` multiplies
by the reciprocal instead). ``q``: recomputed from the op's own scale with float64 arithmetic that
rounds exactly like the float32 spec (a product of two floats is exact in float64), then cast to
fp8 by ``cast``: torch's cast by default; the interpreter tier passes a Triton cast (the
interpreter's fp32 -> fp8 rounding drops the carry into the exponent), so any deviation from the
rounding order (reciprocal multiply vs division, where the clamp happens) shows up as flipped bits.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from customop.platforms import CpuPlatform, CudaPlatform
from customop.samples.quant import QuantCase
from customop.testing import forced_platform

#: the fp8 maxima, written here (not read from the library): ROCm's fnuz saturates at 224, not
#: finfo's 240
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 224.0}


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


def build(case: QuantCase, fp8: torch.dtype, platform=None, **kwargs):
    """``case``'s op with fp8 dtype ``fp8`` (built under ``platform``, default the CPU's)."""
    with forced_platform(platform or Fp8Cpu(fp8)):
        op = case.build(**kwargs)
    assert op.fp8_dtype == fp8
    return op


def forward_kernel(op, x: torch.Tensor, kwargs: dict):
    """``op.forward_kernel`` with the call's ``scale``/``scale_ub`` (its arguments are positional)."""
    return op.forward_kernel(x, kwargs.get("scale"), kwargs.get("scale_ub"))


def _fp32(t64: torch.Tensor) -> torch.Tensor:
    return t64.to(torch.float32)


def ref_scale(amax64: torch.Tensor, fp8: torch.dtype, ue8m0: bool = False) -> torch.Tensor:
    """``max(fp32(amax / MAX), fp32(MIN_SCALE))`` from an exact float64 amax; ue8m0 rounds it up
    to ``2^ceil(log2 s)`` exactly (frexp gives s = m * 2^e with m in [0.5, 1))."""
    fmax = FP8_MAX[fp8]
    scale = torch.maximum(_fp32(amax64 / torch.full_like(amax64, fmax)),
                          torch.tensor(1.0 / (fmax * 512.0), dtype=torch.float32, device=amax64.device))
    if ue8m0:
        mantissa, exponent = torch.frexp(scale.double())
        scale = _fp32(torch.ldexp(torch.ones_like(mantissa), torch.where(mantissa == 0.5, exponent - 1, exponent)))
    return scale


def ref_scales(case: QuantCase, x: torch.Tensor, fp8: torch.dtype, scale_ub: torch.Tensor | None = None) -> torch.Tensor:
    """The dynamic scales of ``case`` on ``x``, in the op's layout (contiguous)."""
    x64 = x.double().abs()
    group = case.group_size
    if group is not None:
        groups = math.ceil(x.shape[-1] / group)
        padded = torch.zeros(x.shape[:-1] + (groups * group,), dtype=torch.float64, device=x.device)
        padded[..., : x.shape[-1]] = x64
        amax = padded.unflatten(-1, (groups, group)).amax(-1)
    elif case.group_shape.is_per_token():
        amax = x64.amax(-1, keepdim=True)
        if scale_ub is not None:
            amax = amax.clamp(max=float(scale_ub))
    else:
        amax = x64.max().reshape(1)
    return ref_scale(amax, fp8, bool(case.init.get("use_ue8m0")))


def torch_cast(v: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    return v.to(fp8)


def ref_prequant(x: torch.Tensor, scale: torch.Tensor, fp8: torch.dtype, divide: bool,
                 group_size: int | None = None) -> torch.Tensor:
    """The float32 values the spec rounds to fp8, from the op's float32 scale: ``fp32(x) *
    fp32(1/scale)``, or ``fp32(x) / scale`` (dynamic per-group divides), clamped to +-MAX."""
    fmax = FP8_MAX[fp8]
    s64 = scale.double()
    if not divide:
        s64 = _fp32(1.0 / s64).double()  # the float32 reciprocal, correctly rounded
    if group_size is not None:
        s64 = s64.repeat_interleave(group_size, dim=-1)[..., : x.shape[-1]]
    value = x.double() / s64 if divide else x.double() * s64
    return _fp32(value).clamp(-fmax, fmax)


def ref_q(x: torch.Tensor, scale: torch.Tensor, fp8: torch.dtype, divide: bool, group_size: int | None = None,
          cast: Callable = torch_cast) -> torch.Tensor:
    """``ref_prequant`` rounded to fp8 by ``cast``."""
    return cast(ref_prequant(x, scale, fp8, divide, group_size), fp8)


def fp8_ties(value: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """Where the float32 ``value`` lies exactly halfway between two fp8 values."""
    nearest = value.to(fp8).float()
    other = 2 * value - nearest
    return (other != nearest) & (other.to(fp8).float() == other)


def assert_same_bits(q: torch.Tensor, expected: torch.Tensor, what: str = "q") -> None:
    assert q.dtype == expected.dtype and q.shape == expected.shape, (q.dtype, q.shape, expected.dtype, expected.shape)
    bad = q.view(torch.uint8) != expected.view(torch.uint8)
    if bad.any():
        idx = bad.nonzero()[:5].tolist()
        got = [q[tuple(i)].float().item() for i in idx]
        want = [expected[tuple(i)].float().item() for i in idx]
        raise AssertionError(f"{what}: {int(bad.sum())} of {q.numel()} fp8 values differ; "
                             f"at {idx}: got {got}, want {want}")


def vllm_static_scale_shape(group_shape, given: torch.Tensor) -> tuple[int, ...]:
    """The shape vLLM 0.33's QuantFP8 gives back for a static ``scale``: per tensor unchanged, any
    other one-element scale ``(1, 1)``, a 1-D per-channel ``[H]`` as ``(1, H)``, the rest unchanged."""
    if given.numel() == 1:
        return tuple(given.shape) if group_shape.is_per_tensor() else (1, 1)
    if group_shape.is_per_channel() and given.dim() == 1:
        return (1, given.numel())
    return tuple(given.shape)


def check_against_reference(case: QuantCase, x: torch.Tensor, out, fp8: torch.dtype, kwargs: dict,
                            cast: Callable = torch_cast, ties_either_way: bool = False) -> None:
    """``out`` = ``(q, scale)`` of ``case``'s op on ``x`` (called with ``kwargs``): the scales
    exactly, q bit for bit, padding rows zero, the scales' layout. ``ties_either_way`` (the
    interpreter tier): where the value to round lies exactly halfway between two fp8 values,
    either neighbour is accepted. The interpreter's own cast rounds such ties away from zero, and
    it emulates ``tl.fma`` unfused, so the per-group kernel's corrected quotient can land one fp32
    ulp inside a tie and round to the other neighbour; on a GPU both are exact (the GPU tier keeps
    the strict check)."""
    q, scale = out
    static = case.init["static"]
    group = case.group_size
    if static:  # the caller's scale, shaped as vLLM 0.33 returns it (a view: [H] per channel -> [1, H])
        given = kwargs["scale"]
        assert scale.data_ptr() == given.data_ptr() and torch.equal(scale.reshape(-1), given.reshape(-1))
        assert scale.shape == vllm_static_scale_shape(case.group_shape, given), (scale.shape, given.shape)
    else:
        want = ref_scales(case, x, fp8, kwargs.get("scale_ub"))
        assert scale.dtype == torch.float32 and scale.shape == want.shape, (scale.shape, want.shape)
        if not torch.equal(scale, want):
            bad = (scale != want).nonzero()[:3].tolist()
            raise AssertionError(f"{case.label}: scales differ at {bad}: got "
                                 f"{[scale[tuple(i)].item() for i in bad]}, want {[want[tuple(i)].item() for i in bad]}")
    # only dynamic per-group divides; static per-group scales are repeated over their groups
    value = ref_prequant(x, scale, fp8, divide=group is not None and not static, group_size=group)
    expected = cast(value, fp8)
    rows = x.shape[0]
    padding = case.init.get("num_token_padding")
    if padding is not None and padding > rows:
        assert q.shape == (padding,) + tuple(x.shape[1:])
        assert not q[rows:].float().any(), "padding rows must be zero"
        q = q[:rows]
    if ties_either_way:
        tie = fp8_ties(value, fp8)
        other = (2 * value - expected.float()).to(fp8)
        expected = torch.where(tie & (q.view(torch.uint8) == other.view(torch.uint8)), other, expected)
    assert_same_bits(q, expected, f"{case.label} q")
    if case.init.get("column_major_scales"):
        # tokens are the fastest dim (with one token both layouts are the same memory, and torch
        # may report any stride for the size-1 dim)
        assert scale.stride(-2) == 1 or scale.shape[-2] == 1, f"column-major scales expected, strides {scale.stride()}"
    if case.init.get("tma_aligned_scales") and x.dim() == 2:
        assert scale.stride(-1) == math.ceil(x.shape[0] / 4) * 4, scale.stride()


# ---- rms_norm_quant_fp8 --------------------------------------------------------------------------


def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, round_to: Callable) -> torch.Tensor:
    """RMSNorm in float64 with the spec's roundings (to the weight's dtype, the multiply there, to
    x's dtype), each done by ``round_to(value64, dtype)``; eps as the float32 the spec adds."""
    xd = x.double()
    y = xd / torch.sqrt(xd.pow(2).mean(dim=-1, keepdim=True) + _fp32(torch.tensor(eps, dtype=torch.float64)).item())
    if weight is not None:
        y = round_to(y, weight.dtype).double() * weight.double()
        y = round_to(y, weight.dtype).double()
    return round_to(y, x.dtype)


def round_to(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 first, then to ``dtype`` (torch's rounding)."""
    return _fp32(v).to(dtype)
