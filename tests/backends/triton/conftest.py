"""Fixtures of the Triton tests. The interpreter tests (marked ``interpret``) run the kernels on
CPU tensors under ``TRITON_INTERPRET=1``, which tests/conftest.py sets before any kernel module is
imported on a machine without a CUDA GPU (the interpreter is chosen when ``@triton.jit``
decorates). ``as_cpu_kernel``: the launcher temporarily becomes the CPU kernel of its
``customop::`` op. The ``poison_empty`` fixture (NaN-filled ``torch.empty``) comes from
tests/conftest.py.
"""

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch

import customop.ops  # noqa: F401  (defines the customop:: ops)


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
