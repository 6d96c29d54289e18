"""The built-in backends as data: what each needs, which extra brings it, and how to load it.

``BACKENDS`` is the one table of these facts: ``Platform`` (its ``backend`` names a row),
``customop info`` and the error messages read it, and a test checks it against pyproject.toml's
extras. Probing only looks for modules (``find_spec``); ``load_backend`` imports on first use and
turns a missing optional dependency into an error that names the extra to install.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from types import ModuleType

import torch


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    name: str
    requires: tuple[str, ...]
    extra: str | None
    description: str
    #: (module, torch version prefix): when ``module`` is installed it works only with that torch
    #: (IPEX and torch_xla each pin one torch release); ``status`` warns on a mismatch.
    torch_pin: tuple[str, str] | None = None
    #: how to get the missing modules, when not by this backend's extra
    install_hint: str | None = None

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"BackendSpec: name {self.name!r} must be an identifier")

    def missing(self) -> list[str]:
        return [m for m in self.requires if importlib.util.find_spec(m) is None]

    def how_to_install(self) -> str:
        return self.install_hint or f"pip install customop[{self.extra}]"

    def torch_mismatch(self) -> str | None:
        """Why the installed torch does not fit this backend's pinned dependency, or None."""
        if self.torch_pin is None:
            return None
        module, version = self.torch_pin
        if importlib.util.find_spec(module) is None or torch.__version__.startswith(version):
            return None
        return (f"{module} works only with torch {version}.*, but torch {torch.__version__} is installed "
                f"(pip install customop[{self.extra}] installs the matching pair)")

    def status(self) -> tuple[bool, str]:
        """(importable, why) without importing anything optional."""
        if missing := self.missing():
            return False, f"missing {', '.join(missing)} ({self.how_to_install()})"
        why = "dependencies present: " + (", ".join(self.requires) or "torch only")
        if mismatch := self.torch_mismatch():
            why += f"; warning: {mismatch}"
        return True, why


BACKENDS: dict[str, BackendSpec] = {
    spec.name: spec
    for spec in (
        BackendSpec("triton", ("triton",), "cuda", "device-neutral Triton kernels (CUDA, ROCm, XPU)"),
        BackendSpec("cuda", ("triton",), "cuda", "NVIDIA GPUs: Triton kernels and CUDA specifics"),
        BackendSpec("rocm", ("triton",), "rocm", "AMD GPUs: Triton kernels, fnuz fp8, wave-64 tuning",
                    install_hint="ROCm's torch wheels bring Triton (pytorch-triton-rocm): install torch for ROCm"),
        BackendSpec("xpu", (), "xpu", "Intel GPUs: IPEX when present, else Triton on XPU tensors",
                    torch_pin=("intel_extension_for_pytorch", "2.8")),
        # torchax is needed by call_jax and imports flax; torch_xla declares neither
        BackendSpec("tpu", ("torch_xla", "jax", "torchax", "flax"), "tpu", "TPUs: JAX Pallas kernels through torch_xla",
                    torch_pin=("torch_xla", "2.9")),
        BackendSpec("cpu", (), None, "CPUs: compiled native code, oneDNN, IPEX CPU when present"),
    )
}


_loaded: dict[str, ModuleType] = {}


def load_platform_backend() -> ModuleType | None:
    """Loads the current platform's backend, if it has one that can import here (else None).

    For code outside ``CustomOp`` that calls ``torch.ops.customop.*`` directly; ops get this at
    construction (``CustomOp.dispatch_forward``), with the fallback and error rules there.
    """
    from customop.platforms import current_platform

    platform = current_platform()
    if platform.backend is None or platform.backend_unavailable() is not None:
        return None
    return load_backend(platform.backend)


def load_backend(name: str) -> ModuleType:
    """Imports ``customop.backends.<name>``; a missing dependency raises naming the extra.

    Once loaded it is a dict lookup, which dynamo traces without a graph break (it cannot trace
    ``importlib``). ``CustomOp`` loads its platform's backend when it resolves dispatch, i.e. at
    construction and outside any trace, so ``forward_<platform>`` may call this freely.
    """
    module = _loaded.get(name)
    if module is not None:
        return module
    if name not in BACKENDS:
        raise ValueError(f"customop: unknown backend {name!r}; known: {sorted(BACKENDS)}")
    spec = BACKENDS[name]
    try:
        module = _loaded[name] = importlib.import_module(f"customop.backends.{name}")
        return module
    except ModuleNotFoundError as err:
        if err.name and err.name.split(".")[0] in spec.requires:
            raise ImportError(f"customop backend {name!r} needs {err.name!r}: {spec.how_to_install()}") from err
        raise
