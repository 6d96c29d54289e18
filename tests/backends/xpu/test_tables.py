"""The case tables through the XPU kernels: every row of ``customop/samples/<family>.py`` (its
``"check"`` sizes) whose ``customop::`` op IPEX serves (``ipex_ops.BINDERS``) runs through
``forward_kernel`` with the op's XPU kernel in place of its CPU one, i.e. the chain's choice:
IPEX's function, or the next provider for arguments IPEX cannot take. Judged by the float64
references of ``tests/cases``. A new row of those ops, or a new IPEX binding, is tested here with
no edit of this file.

Each row runs against both stand-ins (``fake_ipex``) and, in the xpu tier, the real CPU build of
IPEX 2.8.0, whose functions take CPU tensors. test_ipex_ops.py keeps what is the mappings' own
(argument checks, the builds' names, the rotation's layouts and IPEX's measured limits)."""

from __future__ import annotations

import pytest
import torch

from customop.backends.xpu import chain, ipex_ops
from customop.testing import FLOAT_DTYPES
from tests.backends import kernel_cases
from tests.backends.xpu.conftest import env, xpu_kernel

IPEX_OPS = {name.removeprefix("customop::") for name in ipex_ops.BINDERS}
ROWS = kernel_cases.params("check", lambda row: row.library_op in IPEX_OPS, dtypes=FLOAT_DTYPES)


@pytest.mark.parametrize("row,dtype", ROWS)
def test_table_row_through_xpu_kernel(row, dtype, ipex_build, monkeypatch, restore_chain):
    monkeypatch.setattr(chain, "import_ipex", lambda: ipex_build)
    chain.install(env())
    bound = ipex_ops.bind_all(ipex_build.llm.functional).get(f"customop::{row.library_op}")
    taken: list[bool] = []

    def kernel(*args):
        taken.append(bound is not None and bound.supports(*args))
        return xpu_kernel(row.library_op, *args)

    op, args, kwargs = kernel_cases.make(row, dtype)
    ref_op, before = kernel_cases.snapshot(op, args)
    with kernel_cases.as_cpu_kernel(row.library_op, kernel) as calls, torch.no_grad():
        out = op.forward_kernel(*args, **kwargs)
    assert calls, "forward_kernel did not reach the XPU kernel"
    # IPEX computes in fp32 and rounds once where it takes the call; the eager fallback is the spec
    kernel_cases.judge(row, ref_op, before, out, dtype, spec_rounding=True)
    called = getattr(ipex_build.llm.functional, "calls", None)  # the stand-ins record their calls
    if called is not None:
        assert bool(called) == any(taken), f"IPEX took the call: {any(taken)}; IPEX functions called: {called}"
