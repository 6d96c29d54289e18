"""TPUs: JAX Pallas kernels, callable from JAX directly and from torch through torch_xla.

JAX users call the kernels on ``jax.Array``s (this package needs only jax)::

    from customop.backends import tpu
    y = tpu.rms_norm(x, weight, 1e-6)                       # [..., H]
    y, h = tpu.rms_norm(x, weight, 1e-6, residual=r)        # fused add: h = x + r
    y = tpu.gemma_rms_norm(x, weight, 1e-6)
    y = tpu.rms_norm_gated(x, weight, z, 1e-5, group_size=G, norm_before_gate=False)
    q, k = tpu.rotary_embedding(positions, q, k, head_size, cos_sin_cache, is_neox_style=True)
    y = tpu.silu_and_mul(x); y = tpu.act_and_mul(x, "gelu_tanh")
    q, s = tpu.per_token_quant_fp8(x); q, s = tpu.per_group_quant_fp8(x, 128)

Every function also takes ``block_rows=`` (rows per block; a multiple of 8 or all rows) and
``interpret=`` (``None``: decided by ``tiling.use_interpret``: ``CUSTOMOP_PALLAS_INTERPRET`` if
set, else interpret unless on a TPU). The math of each is the op's ``forward_native``
(research/op-semantics.md D); see docs/tpu.md for what has run where.

The torch side (``torch_ops``: ``torch.library`` ops over ``torch_xla``'s ``call_jax``, used by
the op classes' ``forward_tpu``) needs torch_xla, so JAX users need not have it. It is imported
with this package when the torch side is in use (torch_xla already imported, or customop's
platform is the TPU: ops then load it at construction, before any ``torch.compile`` trace, which
cannot follow an import), else on first access of ``customop.backends.tpu.torch_ops``.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

from customop.backends.tpu.activation import ACTIVATIONS, act_and_mul, gelu_and_mul, silu_and_mul
from customop.backends.tpu.norms import gemma_rms_norm, rms_norm, rms_norm_gated
from customop.backends.tpu.quant_fp8 import fp8_max, per_group_quant_fp8, per_tensor_quant_fp8, per_token_quant_fp8
from customop.backends.tpu.rotary import rotary_embedding
from customop.backends.tpu.tiling import use_interpret

__all__ = [
    "ACTIVATIONS",
    "act_and_mul",
    "fp8_max",
    "gelu_and_mul",
    "gemma_rms_norm",
    "per_group_quant_fp8",
    "per_tensor_quant_fp8",
    "per_token_quant_fp8",
    "rms_norm",
    "rms_norm_gated",
    "rotary_embedding",
    "silu_and_mul",
    "use_interpret",
]

#: What the torch bridge needs beyond jax and torch: torchax (call_jax fails without it, and
#: torch_xla does not declare it) and flax (torchax 0.0.13 imports it; research/tpu-path.md).
_BRIDGE_REQUIRES = ("torch_xla", "torchax", "flax")


def __getattr__(name: str) -> ModuleType:
    if name != "torch_ops":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        return importlib.import_module(f"{__name__}.torch_ops")
    except ModuleNotFoundError as err:
        if err.name and err.name.split(".")[0] in _BRIDGE_REQUIRES:
            raise ImportError(f"customop's TPU backend needs {err.name!r} for torch tensors: "
                              "pip install customop[tpu]") from err
        raise


def _torch_side_in_use() -> bool:
    if "torch_xla" in sys.modules:
        return True
    from customop.platforms import current_platform

    try:
        return current_platform().is_tpu()
    except RuntimeError:  # e.g. two platform plugins: leave it to the ops to report
        return False


if _torch_side_in_use():
    try:
        __getattr__("torch_ops")
    except ImportError:
        pass  # the JAX API stays usable; the error comes back, clearly, on first use of torch_ops
