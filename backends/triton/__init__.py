"""Device-neutral Triton kernels shared by the cuda, rocm and xpu backends.

Each kernel module (``activation``, ``layernorm``, ``rotary``, ``quant``, ...) holds ``@triton.jit``
kernels plus their launchers (or, where that grew past one file, imports its kernels from a private
``_<family>_kernels`` module, which the collector below skips), and exports ``KERNELS``: a dict from a ``customop::<op>`` name to
the launcher implementing that op's schema. Launchers allocate outputs on the input's own device
and never sync with the host. A platform backend registers them for its device type with
``register_for(device_type)``.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import Any

import torch

_registered: set[str] = set()


def kernels() -> dict[str, Callable[..., Any]]:
    """All launchers by op name, collected from every kernel module in this package."""
    table: dict[str, Callable[..., Any]] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for op_name, launcher in getattr(module, "KERNELS", {}).items():
            if op_name in table:
                raise RuntimeError(f"two Triton kernels claim {op_name}")
            table[op_name] = launcher
    return table


def register_for(device_type: str) -> None:
    """Registers every launcher as the ``device_type`` kernel of its ``customop::`` op (once)."""
    if device_type in _registered:
        return
    import customop.ops._library  # noqa: F401  (defines the customop:: ops)

    for op_name, launcher in kernels().items():
        torch.library.register_kernel(op_name, device_type, launcher)
    _registered.add(device_type)
