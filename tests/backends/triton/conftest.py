"""Triton kernels on CPU tensors under the interpreter (research/kernel-testing-on-cpu.md).

TRITON_INTERPRET is read when ``@triton.jit`` decorates, i.e. when a kernel module is imported,
so it is set here before any test module imports one. Helper shared by the test files:
``as_cpu_kernel`` (the launcher temporarily becomes the CPU kernel of its ``customop::`` op). The
``poison_empty`` fixture (NaN-filled ``torch.empty``) comes from tests/conftest.py.
"""

import os

import torch

if not torch.cuda.is_available():  # on a GPU machine (`pytest -m cuda`) the real compiler runs
    os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import customop.ops  # noqa: E402,F401  (defines the customop:: ops)


@contextlib.contextmanager
def as_cpu_kernel(op_name: str, launcher: Callable) -> Iterator[list[int]]:
    """Within the block ``torch.ops.customop.<op_name>`` runs ``launcher`` on CPU tensors; the
    yielded list counts the calls (to prove the kernel, not the reference, ran). On exit the
    registration is destroyed and the op's reference implementation is back."""
    calls: list[int] = []

    def counted(*args):
        calls.append(1)
        return launcher(*args)

    lib = torch.library.Library("customop", "IMPL")
    try:
        lib.impl(op_name, counted, "CPU")
        yield calls
    finally:
        lib._destroy()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
