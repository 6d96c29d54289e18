"""Suite-wide setup. On a machine without a GPU, TRITON_INTERPRET must be set before any kernel
module is imported (research/kernel-testing-on-cpu.md): the interpreter is chosen when @triton.jit
decorates. On a GPU machine (`pytest -m cuda` on the H200) the real compiler must run."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

import customop  # noqa: E402
from customop import platforms  # noqa: E402


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
