"""The TPU backend's tests. The pure-JAX kernel and lowering tests need only jax, the autograd
tests of the norm ops only torch (main tier); the torch_xla tests (``@pytest.mark.xla``) run in
the tpu tier (``bash .ci/tpu.sh``). Each module skips itself when what it needs is missing."""

import importlib.util
import os

# Before torch_xla is imported anywhere: the XLA CPU device (no TPU on CI machines), and Pallas
# in interpret mode (explicit, although it is the default off-TPU).
os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CUSTOMOP_PALLAS_INTERPRET", "1")


def pytest_sessionstart(session):
    """Where torch_xla is installed, start its runtime before any test runs a backward: torch's
    autograd engine sizes its per-device queues at the first backward, and torch_xla counts no
    device until its runtime starts, so a CPU backward first (test_norm_autograd.py) would leave
    the XLA device out ("device_ready_queues_" assertion on the first XLA backward)."""
    if importlib.util.find_spec("torch_xla") is not None:
        import torch_xla

        torch_xla.device()
