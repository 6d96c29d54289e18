"""The provider chain: which implementation each ``customop::`` op runs on XPU tensors.

Order of preference, per op, decided once per process (``install``) from ``probe.probe()``:

1. ``ipex``: IPEX's fused kernel (``ipex_ops.py``), when IPEX's XPU build is installed for the
   running torch's major.minor, imports, and has the op's function;
2. ``triton``: the shared launcher from ``customop.backends.triton``, when Triton has its Intel
   backend and an XPU device is visible (the kernel source is the CUDA one);
3. ``compiled``: ``torch.compile`` of the op's reference body. Inductor's XPU code *is* Triton,
   so this needs what (2) needs; it serves ops without a Triton kernel;
4. ``eager``: the reference body as is (the op library's default, which runs on any device).

An IPEX kernel that cannot take some arguments (``ipex_ops`` says which) hands that call to the
op's next provider, also chosen here. Every op gets one trampoline registered as its ``xpu``
kernel, so a later ``install`` (tests) re-points it without re-registering.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from customop.backends.xpu import ipex_ops
from customop.backends.xpu.probe import IPEX_MODULE, XpuEnvironment, probe

PROVIDERS = ("ipex", "triton", "compiled", "eager")


@dataclasses.dataclass(frozen=True)
class Choice:
    """What one op runs on XPU tensors, and why."""

    op: str
    provider: str
    detail: str
    kernel: Callable[..., Any]
    #: The provider for calls the first one cannot take (IPEX's unsupported arguments), or None.
    fallback: str | None = None

    def __post_init__(self) -> None:
        if self.provider not in PROVIDERS or self.fallback not in (None, *PROVIDERS):
            raise ValueError(f"Choice({self.op}): providers must be among {PROVIDERS}")


@dataclasses.dataclass(frozen=True)
class Resolution:
    env: XpuEnvironment
    ipex_note: str  # "used: ..." or why IPEX is not used
    triton_note: str
    choices: dict[str, Choice]


def import_ipex() -> ModuleType:
    """``import intel_extension_for_pytorch`` (seconds; prints its own warnings). Tests replace it."""
    import importlib

    return importlib.import_module(IPEX_MODULE)


def library_bodies() -> dict[str, Callable[..., Any]]:
    """Every ``customop::`` op and its reference body (the function given to ``custom_op``).

    torch keeps them in a private registry (``torch._library.custom_ops.OPDEFS``, present from
    2.4 through 2.13); without it the chain still registers the ops it has kernels for."""
    import customop.ops._library  # noqa: F401  (defines the customop:: ops)

    try:
        from torch._library.custom_ops import OPDEFS
    except ImportError:
        return {}
    return {name: opdef._init_fn for name, opdef in OPDEFS.items()
            if name.startswith("customop::") and getattr(opdef, "_init_fn", None) is not None}


def triton_kernels() -> dict[str, Callable[..., Any]]:
    from customop.backends import triton as shared_triton

    return shared_triton.kernels()


@functools.cache
def _compile(body: Callable[..., Any]) -> Callable[..., Any]:
    """One ``torch.compile`` of each reference body for the process (re-resolutions reuse it)."""
    return torch.compile(body)


def _compiled(body: Callable[..., Any]) -> Callable[..., Any]:
    """The ``compiled`` provider's kernel: compiles ``body`` on its first call, not at install."""

    def kernel(*args: Any) -> Any:
        return _compile(body)(*args)

    return kernel


def _load_ipex(env: XpuEnvironment) -> tuple[ModuleType | None, str]:
    if reason := env.ipex_unusable():
        return None, reason
    try:
        ipex = import_ipex()
        ipex.llm.functional  # noqa: B018  (the namespace every mapping uses; absent -> AttributeError)
        return ipex, f"used: IPEX {env.ipex_version}"
    # IPEX's import ends the process with exit(127) on a torch mismatch (SystemExit); probe.py
    # checks the versions first, and this keeps any other refusal from taking the process down.
    except (ImportError, OSError, RuntimeError, AttributeError, SystemExit) as err:
        return None, f"IPEX {env.ipex_version} failed to import: {type(err).__name__}: {err}"


def resolve(env: XpuEnvironment | None = None) -> Resolution:
    """Chooses every op's provider (imports IPEX or Triton only when they can serve XPU tensors)."""
    env = env or probe()
    ipex, ipex_note = _load_ipex(env)
    ipex_kernels = {}
    if ipex is not None:  # llm.modules: GatedMLPMOE
        ipex_kernels = ipex_ops.bind_all(ipex.llm.functional, getattr(ipex.llm, "modules", None))
    launchers: dict[str, Callable[..., Any]] = {}
    triton_note = env.triton_reason
    if env.triton_xpu:
        try:
            launchers = triton_kernels()
        except ImportError as err:
            triton_note = f"the Triton kernels failed to import: {err}"
    bodies = library_bodies()
    choices = {}
    for op in sorted(set(bodies) | set(launchers) | set(ipex_kernels)):
        candidates: list[tuple[str, str, Callable[..., Any]]] = []
        if op in ipex_kernels:
            call = ipex_kernels[op].call
            detail = call if call.startswith("ipex.") else "ipex.llm.functional." + call
            candidates.append(("ipex", detail, ipex_kernels[op].run))
        if op in launchers:
            candidates.append(("triton", "the shared Triton launcher", launchers[op]))
        if env.triton_xpu and op in bodies:
            candidates.append(("compiled", "torch.compile(the reference body)", _compiled(bodies[op])))
        if op in bodies:
            candidates.append(("eager", "the reference body, uncompiled", bodies[op]))
        provider, detail, kernel = candidates[0]
        fallback = None
        if provider == "ipex" and len(candidates) > 1:
            fallback = candidates[1][0]
            kernel = _with_fallback(ipex_kernels[op].supports, kernel, candidates[1][2])
        choices[op] = Choice(op, provider, detail, kernel, fallback)
    return Resolution(env, ipex_note, triton_note, choices)


def _with_fallback(supports: Callable[..., bool], first: Callable[..., Any],
                   second: Callable[..., Any]) -> Callable[..., Any]:
    def kernel(*args: Any) -> Any:
        return first(*args) if supports(*args) else second(*args)

    return kernel


# ---- the process-wide state: one resolution, one trampoline per op -------------------------------

_lock = threading.Lock()
_resolution: Resolution | None = None
_trampolines: set[str] = set()


def _trampoline(op: str) -> Callable[..., Any]:
    def xpu_kernel(*args: Any, **kwargs: Any) -> Any:
        return (_resolution or install()).choices[op].kernel(*args, **kwargs)

    xpu_kernel.__name__ = f"xpu_{op.split('::')[-1]}"
    return xpu_kernel


def install(env: XpuEnvironment | None = None) -> Resolution:
    """Resolves the chain (again, when tests pass their own ``env``) and registers each op's
    ``xpu`` kernel. Without ``env`` an existing resolution is kept: the choice is made once."""
    global _resolution
    with _lock:
        if _resolution is not None and env is None:
            return _resolution
        resolution = resolve(env)
        _resolution = resolution
        for op, choice in resolution.choices.items():
            if op not in _trampolines:
                torch.library.register_kernel(op, "xpu", _trampoline(op))
                _trampolines.add(op)
        return resolution


def reset() -> None:
    """Forgets the resolution (tests); the next ``install()`` probes the real environment."""
    global _resolution
    with _lock:
        _resolution = None


def choices() -> dict[str, Choice]:
    return install().choices


def describe() -> str:
    """The chain as ``customop info`` prints it: the environment, then one line per op."""
    resolution = install()
    env = resolution.env
    lines = [
        f"xpu backend (chosen once per process): torch {env.torch_version}, "
        f"XPU device: {'yes' if env.xpu_device else 'no'}",
        f"  IPEX: {resolution.ipex_note}",
        f"  Triton on XPU: {'yes' if env.triton_xpu else 'no'} ({resolution.triton_note})",
    ]
    width = max((len(op) for op in resolution.choices), default=0) - len("customop::")
    for op, choice in resolution.choices.items():
        name = op.removeprefix("customop::")
        also = f"; other arguments: {choice.fallback}" if choice.fallback else ""
        lines.append(f"  {name:<{width}}  {choice.provider:<8}  {choice.detail}{also}")
    return "\n".join(lines)
