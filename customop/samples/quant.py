"""Random-input builders for QuantFP8 (``assert_conforms``, ``customop check``).

Every mode once: static and dynamic per-tensor, per-token (with and without ``scale_ub``),
per-group 64 and 128 (ue8m0, column-major), token padding; shapes with one row, an odd row count
and hidden sizes that are not powers of two (but multiples of 128, as the group kernels require).
fp8 outputs are compared dequantized: one fp8 ulp (2^-3 relative) of rounding difference is
allowed, since a vendor kernel may round an intermediate differently; scales must agree to float32
precision and column-major scales must keep their layout.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from customop.ops.quantization import GroupShape
from customop.testing import Sample, assert_close, randn, register_samples

#: atol of the dequantized comparison, in units of the scale: e4m3's smallest subnormal is 2^-9
#: (2^-10 for fnuz), so 2^-8 covers one subnormal step of either.
_SUBNORMAL_SLACK = 2.0**-8


def dequantize(q: torch.Tensor, scale: torch.Tensor, group_size: int | None = None) -> torch.Tensor:
    """float64 ``q * scale`` with the scale broadcast to ``q`` (per-group scales repeated
    ``group_size`` times along the last dim). Rows of ``q`` beyond the scale's (token padding)
    are dropped."""
    qf = q.double()
    s = scale.double()
    if s.numel() == 1:
        return qf * s.reshape(())
    if group_size is not None:
        s = s.repeat_interleave(group_size, dim=-1)[..., : q.shape[-1]]
    return qf[: s.shape[0]] * s


def compare_quant(got: Any, want: Any, dtype: torch.dtype, group_size: int | None = None) -> None:
    """The ``Sample.compare`` hook of QuantFP8: ``(q, scale)`` pairs compared dequantized."""
    (q, s), (q_ref, s_ref) = got, want
    if q.dtype != q_ref.dtype or q.shape != q_ref.shape:
        raise AssertionError(f"q: got {q.dtype} {tuple(q.shape)}, expected {q_ref.dtype} {tuple(q_ref.shape)}")
    if s.dtype != torch.float32 or s.shape != s_ref.shape:
        raise AssertionError(f"scale: got {s.dtype} {tuple(s.shape)}, expected float32 {tuple(s_ref.shape)}")
    if s.dim() == 2 and s.stride() != s_ref.stride():
        raise AssertionError(f"scale layout: got strides {s.stride()}, expected {s_ref.stride()}")
    assert_close(s, s_ref, torch.float32, what="scale")
    atol = float(s_ref.double().abs().max()) * _SUBNORMAL_SLACK
    assert_close(dequantize(q, s, group_size), dequantize(q_ref, s_ref, group_size), torch.float64,
                 atol=atol, rtol=0.125, what="dequantized q")
    padded = q.shape[0] - s.shape[0] if s.numel() > 1 and s.dim() == q.dim() else 0
    if padded > 0 and q[s.shape[0]:].float().abs().max() != 0:
        raise AssertionError("q: padding rows are not zero")


@register_samples("quant_fp8")
def _quant_fp8(dtype: torch.dtype, device: str, gen: torch.Generator) -> list[Sample]:
    samples = []
    for shape in ((1, 128), (7, 4224), (5, 384)):  # hidden a multiple of 128: the kernels need it
        x = randn(*shape, dtype=dtype, device=device, scale=3.0, generator=gen)
        label = "x".join(map(str, shape))
        tensor_scale = (x.float().abs().amax() / 448.0).reshape(1)
        ub = torch.tensor([2.0], device=device)

        def add(init: dict[str, Any], what: str, group_size: int | None = None, **kwargs: Any) -> None:
            samples.append(Sample(init, (x,), kwargs, label=f"quant_fp8 {what} {label}",
                                  compare=functools.partial(compare_quant, group_size=group_size)))

        add(dict(static=True, group_shape=GroupShape.PER_TENSOR), "static per-tensor", scale=tensor_scale)
        add(dict(static=False, group_shape=GroupShape.PER_TENSOR), "dynamic per-tensor")
        add(dict(static=False, group_shape=GroupShape.PER_TOKEN), "dynamic per-token")
        add(dict(static=False, group_shape=GroupShape.PER_TOKEN, num_token_padding=16), "per-token padded 16")
        add(dict(static=False, group_shape=GroupShape.PER_TOKEN), "per-token scale_ub", scale_ub=ub)
        add(dict(static=False, group_shape=GroupShape(1, 64)), "per-group 64", group_size=64)
        add(dict(static=False, group_shape=GroupShape(1, 128), use_ue8m0=True, column_major_scales=True),
            "per-group 128 ue8m0 column-major", group_size=128)
    return samples
