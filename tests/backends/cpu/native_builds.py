"""Shared by the native-kernel tests: the builds this CPU runs, and a fixture that runs a test
once on each of them."""

from __future__ import annotations

from types import ModuleType

import pytest

from customop.backends.cpu.native import loader

#: the builds this CPU runs (the AVX2 one runs on AVX-512 CPUs too)
ISAS = [b.isa for b in loader.BUILDS if all(f in loader.cpu_flags() for f in b.features)]


def isa_fixture(kernel: ModuleType):
    """A fixture running its test on each build this CPU has (``CUSTOMOP_CPU_NATIVE`` names it),
    ``kernel``'s entry points loaded from that build; the default build again afterwards."""

    @pytest.fixture(params=ISAS)
    def isa(request, monkeypatch):
        monkeypatch.setenv("CUSTOMOP_CPU_NATIVE", request.param)
        kernel.reset()
        kernel.entries()
        assert loader.loaded.isa == request.param
        yield request.param
        kernel.reset()

    return isa
