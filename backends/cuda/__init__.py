"""NVIDIA GPUs: the shared Triton launchers become the CUDA kernels of the ``customop::`` ops.

Importing this package registers them (``customop.backend_loader.load_backend("cuda")`` does it on
an op's first ``forward_cuda``). CUDA-specific kernels and tuning go in modules beside this one.
"""

from customop.backends import triton as _triton

_triton.register_for("cuda")
