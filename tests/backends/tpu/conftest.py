"""The TPU backend's tests. The pure-JAX kernel and lowering tests need only jax (main tier); the
torch_xla tests (``@pytest.mark.xla``) run in the tpu tier (``bash .ci/tpu.sh``)."""

import importlib.util
import os

# Before torch_xla is imported anywhere: the XLA CPU device (no TPU on CI machines), and Pallas
# in interpret mode (explicit, although it is the default off-TPU).
os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CUSTOMOP_PALLAS_INTERPRET", "1")

collect_ignore_glob = [] if importlib.util.find_spec("jax") else ["test_*.py"]
