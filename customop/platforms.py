"""Platforms: what the process runs on, found lazily, without importing any optional backend.

Detection only *looks* for triton, jax, torch_xla and IPEX (``importlib.util.find_spec``); the
backend packages import them on first use. Order:

1. ``CUSTOMOP_PLATFORM`` forces a built-in (``cuda|rocm|xpu|tpu|cpu``) or a platform plugin by
   its entry-point name. A forced platform that cannot run here raises (never a silent fallback).
2. Platform plugins (entry-point group ``customop.platform_plugins``): each is a function that
   returns a ``"module:Class"`` / ``"module.Class"`` path or None. One active plugin wins over the
   built-ins; two raise.
3. Built-ins: a CUDA or ROCm device, an XPU device, a TPU (torch_xla plus libtpu), else the CPU.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import logging
import os
import threading

import torch

from customop import plugins
from customop.backend_loader import BACKENDS

logger = logging.getLogger("customop")

ENV_PLATFORM = "CUSTOMOP_PLATFORM"


class PlatformEnum(enum.Enum):
    CUDA = "cuda"
    ROCM = "rocm"
    XPU = "xpu"
    TPU = "tpu"
    CPU = "cpu"
    OOT = "oot"
    UNSPECIFIED = "unspecified"


def _missing(*modules: str) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


class Platform:
    """One platform. Subclass it for an out-of-tree platform and set ``name`` (``_enum`` is OOT)."""

    _enum: PlatformEnum = PlatformEnum.UNSPECIFIED
    name: str = "unspecified"
    device_type: str = "cpu"
    dist_backend: str = "gloo"
    #: The ``CustomOp`` method an *enabled* op runs here (a table entry, never an if-chain).
    forward_method: str = "forward_native"
    #: The ``customop.backends.<name>`` package an enabled op loads at construction (None: none);
    #: what it needs and which extra brings it are read from ``backend_loader.BACKENDS``.
    backend: str | None = None

    @classmethod
    def missing_backend_modules(cls) -> str | None:
        """Why this platform's backend cannot import (its modules absent, with the extra to
        install), or None; only looks for the modules (``find_spec``), imports nothing."""
        if cls.backend is None:
            return None
        spec = BACKENDS[cls.backend]
        if missing := spec.missing():
            return f"missing {missing}: {spec.how_to_install()}"
        return None

    def is_cuda(self) -> bool:
        return self._enum is PlatformEnum.CUDA

    def is_rocm(self) -> bool:
        return self._enum is PlatformEnum.ROCM

    def is_cuda_alike(self) -> bool:
        return self._enum in (PlatformEnum.CUDA, PlatformEnum.ROCM)

    def is_xpu(self) -> bool:
        return self._enum is PlatformEnum.XPU

    def is_tpu(self) -> bool:
        return self._enum is PlatformEnum.TPU

    def is_cpu(self) -> bool:
        return self._enum is PlatformEnum.CPU

    def is_out_of_tree(self) -> bool:
        return self._enum is PlatformEnum.OOT

    def is_unspecified(self) -> bool:
        return self._enum is PlatformEnum.UNSPECIFIED

    def fp8_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    def use_all_gather(self) -> bool:
        """Whether logits are all-gathered (True) or gathered to rank 0 (False) under TP."""
        return True

    @classmethod
    def is_present(cls) -> bool:
        """Whether this platform's hardware is visible (used by automatic detection)."""
        return False

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this platform cannot run here, or None. Forcing an unavailable platform raises."""
        return None

    @classmethod
    def cannot_force(cls) -> str | None:
        """Why ``CUSTOMOP_PLATFORM=<this>`` cannot run here, or None (default: the same as
        ``unavailable_reason``)."""
        return cls.unavailable_reason()

    def backend_unavailable(self) -> str | None:
        """``unavailable_reason()`` computed once per platform object (it probes the filesystem)."""
        if not hasattr(self, "_unavailable"):
            self._unavailable = type(self).unavailable_reason()
        return self._unavailable

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class CudaPlatform(Platform):
    backend = "cuda"
    _enum = PlatformEnum.CUDA
    name = device_type = "cuda"
    dist_backend = "nccl"
    forward_method = "forward_cuda"

    @classmethod
    def is_present(cls) -> bool:
        return torch.version.hip is None and torch.cuda.is_available()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not cls.is_present():
            return "no CUDA device is visible (torch.cuda.is_available() is False or torch is a HIP build)"
        return cls.missing_backend_modules()


class RocmPlatform(CudaPlatform):
    backend = "rocm"
    _enum = PlatformEnum.ROCM
    name = "rocm"
    device_type = "cuda"  # HIP devices appear as "cuda" tensors in torch
    forward_method = "forward_hip"

    @classmethod
    def is_present(cls) -> bool:
        return torch.version.hip is not None and torch.cuda.is_available()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not cls.is_present():
            return "no ROCm device is visible (torch.version.hip is None or no device)"
        return cls.missing_backend_modules()

    def fp8_dtype(self) -> torch.dtype:
        from customop.math.fp8 import fp8_dtype_for_arch

        arch = getattr(torch.cuda.get_device_properties(0), "gcnArchName", "")
        return fp8_dtype_for_arch(arch)


class XpuPlatform(Platform):
    backend = "xpu"
    _enum = PlatformEnum.XPU
    name = device_type = "xpu"
    dist_backend = "xccl"
    forward_method = "forward_xpu"

    @classmethod
    def is_present(cls) -> bool:
        return hasattr(torch, "xpu") and torch.xpu.is_available()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        # The XPU backend degrades IPEX -> Triton -> compiled native by itself: its dispatch
        # needs only torch (ops run on whatever tensors they are given, e.g. IPEX's CPU build).
        return None

    @classmethod
    def cannot_force(cls) -> str | None:
        # ...but forcing the platform promises XPU tensors: without a device it cannot run here.
        if not cls.is_present():
            return "no XPU device is visible (torch.xpu.is_available() is False)"
        return None


class TpuPlatform(Platform):
    backend = "tpu"
    _enum = PlatformEnum.TPU
    name = "tpu"
    device_type = "xla"
    dist_backend = "xla"
    forward_method = "forward_tpu"

    @classmethod
    def is_present(cls) -> bool:
        return not _missing("torch_xla") and (
            not _missing("libtpu") or os.environ.get("PJRT_DEVICE", "").upper() == "TPU"
        )

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return cls.missing_backend_modules()

    def use_all_gather(self) -> bool:
        return False


class CpuPlatform(Platform):
    backend = "cpu"
    _enum = PlatformEnum.CPU
    name = device_type = "cpu"
    forward_method = "forward_cpu"

    @classmethod
    def is_present(cls) -> bool:
        return True


class UnspecifiedPlatform(Platform):
    pass


BUILTIN_PLATFORMS: dict[str, type[Platform]] = {
    p.name: p for p in (CudaPlatform, RocmPlatform, XpuPlatform, TpuPlatform, CpuPlatform)
}
# Automatic detection order; the CPU is the fallback, checked last.
_DETECTION_ORDER = ("cuda", "rocm", "xpu", "tpu", "cpu")

_lock = threading.Lock()
_current: Platform | None = None


def _load_class(path: object, plugin: str) -> type[Platform]:
    """The Platform subclass a platform plugin named by its ``"module:Class"`` path."""
    where = f"platform plugin {plugin!r} (entry-point group {plugins.PLATFORM_PLUGINS_GROUP!r})"
    if not isinstance(path, str):
        raise TypeError(f"{where} returned {path!r}; it must return a 'module:Class' path string or None")
    module, _, attr = path.replace(":", ".").rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise RuntimeError(f"{where} returned {path!r}, which cannot be loaded: {err}") from err
    if not (isinstance(cls, type) and issubclass(cls, Platform)):
        raise TypeError(f"{where} returned {path!r}, which is not a customop Platform subclass")
    return cls


def _activated_plugins() -> dict[str, str]:
    activated = {}
    for name, fn in plugins.load_plugins_by_group(plugins.PLATFORM_PLUGINS_GROUP).items():
        try:
            path = fn()
        except Exception:  # a broken third-party plugin must not take the process down
            logger.warning("platform plugin %r raised; ignoring it", name, exc_info=True)
            continue
        if path:
            activated[name] = path
    return activated


def _forced(name: str) -> Platform:
    if name in BUILTIN_PLATFORMS:
        cls = BUILTIN_PLATFORMS[name]
        if reason := cls.cannot_force():
            raise RuntimeError(f"{ENV_PLATFORM}={name} was requested but cannot run here: {reason}")
        return cls()
    fns = plugins.load_plugins_by_group(plugins.PLATFORM_PLUGINS_GROUP)
    if name not in fns:
        known = sorted(BUILTIN_PLATFORMS) + sorted(fns)
        raise RuntimeError(f"{ENV_PLATFORM}={name!r} is not a known platform; known: {known}")
    path = fns[name]()
    if not path:
        raise RuntimeError(f"{ENV_PLATFORM}={name!r}: its platform plugin is not active on this machine")
    return _load_class(path, name)()


def detect() -> Platform:
    """Runs detection now (no caching); ``current_platform()`` caches its result."""
    forced = os.environ.get(ENV_PLATFORM, "").strip().lower()
    if forced:
        return _forced(forced)
    activated = _activated_plugins()
    if len(activated) > 1:
        raise RuntimeError(f"only one platform plugin can be active, found {sorted(activated)}")
    if activated:
        (name, path), = activated.items()
        return _load_class(path, name)()
    for name in _DETECTION_ORDER:
        cls = BUILTIN_PLATFORMS[name]
        if cls.is_present():
            return cls()
    return UnspecifiedPlatform()


def current_platform() -> Platform:
    """The platform of this process, detected on first call and cached."""
    global _current
    if _current is None:
        with _lock:
            if _current is None:
                _current = detect()
                logger.debug("customop platform: %s", _current.name)
    return _current


def set_current_platform(platform: Platform | None) -> None:
    """Replaces the cached platform (``None`` re-detects on next use). Meant for tests and launchers."""
    global _current
    _current = platform
