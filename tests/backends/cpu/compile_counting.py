"""Shared by the standalone-route tests: a fresh compile cache per test and Dynamo's graph count.
Import ``fresh_compiles`` into a test module to make it autouse there."""

from __future__ import annotations

import pytest
from torch._dynamo.utils import counters

from customop.backends.cpu import compile_cache


@pytest.fixture(autouse=True)
def fresh_compiles():
    """Each test starts as a fresh process would: no graph, no artifact, no shape class known."""
    compile_cache.reset()
    yield
    compile_cache.reset()


def graphs() -> int:
    """Dynamo's graphs compiled so far (one per graph)."""
    return counters["stats"]["unique_graphs"]
