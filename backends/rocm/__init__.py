"""AMD GPUs: the shared Triton kernels registered for HIP devices (which torch calls "cuda").

Thin on purpose: what differs on AMD hardware is data read from one place (the fnuz fp8 variant in
``customop/math/fp8.py``, wave-64 warp counts in ``backends/triton/_tuning.py``); docs/rocm.md has
the details. Written for ROCm; never run on AMD hardware here (none is reachable).
"""

from customop.backends import triton as _triton

_triton.register_for("cuda")
