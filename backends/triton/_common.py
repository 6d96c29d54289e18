"""Shared helpers of the Triton kernel modules: row views, block arithmetic, activations.

Kernels index each row from an int64 base pointer (``row * stride`` can pass 2**31 elements at
32768 x 2 x 14336 and beyond) and use int32 offsets inside the row, which keeps the per-element
arithmetic 32-bit.
"""

from __future__ import annotations

import contextlib

import os

import torch
import triton
import triton.language as tl


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def as_rows(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as a ``[rows, t.shape[-1]]`` view with unit last stride, or None when no such view
    exists (the caller then works on a contiguous copy). Never copies."""
    if t.dim() == 0 or (t.shape[-1] > 1 and t.stride(-1) != 1):
        return None
    try:
        rows = t.view(-1, t.shape[-1])
    except RuntimeError:
        return None
    return rows


def rows_or_copy(t: torch.Tensor) -> torch.Tensor:
    """A row view of ``t``, or of a contiguous copy when ``t`` has none."""
    rows = as_rows(t)
    return rows if rows is not None else t.contiguous().view(-1, t.shape[-1])


def device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """Makes ``device`` current while launching: Triton launches on the current device and
    stream, so a tensor on another GPU needs a switch (a no-op when it is already current)."""
    if device.type == "cpu" or device.index is None:
        return contextlib.nullcontext()
    module = torch.get_device_module(device.type)
    if module.current_device() == device.index:
        return contextlib.nullcontext()
    return module.device(device.index)


def row_stride(rows: torch.Tensor) -> int:
    # A single row may report any stride; the kernels only multiply it by row indices.
    return rows.stride(0) if rows.shape[0] > 1 else rows.shape[1]


# ---- activations (fp32 in, fp32 out) ----------------------------------------------------------


@triton.jit
def silu(x):
    # the one sigmoid form of the kernels (mul_sigmoid, below)
    return mul_sigmoid(x, x, 1.0)


@triton.jit
def silu_or_sigmoid(z, SIGMOID: tl.constexpr):
    """A gate's activation: sigmoid(z), or silu(z)."""
    return tl.sigmoid(z) if SIGMOID else silu(z)


@triton.jit
def gelu_erf(x):
    return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))


NEG_LOG2E = tl.constexpr(-1.4426950408889634)  # exp(-v) == exp2(v * NEG_LOG2E)


@triton.jit
def mul_sigmoid(x, z, k):
    """x * sigmoid(k z), computed as x / (1 + exp2(z * (-k log2 e))): one approximate division
    (Triton's fp32 `/` is div.full.f32 on NVIDIA, <= 2 ulp; a denominator of inf gives 0), no
    negation, and k * log2(e) one constant (folded at compile time, or once per program for a
    runtime k). The fp32 rounding of exp2's argument costs up to ~|k z| * 4.6e-8 of the result's
    relative accuracy (3.8e-6 at |k z| ~ 88, where the sigmoid is tiny); tl.exp rounds its
    argument the same way on a GPU."""
    return x / (1.0 + tl.exp2(z * (k * NEG_LOG2E)))


@triton.jit
def gelu_tanh(x, C: tl.constexpr):
    # 0.5 x (1 + tanh(u)) == x sigmoid(2u), u = C (x + 0.044715 x^3): no tanh intrinsic is needed
    # (Triton has none that is device-neutral) and there is no cancellation in 1 + tanh(u) for
    # negative u; the sigmoid through mul_sigmoid
    return mul_sigmoid(x, x + 0.044715 * x * x * x, 2.0 * C)


@triton.jit
def expm1_neg(x):
    """expm1 for x <= 0: a Taylor polynomial near 0 (where exp(x) - 1 cancels), exp - 1 beyond."""
    poly = x * (1.0 + x * (0.5 + x * (1.0 / 6.0 + x * (1.0 / 24.0 + x * (1.0 / 120.0 + x * (1.0 / 720.0 + x * (1.0 / 5040.0)))))))
    return tl.where(x > -0.25, poly, tl.exp(x) - 1.0)


@triton.jit
def softplus(x):
    # log(1 + exp(x)) as torch computes it (x itself above 20); exp(x) where 1 + exp(x) rounds to 1
    e = tl.exp(tl.minimum(x, 20.0))
    return tl.where(x > 20.0, x, tl.where(x < -15.0, e, tl.log(1.0 + e)))


#: the Triton mode is fixed for the process when a kernel is decorated (i.e. at import)
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def interpreter_safe_dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``tl.dot`` with ``input_precision=PRECISION``; ``UPCAST`` (pass ``INTERPRETED`` and bf16
    inputs): the interpreter multiplies bf16 tiles as their uint16 bits (triton 3.7.1), so they
    go through fp32 (exact for bf16 products; the GPU's bf16 MMA also accumulates in fp32)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


#: CUDA's limit on a grid's second and third axes (the first takes 2**31 - 1)
GRID_YZ_MAX = 65535


class ConfigStack:
    """Launch configurations that sweeps and tests put over a launcher's own choice: inside
    ``with stack.use(cfg):`` (nests) ``stack.top`` is ``cfg``; outside it is None."""

    def __init__(self) -> None:
        self._items: list = []

    @property
    def top(self):
        return self._items[-1] if self._items else None

    @contextlib.contextmanager
    def use(self, cfg):
        self._items.append(cfg)
        try:
            yield cfg
        finally:
            self._items.pop()
