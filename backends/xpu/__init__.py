"""Intel GPUs: IPEX's fused kernels when its XPU build fits the running torch, else the shared
Triton kernels on XPU tensors, else compiled native, else the eager reference (``chain.py``).

Importing this package (``customop.backend_loader.load_backend("xpu")``, which ``CustomOp`` does
when an op is built on the XPU platform) chooses each ``customop::`` op's provider once for the
process and registers it as the op's ``xpu`` kernel; an op's ``forward_xpu`` then just calls
``torch.ops.customop.<op>``, and CPU tensors keep the CPU kernels. It is cheap where IPEX and
Triton cannot serve XPU tensors: the probe reads package metadata and never imports them then.

``describe()`` is the text ``customop info`` shows. docs/xpu.md says what has run where (IPEX's
CPU build on CPU tensors only; never an Intel GPU).
"""

from customop.backends.xpu.chain import choices, describe, install

install()

__all__ = ["choices", "describe", "install"]
