"""``rms_norm_gated`` (Mamba-2's grouped gated RMSNorm, ``RMSNormGated``) through the hand-written
kernel (``rms_norm_gated.c``, in the AVX-512 build only): the spec's arguments in, its result out
(a new tensor), or None for a call the kernel does not take, which then runs the other tiers.
Taken: bf16 (where the CPU has AVX512_BF16), fp16 or fp32 x with z of x's dtype and shape (or none)
and a weight of x's dtype or fp32, a group size dividing the width, plain CPU tensors whose rows
have unit stride (contiguous, or 2-D with any row stride), autograd not recording, nothing
intercepting torch calls (modes, transforms, tracing, autocast); and only where torch's own
vectorised exp (``Sleef_expf16_u10`` in libtorch_cpu, the one ATen's silu and sigmoid call) can be
found for the kernel to call, so that its gate is bitwise ATen's."""

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

#: x, its row stride, z, its row stride, weight, weight is fp32, out, rows, width, group size, eps,
#: norm_before_gate, sigmoid, exp, threads (rms_norm_gated.c's entry points)
_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
             ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_int,
             ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
#: the library's dtype names needing a CPU feature of their own (``loader.dtypes``); fp32 needs none
_FEATURE_GATED = {"bf16", "fp16"}
_EXP_SYMBOL = "Sleef_expf16_u10"
_empty = torch.empty  # the output's allocator (tests poison it)

#: dtype -> the entry point, filled on first use; None until then
_entries: dict[torch.dtype, Any] | None = None
#: the address of torch's 16-lane exp, found with the entry points
_exp16: int | None = None


def torch_exp16() -> int | None:
    """The address of ``Sleef_expf16_u10`` in the loaded libtorch_cpu, or None (logged) where that
    library or the symbol is missing (another torch build)."""
    path = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        return ctypes.cast(getattr(ctypes.CDLL(str(path)), _EXP_SYMBOL), ctypes.c_void_p).value
    except (OSError, AttributeError) as e:
        log.info("customop: no %s in %s (%s); rms_norm_gated runs its compiled tier instead of the native "
                 "kernel", _EXP_SYMBOL, path, e)
        return None


def entries() -> dict[torch.dtype, Any]:
    """The kernel's entry point per dtype it runs on this machine (empty without the library or
    without torch's exp)."""
    global _entries, _exp16
    if _entries is None:
        lib = loader.library()
        exp16 = torch_exp16() if lib is not None and "rms_norm_gated" in loader.loaded.kernels else None
        found = {}
        for dtype, name in _NAMES.items():
            if exp16 is not None and (name not in _FEATURE_GATED or name in loader.dtypes):
                fn = getattr(lib, f"customop_rms_norm_gated_{name}")
                fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
                found[dtype] = fn
        _entries, _exp16 = found, exp16
    return _entries


def reset() -> None:
    """Forgets the entry points and the library (tests)."""
    global _entries, _exp16
    _entries, _exp16 = None, None
    loader.reset()


def _gate_stride(z: torch.Tensor | None, x: torch.Tensor, n: int) -> int | None:
    """z's row stride (0 without z), or None where the kernel cannot read z as x's rows."""
    if z is None:
        return 0
    if z.dtype != x.dtype or z.shape != x.shape or not _plain(z):
        return None
    return _row_stride(z, n)


def rms_norm_gated(x: torch.Tensor, weight: torch.Tensor, z: torch.Tensor | None, eps: float, group_size: int,
                   norm_before_gate: bool, sigmoid: bool) -> torch.Tensor | None:
    """``customop.math.layernorm.rms_norm_gated``, or None (not taken)."""
    fn = (_entries if _entries is not None else entries()).get(x.dtype)
    if fn is None or not _plain(x) or not _plain(weight) or x.dim() == 0:
        return None
    if weight.dtype != x.dtype and weight.dtype != torch.float32:
        return None
    n = x.shape[-1]
    rows = x.numel() // n if n else 0
    if rows == 0 or weight.shape != (n,) or weight.stride(0) != 1 or group_size <= 0 or n % group_size:
        return None
    x_stride, z_stride = _row_stride(x, n), _gate_stride(z, x, n)
    if x_stride is None or z_stride is None:
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (z is not None and z.requires_grad)):
        return None  # the kernel's output has no backward
    if intercepted():
        return None
    out = _empty(x.shape, dtype=x.dtype)
    if fn(x.data_ptr(), x_stride, None if z is None else z.data_ptr(), z_stride, weight.data_ptr(),
          weight.dtype == torch.float32, out.data_ptr(), rows, n, group_size, eps, norm_before_gate, sigmoid,
          _exp16, torch.get_num_threads()):
        return None  # out of memory for its scratch
    return out
