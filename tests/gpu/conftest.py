"""GPU tier (``pytest -m cuda`` on the H200): the Triton kernels compiled for the real device, at
the case tables' real sizes.

Every test here is marked ``cuda``; tests/conftest.py skips them without a CUDA GPU, or when
``TRITON_INTERPRET=1`` in the session (the Triton mode is fixed at kernel import, in
tests/conftest.py). ``cuda_kernels`` also checks that the launchers are compiled JIT functions
registered as the CUDA kernels of their ``customop::`` ops, so that ``forward_kernel`` on CUDA
tensors runs them (not the ops' reference bodies).
"""

import pytest
import torch


@pytest.fixture(scope="session")
def cuda_kernels():
    """``{"customop::<op>": launcher}``: the Triton launchers, compiled and registered for CUDA."""
    import triton

    from customop.backend_loader import load_backend
    from customop.backends import triton as kernel_modules
    from customop.backends.triton import activation, layernorm, quant, rotary

    load_backend("cuda")  # registers every launcher as the CUDA kernel of its op
    for module in (activation, layernorm, rotary, quant):  # (fused_norm_quant runs quant's kernels)
        jitted = [v for k, v in vars(module).items() if k.endswith("_kernel") and hasattr(v, "run")]
        if not jitted or not all(isinstance(k, triton.runtime.jit.JITFunction) for k in jitted):
            pytest.fail(f"{module.__name__}: the Triton kernels were imported under TRITON_INTERPRET=1")
    table = kernel_modules.kernels()
    for name in table:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA"), f"{name} has no CUDA kernel"
    return table


def assert_close_on_device(out: torch.Tensor, ref: torch.Tensor, what: str = "output", atol: float | None = None) -> None:
    """``customop.testing``'s tolerance for out's dtype (``atol`` replaces its absolute part),
    evaluated on the GPU (the tensors here are gigabytes); only the failing row goes to the CPU
    for the report."""
    from customop.testing import mismatch_report, tolerance

    d_atol, rtol = tolerance(out.dtype)
    atol = d_atol if atol is None else atol
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
