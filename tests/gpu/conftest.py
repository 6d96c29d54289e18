"""GPU tier (``pytest -m cuda tests/gpu`` on the H200): the Triton kernels compiled for the real
device, at real sizes.

The suite's root conftest turns the Triton interpreter on for CI (``TRITON_INTERPRET=1`` unless
set). Here, with a GPU present, it is turned off again before any kernel module is imported (the
mode is fixed when ``@triton.jit`` decorates). If kernels were already imported interpreted
(tests/backends/triton collected in the same session), the GPU tests fail with that explanation
instead of timing the interpreter: run this folder in its own pytest session.
"""

import os

import pytest
import torch

if torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "0"




@pytest.fixture(scope="session")
def compiled_kernels():
    """The kernel modules, checked to be real JIT kernels (not the interpreter)."""
    import triton

    from customop.backends.triton import activation, layernorm

    for module in (activation, layernorm):
        kernel = next(v for k, v in vars(module).items() if k.endswith("_kernel"))
        if not isinstance(kernel, triton.runtime.jit.JITFunction):
            pytest.fail("the Triton kernels were imported under TRITON_INTERPRET=1 (the CPU test "
                        "folders ran in this session): run `pytest -m cuda tests/gpu` on its own")
    return activation, layernorm


def assert_close_on_device(out: torch.Tensor, ref: torch.Tensor, what: str = "output") -> None:
    """``customop.testing``'s tolerance for out's dtype, evaluated on the GPU (the tensors here
    are gigabytes); only the failing rows go to the CPU for the report."""
    from customop.testing import mismatch_report, tolerance

    atol, rtol = tolerance(out.dtype)
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} vs {tuple(ref.shape)}"
    o = out.reshape(-1, out.shape[-1]) if out.dim() else out.reshape(1, 1)
    r = ref.reshape(-1, ref.shape[-1]) if ref.dim() else ref.reshape(1, 1)
    bad_rows = []
    for start in range(0, o.shape[0], 4096):  # chunks bound the float64 temporaries
        oc, rc = o[start:start + 4096].double(), r[start:start + 4096].double()
        bad = ~((oc - rc).abs() <= atol + rtol * rc.abs()) | oc.isnan()
        bad &= ~(oc.isnan() & rc.isnan())
        if bad.any():
            bad_rows.append(start + int(bad.any(dim=1).nonzero()[0]))
            break
    if bad_rows:
        row = bad_rows[0]
        report = mismatch_report(o[row:row + 1].cpu(), r[row:row + 1].cpu(), atol, rtol)
        raise AssertionError(f"{what} ({out.dtype}, shape {tuple(out.shape)}), first bad row {row}: {report}")
