"""Suite-wide setup: the Triton mode, the tier markers, state isolation and output poisoning.

Tiers are markers (listed in pyproject.toml): ``python -m pytest`` runs every test whose
environment this machine has and skips the others here, with the reason (``pytest_runtest_setup``);
``pytest -m cuda`` is the H200 tier, ``pytest -m interpret`` the Triton-interpreter tests alone,
``pytest -m "not slow"`` a quick local run.

Triton chooses between compiling and interpreting when ``@triton.jit`` decorates, i.e. when a
kernel module is imported, so the mode is fixed here, once per session, before any test module
imports a kernel: interpreted (``TRITON_INTERPRET=1``) on a machine without a CUDA GPU, compiled
on one (unless ``TRITON_INTERPRET=1`` is set by hand). ``interpret`` tests need the first,
``cuda`` tests the second; one session never has both.
"""

import importlib.util
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

import customop  # noqa: E402
from customop import platforms  # noqa: E402


def triton_interpreted() -> bool:
    """Whether this session's Triton kernels run under the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _cuda() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (the H200 tier: pytest -m cuda)"
    if triton_interpreted():
        return "TRITON_INTERPRET=1 in this session: the kernels would run interpreted"
    return None


def _interpret() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (the test extra installs it)"
    if not triton_interpreted():
        return "the Triton kernels are compiled for the GPU in this session (TRITON_INTERPRET is not 1)"
    return None


def _module(name: str, reason: str):
    return lambda: None if importlib.util.find_spec(name) is not None else reason


#: marker -> () -> why this machine cannot run the marked tests (None: it can)
ENVIRONMENTS = {
    "cuda": _cuda,
    "interpret": _interpret,
    "xla": _module("torch_xla", "needs torch_xla (the tpu tier: bash .ci/tpu.sh)"),
    "ipex": _module("intel_extension_for_pytorch", "needs intel-extension-for-pytorch (the xpu tier: bash .ci/xpu.sh)"),
    "tpu_hw": _module("libtpu", "needs a real TPU (libtpu is not installed)"),
}


def pytest_runtest_setup(item):
    for marker, missing in ENVIRONMENTS.items():
        if item.get_closest_marker(marker) is not None:
            reason = missing()
            if reason:
                pytest.skip(reason)


@pytest.fixture(autouse=True)
def _isolate_global_state(monkeypatch):
    """Each test starts from the environment default config and re-detects the platform."""
    for var in ("CUSTOMOP_CUSTOM_OPS", "CUSTOMOP_PLATFORM", "CUSTOMOP_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    previous = platforms._current
    customop.set_config(None)
    yield
    customop.set_config(None)
    platforms.set_current_platform(previous)


def _poisoned(factory):
    def make(*args, **kwargs):
        t = factory(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    return make


@pytest.fixture
def poison_empty(monkeypatch):
    """Fresh ``torch.empty``/``empty_like`` tensors are NaN (their contents are undefined anyway),
    so an output lane a kernel forgot to write shows up."""
    monkeypatch.setattr(torch, "empty", _poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", _poisoned(torch.empty_like))
    yield
