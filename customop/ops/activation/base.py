"""What every activation op shares: the input checks and the base class ``_Activation``
(its forwards: the spec natively, ``run_tiered`` on the CPU, the ``torch.ops.customop`` entry point
on accelerators).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from customop.backends.cpu import CpuTiers, run_tiered
from customop.custom_op import CustomOp
from customop.ops.activation.cpu_tiers import FEW_KERNELS_MIN_NUMEL

# ---- input checks (every path; the kernels also need contiguity) --------------------------

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CPU_DTYPES = (*_KERNEL_DTYPES, torch.float64)


def _check_input(op: str, x: Any, *, gated: bool, dtypes: tuple[torch.dtype, ...], contiguous: bool) -> None:
    # The valid case in one expression: a decode-sized CPU call takes ~8 us, so 100 ns shows.
    if (isinstance(x, torch.Tensor) and x.dtype in dtypes and x.dim() > 0 and not (gated and x.size(-1) % 2)
            and (not contiguous or x.is_contiguous())):
        return
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"customop {op}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"customop {op}: x has dtype {x.dtype}; supported here: {names}")
    if x.dim() == 0:
        raise ValueError(f"customop {op}: x must have at least one dimension, got a 0-dim tensor")
    if gated and x.shape[-1] % 2:
        raise ValueError(f"customop {op}: x's last dimension must be even (gate and up halves), "
                         f"got shape {tuple(x.shape)}")
    if contiguous and not x.is_contiguous():
        raise ValueError(f"customop {op}: the device kernel needs a contiguous x (strides "
                         f"{tuple(x.stride())}); call x.contiguous()")


# ---- the ops ----------------------------------------------------------------------------------


def _checked_approximate(op: str, approximate: str) -> str:
    if approximate not in ("none", "tanh"):
        raise ValueError(f"{op}: approximate must be 'none' or 'tanh', got {approximate!r}")
    return approximate


class _Activation(CustomOp):
    """Shared plumbing. A subclass names its pure function (``math_fn``), whether it is gated,
    and the arguments after ``x`` (``math_args``); the library op ``torch.ops.customop.<name>``
    takes the same arguments."""

    math_fn: ClassVar[Callable[..., torch.Tensor]]
    #: forward_cpu below its compile threshold: math_fn's operations with in-place temporaries,
    #: bitwise equal to it (backends/cpu/eager.py); None: math_fn itself
    eager_fn: ClassVar[Callable[..., torch.Tensor] | None] = None
    #: what forward_cpu's compiled tier compiles (the same math in a form Inductor's width-dynamic
    #: code runs faster); None: math_fn itself
    compiled_fn: ClassVar[Callable[..., torch.Tensor] | None] = None
    gated: ClassVar[bool] = False
    compile_native_default: ClassVar[bool] = False
    cpu_tiers: ClassVar[CpuTiers] = CpuTiers(FEW_KERNELS_MIN_NUMEL, standalone=True)
    repr_fields: ClassVar[tuple[str, ...]] = ()  # constructor arguments shown by print(module)

    def __init__(self, *, enforce_enable: bool = False, compile_native: bool | None = None) -> None:
        if compile_native is None:
            compile_native = self.compile_native_default
        super().__init__(enforce_enable=enforce_enable, compile_native=compile_native)

    def math_args(self) -> tuple[Any, ...]:
        return ()

    def extra_repr(self) -> str:
        return ", ".join(f"{field}={getattr(self, field)!r}" for field in self.repr_fields)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(self.name, x, gated=self.gated, dtypes=_CPU_DTYPES, contiguous=False)
        return type(self).math_fn(x, *self.math_args())

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(self.name, x, gated=self.gated, dtypes=_CPU_DTYPES, contiguous=False)
        return run_tiered(self.cpu_tiers, self.math_fn, x, *self.math_args(), eager=self.eager_fn,
                          compiled_spec=self.compiled_fn)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_kernel(x)

    forward_xpu = forward_tpu = forward_cuda

    def forward_kernel(self, x: torch.Tensor) -> torch.Tensor:
        """The ``torch.ops.customop`` call every accelerator shares (same name as the op)."""
        _check_input(self.name, x, gated=self.gated, dtypes=_KERNEL_DTYPES, contiguous=True)
        return getattr(torch.ops.customop, self.name)(x, *self.math_args())
