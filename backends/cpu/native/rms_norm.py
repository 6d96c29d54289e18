"""``rms_norm``, ``fused_add_rms_norm`` and their Gemma forms through the hand-written kernel
(``rms_norm.c``): the specs' arguments in, the specs' results out (new tensors), or None for a call
the kernel does not take, which then runs the other tiers. Taken: bf16 or fp16 x (on AVX-512 CPUs
bf16 only where the CPU has AVX512_BF16; on AVX2 CPUs both, from ``rms_norm_avx2.c``) with a weight
of x's dtype or fp32, no variance subset, plain CPU tensors whose rows have unit stride
(contiguous, or 2-D with any row stride), autograd not recording, nothing intercepting torch calls
(modes, transforms, tracing, autocast)."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from customop.backends.cpu.native import loader
from customop.backends.cpu.standalone import intercepted

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # exact types: a subclass keeps its type through the spec
#: x, x's row stride, residual, its row stride, weight, weight is fp32, Gemma's 1 + w, out, new
#: residual, rows, width, eps, threads (rms_norm.c's entry points)
_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
             ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_float,
             ctypes.c_int]
_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_empty = torch.empty  # the outputs' allocator (tests poison it)

#: dtype -> the entry point, filled on first use; None until then
_entries: dict[torch.dtype, Any] | None = None


def entries() -> dict[torch.dtype, Any]:
    """The kernel's entry point per dtype it runs on this machine (empty without the library)."""
    global _entries
    if _entries is None:
        lib = loader.library()
        found = {}
        for dtype, name in _NAMES.items():
            if lib is not None and name in loader.dtypes:
                fn = getattr(lib, f"customop_rms_norm_{name}")
                fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
                found[dtype] = fn
        _entries = found
    return _entries


def reset() -> None:
    """Forgets the entry points and the library (tests)."""
    global _entries
    _entries = None
    loader.reset()


def _row_stride(t: torch.Tensor, n: int) -> int | None:
    """Elements between consecutive rows of ``t`` seen as ``[-1, n]``, or None when its rows are
    not unit-stride rows at a fixed distance."""
    if t.dim() == 2 and (t.stride(1) == 1 or n == 1):
        return t.stride(0)
    return n if t.is_contiguous() else None


def _plain(t: torch.Tensor) -> bool:
    return type(t) in _PLAIN and t.is_cpu and not t.is_neg()


def _call(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
          variance_size: int | None, plus_one: bool = False) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The kernel's outputs (out, new residual or None), or None. ``plus_one``: Gemma's form."""
    fn = (_entries if _entries is not None else entries()).get(x.dtype)
    if fn is None or weight is None or variance_size is not None or not _plain(x) or not _plain(weight) or x.dim() == 0:
        return None
    w32 = weight.dtype == torch.float32
    if not w32 and weight.dtype != x.dtype:
        return None
    n = x.shape[-1]
    rows = x.numel() // n if n else 0
    if rows == 0 or weight.shape != (n,) or weight.stride(0) != 1:
        return None
    x_stride = _row_stride(x, n)
    if x_stride is None:
        return None
    r_stride = 0
    if residual is not None:
        if residual.dtype != x.dtype or residual.shape != x.shape or not _plain(residual):
            return None
        r_stride = _row_stride(residual, n)
        if r_stride is None:
            return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (residual is not None and residual.requires_grad)):
        return None  # the kernel's outputs have no backward
    if intercepted():
        return None
    out = _empty(x.shape, dtype=x.dtype)
    r_out = None if residual is None else _empty(x.shape, dtype=x.dtype)
    if fn(x.data_ptr(), x_stride, None if residual is None else residual.data_ptr(), r_stride, weight.data_ptr(),
          w32, plus_one, out.data_ptr(), None if r_out is None else r_out.data_ptr(), rows, n, eps,
          torch.get_num_threads()):
        return None  # out of memory for its scratch
    return out, r_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             variance_size: int | None = None) -> torch.Tensor | None:
    """``customop.math.layernorm.rms_norm``, or None (not taken)."""
    got = _call(x, None, weight, eps, variance_size)
    return None if got is None else got[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float,
                       variance_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``customop.math.layernorm.fused_add_rms_norm``, or None (not taken)."""
    return _call(x, residual, weight, eps, variance_size)  # type: ignore[return-value]


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``customop.math.layernorm.gemma_rms_norm``, or None (not taken)."""
    got = _call(x, None, weight, eps, None, plus_one=True)
    return None if got is None else got[0]


def gemma_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``customop.math.layernorm.gemma_fused_add_rms_norm``, or None (not taken)."""
    return _call(x, residual, weight, eps, None, plus_one=True)  # type: ignore[return-value]
