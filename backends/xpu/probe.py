"""What the XPU backend can use in this process, found without importing IPEX or Triton.

IPEX must not be imported to learn whether it fits: with a torch whose major.minor differs from
its own, ``import intel_extension_for_pytorch`` prints an error and calls ``exit(127)``, which
would end the process (its ``__init__`` compares the two versions before anything else). So the
versions come from the installed distributions' metadata, and the import is tried only once both
fit (``chain.py`` does it and treats any failure, ``SystemExit`` included, as "no IPEX").

Only IPEX's *XPU* build has kernels for XPU tensors. PyPI's wheel is the CPU build
(``2.8.0+cpu``); the XPU build (``2.8.10+xpu``) comes from Intel's own index. The build is read
from the local label of the version that the package's generated ``_version.py`` holds (the
distribution metadata says only ``2.8.0``), read as text, not imported.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import re

import torch

IPEX_MODULE = "intel_extension_for_pytorch"
IPEX_DIST = "intel-extension-for-pytorch"


def major_minor(version: str) -> str | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return f"{match.group(1)}.{match.group(2)}" if match else None


@dataclasses.dataclass(frozen=True)
class XpuEnvironment:
    """The facts the provider chain is chosen from. Tests build one by hand."""

    torch_version: str
    #: The installed IPEX distribution's version (e.g. "2.8.10+xpu"), or None when absent.
    ipex_version: str | None = None
    #: Whether Triton with Intel's backend can launch kernels on an XPU device here.
    triton_xpu: bool = False
    triton_reason: str = "not probed"
    xpu_device: bool = False

    @property
    def ipex_build(self) -> str | None:
        """"xpu", "cpu" or None (no local label, e.g. a source build)."""
        if self.ipex_version is None or "+" not in self.ipex_version:
            return None
        label = self.ipex_version.split("+", 1)[1].lower()
        return "xpu" if "xpu" in label else "cpu" if "cpu" in label else None

    def ipex_unusable(self) -> str | None:
        """Why IPEX cannot serve XPU tensors here (None: it may, if it imports)."""
        if self.ipex_version is None:
            return f"{IPEX_DIST} is not installed"
        ipex_mm, torch_mm = major_minor(self.ipex_version), major_minor(self.torch_version)
        if ipex_mm is None or ipex_mm != torch_mm:
            return (f"IPEX {self.ipex_version} needs torch {ipex_mm}.*, found torch {self.torch_version} "
                    f"(importing it would exit the process)")
        if self.ipex_build == "cpu":
            return f"IPEX {self.ipex_version} is the CPU build: it has no kernels for XPU tensors"
        return None


def _ipex_version() -> str | None:
    # find_spec first: a test (or a user) may block the module with sys.modules[name] = None, and
    # metadata would still report the distribution on disk.
    spec = importlib.util.find_spec(IPEX_MODULE)
    if spec is None:
        return None
    for root in spec.submodule_search_locations or ():
        for name in ("_version.py", "version.py"):  # 2.x writes _version.py; older releases version.py
            try:
                with open(os.path.join(root, name), encoding="utf-8") as f:
                    match = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", f.read(), re.MULTILINE)
            except OSError:
                continue
            if match:
                return match.group(1)
    try:
        return importlib.metadata.version(IPEX_DIST)
    except importlib.metadata.PackageNotFoundError:
        return None


def _triton_xpu(xpu_device: bool) -> tuple[bool, str]:
    """Triton can drive an Intel GPU when its Intel backend is installed (PyTorch's XPU wheels
    bring it as pytorch-triton-xpu) and an XPU device is visible. Looked up on disk: importing
    triton costs seconds and ``import customop`` must not do it."""
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return False, "triton is not installed"
    roots = list(spec.submodule_search_locations)
    if not any(os.path.isdir(os.path.join(root, "backends", "intel")) for root in roots):
        return False, "the installed triton has no Intel backend: it is not pytorch-triton-xpu"
    if not xpu_device:
        return False, "no XPU device is visible (torch.xpu.is_available() is False)"
    return True, "triton with the Intel backend and an XPU device"


def probe() -> XpuEnvironment:
    """The real environment (cheap: metadata and ``find_spec`` only)."""
    xpu_device = hasattr(torch, "xpu") and torch.xpu.is_available()
    triton_ok, triton_reason = _triton_xpu(xpu_device)
    return XpuEnvironment(torch_version=torch.__version__, ipex_version=_ipex_version(),
                          triton_xpu=triton_ok, triton_reason=triton_reason, xpu_device=xpu_device)
