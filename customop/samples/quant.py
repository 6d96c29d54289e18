"""The fp8 quant family's case table: what every tier runs, and ``customop check`` too.

- ``CASES``: QuantFP8's modes with their constructor arguments and what the call passes: static
  and dynamic per-tensor, static per-token, per-channel and per-group, dynamic per-token (with and
  without ``scale_ub``), token padding, per-group 64 and 128 (ue8m0, column-major, TMA-aligned
  scales). ``kernel``: the ``customop::`` entry point ``forward_kernel`` calls (None: the spec runs
  on every platform, as static scales with more than one element do).
- ``SIZES``: the inputs of each tier as ``(*leading dims, hidden)``. ``"check"``: ``customop check``
  / ``assert_conforms``. ``"small"``: the paths emulated on a CPU: one row, odd rows, a 3-D input
  (15 rows: several per program), and the odd hidden size 4231 (modes per group skip it: the
  kernels need a multiple of the group; the spec's zero padding has its own test). ``"tpu"``:
  the TPU tier (Pallas in interpret mode, the XLA CPU device): hidden sizes in multiples of 128,
  one row and a 3-D input of 15 rows. ``"real"``: the
  GPU tier, up to 32768 x 8192.
- ``input``: normal values of standard deviation 3 with outliers (every 97th value x40) and
  all-zero rows (every 7th from the second), which get the minimum scale.
- ``NORM_QUANT``: ``rms_norm_quant_fp8``'s rows (the weight's dtype, ``scale_ub``).
- ``DTYPES`` (the inputs') and ``FP8_DTYPES`` (e4m3fn, and ROCm MI300's e4m3fnuz).

fp8 outputs are compared dequantized here (``compare_quant``, the ``Sample.compare`` of ``customop
check``): one fp8 ulp (2^-3 relative) of rounding difference is allowed, since a vendor kernel may
round an intermediate differently; scales must agree to float32 precision and column-major scales
must keep their layout. The tests judge bit for bit against their float64 references
(``tests/cases/quant.py``; ``tests/cases/__init__.py`` says why those are not shipped).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from customop.ops.quantization import GroupShape, QuantFP8
from customop.testing import FLOAT_DTYPES, FP8_DTYPES, Sample, assert_close, register_samples  # noqa: F401  (FP8_DTYPES: the table's)

DTYPES = FLOAT_DTYPES

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
    if group_size is None and s.shape[-1] == q.shape[-1] > 1:  # per channel ([H] or [1, H]): every row
        return qf * s
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
    per_channel = group_size is None and s.shape[-1] == q.shape[-1] > 1
    padded = q.shape[0] - s.shape[0] if s.numel() > 1 and s.dim() == q.dim() and not per_channel else 0
    if padded > 0 and q[s.shape[0]:].float().abs().max() != 0:
        raise AssertionError("q: padding rows are not zero")


@dataclasses.dataclass(frozen=True)
class QuantCase:
    label: str
    init: dict[str, Any]  # QuantFP8's constructor arguments
    #: what the call passes besides x: "scale" (static: 1.25x the dynamic scale, so nothing
    #: clamps), "scale_ub" (caps about half of the rows), or nothing
    call: str | None = None

    @property
    def group_shape(self) -> GroupShape:
        return GroupShape(*self.init["group_shape"])

    @property
    def group_size(self) -> int | None:
        return self.group_shape.col if self.group_shape.is_per_group() else None

    @property
    def kernel(self) -> str | None:
        """The ``customop::`` entry point ``forward_kernel`` calls for this mode."""
        if self.init["static"]:
            return "static_scaled_fp8_quant" if self.group_shape.is_per_tensor() else None
        if self.group_size is not None:
            return "per_token_group_fp8_quant"
        return "dynamic_per_token_scaled_fp8_quant" if self.group_shape.is_per_token() else "dynamic_scaled_fp8_quant"

    @property
    def kernel_call(self) -> tuple | None:
        """What the kernel is asked to do: rows equal here differ only in the Python around the
        call (token padding, TMA-aligned scales), so a kernel tier runs one of them."""
        if self.kernel is None:
            return None
        return (self.kernel, self.group_size, bool(self.init.get("column_major_scales")),
                bool(self.init.get("use_ue8m0")), self.call == "scale_ub")

    def build(self, **kwargs: Any) -> QuantFP8:
        """The op; its fp8 dtype is the current platform's (the caller's config decides dispatch)."""
        return QuantFP8(**self.init, **kwargs)

    def shapes(self, size: str) -> tuple[tuple[int, ...], ...]:
        """``SIZES[size]``, without the hidden sizes a per-group mode's kernel cannot take."""
        group = self.group_size
        return tuple(s for s in SIZES[size] if group is None or s[-1] % group == 0)

    def input(self, shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device = "cpu",
              generator: torch.Generator | None = None) -> torch.Tensor:
        return quant_input(shape, dtype, device, generator)

    def call_kwargs(self, x: torch.Tensor, fp8_max: float) -> dict[str, torch.Tensor]:
        """The call's ``scale`` (static modes) or ``scale_ub``, made from x."""
        if self.call is None:
            return {}
        amax_rows = x.abs().float().reshape(-1, x.shape[-1])
        if self.call == "scale_ub":  # the median row amax: caps about half of the rows
            return {"scale_ub": amax_rows.amax(-1).median().reshape(1)}
        floor = 1.0 / (fp8_max * 512.0)
        gs = self.group_shape
        if gs.is_per_tensor():
            amax = amax_rows.amax().reshape(1)
        elif gs.is_per_token():
            amax = x.abs().float().amax(-1, keepdim=True)
        elif gs.is_per_channel():
            amax = amax_rows.amax(0)
        else:
            hidden, group = x.shape[-1], gs.col
            groups = -(-hidden // group)
            padded = torch.zeros(x.shape[:-1] + (groups * group,), device=x.device)
            padded[..., :hidden] = x.abs().float()
            amax = padded.unflatten(-1, (groups, group)).amax(-1)
        return {"scale": (amax / fp8_max * 1.25).clamp(min=floor)}


def quant_input(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device = "cpu",
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Normal values (std 3) with outliers (every 97th x40) and all-zero rows (every 7th from the
    second), drawn in fp32 (by ``generator`` on its device, else on ``device``) and cast."""
    x = torch.randn(shape, generator=generator, device=generator.device if generator is not None else device) * 3.0
    x.view(-1)[::97] *= 40.0
    x.view(-1, shape[-1])[1::7] = 0.0
    return x.to(device=device, dtype=dtype)


_S, _D = True, False
CASES = (
    QuantCase("static per-tensor", dict(static=_S, group_shape=GroupShape.PER_TENSOR), call="scale"),
    QuantCase("static per-token", dict(static=_S, group_shape=GroupShape.PER_TOKEN), call="scale"),
    QuantCase("static per-channel", dict(static=_S, group_shape=GroupShape.PER_CHANNEL), call="scale"),
    QuantCase("static per-group 128", dict(static=_S, group_shape=GroupShape(1, 128)), call="scale"),
    QuantCase("dynamic per-tensor", dict(static=_D, group_shape=GroupShape.PER_TENSOR)),
    QuantCase("dynamic per-tensor padded 12", dict(static=_D, group_shape=GroupShape.PER_TENSOR, num_token_padding=12)),
    QuantCase("dynamic per-token", dict(static=_D, group_shape=GroupShape.PER_TOKEN)),
    QuantCase("dynamic per-token scale_ub", dict(static=_D, group_shape=GroupShape.PER_TOKEN), call="scale_ub"),
    QuantCase("dynamic per-token padded 12", dict(static=_D, group_shape=GroupShape.PER_TOKEN, num_token_padding=12)),
    QuantCase("per-group 64", dict(static=_D, group_shape=GroupShape(1, 64))),
    QuantCase("per-group 64 ue8m0", dict(static=_D, group_shape=GroupShape(1, 64), use_ue8m0=True)),
    QuantCase("per-group 128", dict(static=_D, group_shape=GroupShape(1, 128))),
    QuantCase("per-group 128 ue8m0", dict(static=_D, group_shape=GroupShape(1, 128), use_ue8m0=True)),
    QuantCase("per-group 128 column-major", dict(static=_D, group_shape=GroupShape(1, 128), column_major_scales=True)),
    QuantCase("per-group 128 ue8m0 column-major tma", dict(static=_D, group_shape=GroupShape(1, 128), use_ue8m0=True,
                                                          column_major_scales=True, tma_aligned_scales=True)),
)
BY_LABEL = {case.label: case for case in CASES}
#: one row per distinct kernel call (what the kernel tiers run)
KERNEL_CASES = tuple(case for i, case in enumerate(CASES)
                     if case.kernel and case.kernel_call not in {c.kernel_call for c in CASES[:i]})

SIZES: dict[str, tuple[tuple[int, ...], ...]] = {
    "check": ((1, 128), (7, 4224), (5, 384)),
    "small": ((1, 128), (7, 4224), (3, 5, 384), (7, 4231)),
    "tpu": ((1, 128), (3, 5, 384)),
    "real": ((1, 8192), (16, 8192), (7, 4224), (7, 4231), (3, 5, 1000), (256, 4096), (4096, 7168), (4096, 8192),
             (32768, 8192)),
}


@dataclasses.dataclass(frozen=True)
class NormQuantCase:
    """A row of ``rms_norm_quant_fp8``: RMSNorm (weight of x's dtype, fp32, or none) then dynamic
    per-token quant (with or without ``scale_ub``)."""

    label: str
    weight: str | None
    scale_ub: bool

    def weight_for(self, hidden: int, dtype: torch.dtype, device: str | torch.device = "cpu",
                   generator: torch.Generator | None = None) -> torch.Tensor | None:
        if self.weight is None:
            return None
        w = torch.randn(hidden, generator=generator) * 0.2 + 1.0
        return w.to(device=device, dtype=dtype if self.weight == "x" else torch.float32)


NORM_QUANT = (
    NormQuantCase("weight", "x", False),
    NormQuantCase("no weight, scale_ub", None, True),
    NormQuantCase("fp32 weight, scale_ub", "fp32", True),
    NormQuantCase("weight, scale_ub", "x", True),
)


@register_samples("quant_fp8", DTYPES)
def _quant_fp8(dtype: torch.dtype, device: str, gen: torch.Generator) -> list[Sample]:
    samples = []
    for case in CASES:
        for shape in case.shapes("check"):
            x = case.input(shape, dtype, device, gen)
            samples.append(Sample(dict(case.init), (x,), case.call_kwargs(x, 448.0),
                                  label=f"quant_fp8 {case.label} {'x'.join(map(str, shape))}",
                                  compare=functools.partial(compare_quant, group_size=case.group_size)))
    return samples
