"""``rms_norm_gated`` (Mamba-2's grouped gated RMSNorm, ``RMSNormGated``) and
``fused_rms_norm_gated`` (the KDA output norm, ``FusedRMSNormGated``: the same kernel over whole
rows, the gate after the norm as ``y * g * sigmoid(g)`` or ``y * sigmoid(g)``, an optional weight)
through the hand-written kernel (``rms_norm_gated.c``, ``rms_norm_gated_avx2.c``): the spec's
arguments in, its result out (a new tensor), or None for a call the kernel does not take, which
then runs the other tiers. Taken: bf16 (AVX2, or AVX-512 with AVX512_BF16), fp16 or fp32 x with z
(g) of x's dtype and shape (or none) and a weight of x's dtype or fp32, a group size dividing the
width, plain CPU tensors whose rows have unit stride (contiguous, or 2-D with any row stride),
autograd not recording, nothing intercepting torch calls (modes, transforms, tracing, autocast);
and only where torch's own vectorised exp of the build's width (``Sleef_expf16_u10`` /
``Sleef_expf8_u10`` in libtorch_cpu, the one ATen's silu and sigmoid call on that CPU) can be found
for the kernel to call, so that its gate is bitwise ATen's."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any

import torch

from customop.backends.cpu.native import loader
from customop.backends.cpu.native.rms_norm import _plain, _row_stride
from customop.backends.cpu.standalone import intercepted

log = logging.getLogger(__name__)

#: x, its row stride, z, its row stride, weight (or NULL), weight is fp32, out, rows, width, group
#: size, eps, norm_before_gate, the gate's form, exp, threads (rms_norm_gated_rows.h's entry points)
_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
             ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_int,
             ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
#: the library's dtype names needing a CPU feature of their own (``loader.dtypes``); fp32 needs none
_FEATURE_GATED = {"bf16", "fp16"}
#: each build's exp: torch's Sleef exp of its vector width, the one ATen's kernels for that
#: instruction set call (``Sleef_expf8_u10`` is SLEEF's dispatcher, as ATen calls it)
_EXP_SYMBOLS = {"avx512": "Sleef_expf16_u10", "avx2": "Sleef_expf8_u10"}
#: the gate's forms (rms_norm_gated_rows.h)
_SILU, _SIGMOID, _SWISH_PRODUCT = 0, 1, 2
_empty = torch.empty  # the output's allocator (tests poison it)

#: dtype -> the entry point, filled on first use; None until then
_entries: dict[torch.dtype, Any] | None = None
#: the address of torch's exp for the loaded build, found with the entry points
_exp: int | None = None


def torch_exp(symbol: str) -> int | None:
    """The address of ``symbol`` in the loaded libtorch_cpu, or None (logged) where that library
    or the symbol is missing (another torch build)."""
    path = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        return ctypes.cast(getattr(ctypes.CDLL(str(path)), symbol), ctypes.c_void_p).value
    except (OSError, AttributeError) as e:
        log.info("customop: no %s in %s (%s); the gated RMSNorms run their compiled tier instead of the native "
                 "kernel", symbol, path, e)
        return None


def entries() -> dict[torch.dtype, Any]:
    """The kernel's entry point per dtype it runs on this machine (empty without the library or
    without torch's exp)."""
    global _entries, _exp
    if _entries is None:
        lib = loader.library()
        exp = torch_exp(_EXP_SYMBOLS[loader.loaded.isa]) if lib is not None else None
        found = {}
        for dtype, name in _NAMES.items():
            if exp is not None and (name not in _FEATURE_GATED or name in loader.dtypes):
                fn = getattr(lib, f"customop_rms_norm_gated_{name}")
                fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
                found[dtype] = fn
        _entries, _exp = found, exp
    return _entries


def reset() -> None:
    """Forgets the entry points and the library (tests)."""
    global _entries, _exp
    _entries, _exp = None, None
    loader.reset()


def _gate_stride(z: torch.Tensor | None, x: torch.Tensor, n: int) -> int | None:
    """z's row stride (0 without z), or None where the kernel cannot read z as x's rows."""
    if z is None:
        return 0
    if z.dtype != x.dtype or z.shape != x.shape or not _plain(z):
        return None
    return _row_stride(z, n)


def _run(x: torch.Tensor, weight: torch.Tensor | None, z: torch.Tensor | None, eps: float, group_size: int,
         norm_before_gate: bool, act: int) -> torch.Tensor | None:
    """The kernel on the spec's arguments, or None (not taken)."""
    fn = (_entries if _entries is not None else entries()).get(x.dtype)
    if fn is None or not _plain(x) or x.dim() == 0:
        return None
    if weight is not None and (not _plain(weight) or weight.dtype not in (x.dtype, torch.float32)):
        return None
    n = x.shape[-1]
    rows = x.numel() // n if n else 0
    if rows == 0 or group_size <= 0 or n % group_size:
        return None
    if weight is not None and (weight.shape != (n,) or weight.stride(0) != 1):
        return None
    x_stride, z_stride = _row_stride(x, n), _gate_stride(z, x, n)
    if x_stride is None or z_stride is None:
        return None
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, z)):
        return None  # the kernel's output has no backward
    if intercepted():
        return None
    out = _empty(x.shape, dtype=x.dtype)
    if fn(x.data_ptr(), x_stride, None if z is None else z.data_ptr(), z_stride,
          None if weight is None else weight.data_ptr(), weight is not None and weight.dtype == torch.float32,
          out.data_ptr(), rows, n, group_size, eps, norm_before_gate, act, _exp, torch.get_num_threads()):
        return None  # out of memory for its scratch
    return out


def rms_norm_gated(x: torch.Tensor, weight: torch.Tensor, z: torch.Tensor | None, eps: float, group_size: int,
                   norm_before_gate: bool, sigmoid: bool) -> torch.Tensor | None:
    """``customop.math.layernorm.rms_norm_gated``, or None (not taken)."""
    return _run(x, weight, z, eps, group_size, norm_before_gate, _SIGMOID if sigmoid else _SILU)


def fused_rms_norm_gated(x: torch.Tensor, g: torch.Tensor, weight: torch.Tensor | None, eps: float,
                         sigmoid: bool) -> torch.Tensor | None:
    """``customop.math.layernorm.fused_rms_norm_gated``, or None (not taken): whole rows, the gate
    after the norm."""
    n = x.shape[-1] if x.dim() else 0
    return _run(x, weight, g, eps, n, True, _SIGMOID if sigmoid else _SWISH_PRODUCT)
