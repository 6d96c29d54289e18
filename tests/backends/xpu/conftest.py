"""Fixtures of the xpu backend tests. Tests marked ``ipex`` need the real IPEX (the xpu tier's
venv: torch 2.8.0 + IPEX 2.8.0's CPU build) and are skipped where it cannot be imported, so the
main tier runs everything else: the mappings against the stand-ins in ``fake_ipex`` and the chain
with a hand-made environment."""

from __future__ import annotations

import functools

import pytest
import torch

from customop.backends.xpu import chain, probe
from tests.backends.xpu import fake_ipex


@functools.cache
def real_ipex():
    """The imported IPEX, or the reason it is not importable here (never imports a mismatched one:
    that would exit the process)."""
    env = probe.probe()
    if env.ipex_version is None:
        return None, "intel-extension-for-pytorch is not installed (the xpu tier installs it)"
    if probe.major_minor(env.ipex_version) != probe.major_minor(env.torch_version):
        return None, f"IPEX {env.ipex_version} does not fit torch {env.torch_version}"
    import intel_extension_for_pytorch

    return intel_extension_for_pytorch, ""


def pytest_runtest_setup(item):
    if item.get_closest_marker("ipex") is not None:
        module, reason = real_ipex()
        if module is None:
            pytest.skip(reason)


#: The IPEX namespaces a mapping test runs against: both stand-ins always, the real CPU build in
#: the xpu tier.
BUILDS = [pytest.param("fake-cpu", id="fake-cpu-build"), pytest.param("fake-xpu", id="fake-xpu-build"),
          pytest.param("real", id="real-cpu-build", marks=pytest.mark.ipex)]


@pytest.fixture(params=BUILDS)
def ipex_build(request):
    """``ipex`` (the top-level module or a stand-in) for each entry of ``BUILDS``."""
    if request.param == "real":
        return real_ipex()[0]
    return fake_ipex.cpu_build() if request.param == "fake-cpu" else fake_ipex.xpu_build()


@pytest.fixture
def restore_chain(monkeypatch):
    """Tests that install their own environment leave the real resolution behind them (after
    undoing their patches, which the real resolution must not see)."""
    yield
    monkeypatch.undo()
    chain.reset()
    chain.install()


def env(**overrides) -> probe.XpuEnvironment:
    """An environment of a machine with an XPU; by default IPEX's XPU build fitting torch 2.8."""
    fields = dict(torch_version="2.8.0+xpu", ipex_version="2.8.10+xpu", triton_xpu=False,
                  triton_reason="test: no Triton", xpu_device=True)
    fields.update(overrides)
    return probe.XpuEnvironment(**fields)


def xpu_kernel(op: str, *args):
    """Calls ``customop::<op>``'s registered XPU kernel on CPU tensors: the dispatcher's redispatch
    to the XPU key runs the kernel this backend registered, as an XPU tensor would."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.XPU)
    return getattr(torch.ops.customop, op).default.redispatch(keys, *args)
