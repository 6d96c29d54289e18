"""IPEX's fused kernels mapped onto the ``customop::`` schemas, one function per op.

``fns`` is ``intel_extension_for_pytorch.llm.functional`` (or a stand-in in tests). The two IPEX
builds name some functions differently; each binder below picks by what ``fns`` has:

| customop op        | XPU build (2.8.10+xpu)                                 | CPU build (2.8.0+cpu, PyPI)                            |
|--------------------|--------------------------------------------------------|--------------------------------------------------------|
| rms_norm           | ``rms_norm(x, weight, eps)``                           | same                                                   |
| fused_add_rms_norm | ``add_rms_norm(residual, x, weight, None, eps, True)`` | same                                                   |
| silu_and_mul       | ``silu_and_mul(x, out)`` (halves split inside)         | ``silu_mul(x[..., :d], x[..., d:], out)``              |
| gelu_and_mul       | ``gelu_and_mul(x, out, approximate)``                  | ``gelu_mul(x[..., :d], x[..., d:], out, approximate)`` |
| quick_gelu         | ``gelu_quick(x, out)``                                 | (absent)                                               |
| rotary_embedding   | ``rotary_embedding_batched(positions, q, k, head_size, | ``rotary_embedding(q, k, sin, cos, rot_dim, is_neox)`` |
|                    | cos_sin_cache, is_neox, rot_dim)``                     | with sin/cos gathered per token; full rotation only    |
| mm_encoder_attn    | ``varlen_attention(...)`` (``ipex_attention.py``)      | same                                                   |
| fused_experts      | ``llm.modules.GatedMLPMOE`` (``ipex_moe.py``)          | same; silu without bias or input weight only           |

In-place behaviour, as the schemas require: ``add_rms_norm(..., add_back=True)`` stores
``x + residual`` into ``residual`` and *returns* the normalised sum, which is then copied into
``x``; both rotary functions rotate ``query``/``key`` in place. Each op also has a ``supports``
check: arguments IPEX cannot take (no weight, a weight of another dtype, no key, fp64, strided
rows) go to the next provider of the chain, chosen once with the rest (``chain.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from customop.backends.xpu import ipex_attention, ipex_moe

Tensor = torch.Tensor
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class IpexKernel:
    """One op's IPEX kernel as bound to the installed build."""

    call: str  # the IPEX call, as shown by ``customop info``
    run: Callable[..., Any]  # takes the op's schema arguments
    supports: Callable[..., bool]


def _dtype_ok(*tensors: Tensor) -> bool:
    return all(t.dtype == tensors[0].dtype for t in tensors) and tensors[0].dtype in KERNEL_DTYPES


def _gated_out(x: Tensor) -> tuple[int, Tensor]:
    d = x.shape[-1] // 2
    return d, x.new_empty((*x.shape[:-1], d))


# ---- norms ---------------------------------------------------------------------------------------


def _norm_supported(x: Tensor, weight: Tensor | None, eps: float) -> bool:
    # IPEX multiplies by the weight in its own dtype; it has no weight-less variant.
    return weight is not None and _dtype_ok(x, weight) and x.is_contiguous()


def _bind_rms_norm(fns: ModuleType) -> IpexKernel | None:
    if not hasattr(fns, "rms_norm"):
        return None
    return IpexKernel("rms_norm(x, weight, eps)", lambda x, weight, eps: fns.rms_norm(x, weight, eps),
                      _norm_supported)


def _bind_fused_add_rms_norm(fns: ModuleType) -> IpexKernel | None:
    if not hasattr(fns, "add_rms_norm"):
        return None

    def run(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
        # IPEX's argument order is (residual, x, ...): the first tensor receives the sum.
        normed = fns.add_rms_norm(residual, x, weight, None, eps, True)
        x.copy_(normed)

    def supports(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float) -> bool:
        return _norm_supported(x, weight, eps) and _dtype_ok(x, residual) and residual.is_contiguous()

    return IpexKernel("add_rms_norm(residual, x, weight, None, eps, add_back=True); x.copy_(result)",
                      run, supports)


# ---- activations ---------------------------------------------------------------------------------


def _act_supported(x: Tensor, *_: Any) -> bool:
    return _dtype_ok(x) and x.is_contiguous()


def _bind_silu_and_mul(fns: ModuleType) -> IpexKernel | None:
    if hasattr(fns, "silu_and_mul"):  # XPU build: one call reads both halves
        def run(x: Tensor) -> Tensor:
            _, out = _gated_out(x)
            fns.silu_and_mul(x, out)
            return out

        return IpexKernel("silu_and_mul(x, out)", run, _act_supported)
    if hasattr(fns, "silu_mul"):  # CPU build: the halves as two strided views (no copy)
        def run_halves(x: Tensor) -> Tensor:
            d, out = _gated_out(x)
            fns.silu_mul(x[..., :d], x[..., d:], out)
            return out

        return IpexKernel("silu_mul(x[..., :d], x[..., d:], out)", run_halves, _act_supported)
    return None


def _bind_gelu_and_mul(fns: ModuleType) -> IpexKernel | None:
    if hasattr(fns, "gelu_and_mul"):  # XPU build
        def run(x: Tensor, approximate: str) -> Tensor:
            _, out = _gated_out(x)
            fns.gelu_and_mul(x, out, approximate)
            return out

        return IpexKernel("gelu_and_mul(x, out, approximate)", run, _act_supported)
    if hasattr(fns, "gelu_mul"):  # CPU build
        def run_halves(x: Tensor, approximate: str) -> Tensor:
            d, out = _gated_out(x)
            fns.gelu_mul(x[..., :d], x[..., d:], out, approximate)
            return out

        return IpexKernel("gelu_mul(x[..., :d], x[..., d:], out, approximate)", run_halves, _act_supported)
    return None


def _bind_quick_gelu(fns: ModuleType) -> IpexKernel | None:
    if not hasattr(fns, "gelu_quick"):  # XPU build only
        return None

    def run(x: Tensor) -> Tensor:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        fns.gelu_quick(x, out)
        return out

    return IpexKernel("gelu_quick(x, out)", run, _act_supported)


# ---- rotary --------------------------------------------------------------------------------------


def _rotary_supported(positions: Tensor, query: Tensor, key: Tensor | None, head_size: int,
                      cos_sin_cache: Tensor, is_neox: bool) -> bool:
    # Neither IPEX function takes key=None (vLLM's XPU path ran native then, too).
    return (key is not None and _dtype_ok(query, key, cos_sin_cache)
            and query.is_contiguous() and key.is_contiguous())


def _bind_rotary_embedding(fns: ModuleType) -> IpexKernel | None:
    if hasattr(fns, "rotary_embedding_batched"):  # XPU build: vLLM's cache layout, in place
        def run(positions: Tensor, query: Tensor, key: Tensor, head_size: int, cos_sin_cache: Tensor,
                is_neox: bool) -> None:
            num_tokens = positions.numel()
            fns.rotary_embedding_batched(positions.view(-1), query.view(num_tokens, -1), key.view(num_tokens, -1),
                                         head_size, cos_sin_cache, is_neox, cos_sin_cache.shape[-1])

        return IpexKernel("rotary_embedding_batched(positions, q, k, head_size, cos_sin_cache, is_neox, rot_dim)",
                          run, _rotary_supported)
    if hasattr(fns, "rotary_embedding"):  # CPU build: sin/cos gathered per token, [T, heads, D] views
        def run_gathered(positions: Tensor, query: Tensor, key: Tensor, head_size: int, cos_sin_cache: Tensor,
                         is_neox: bool) -> None:
            num_tokens, rot_dim = positions.numel(), cos_sin_cache.shape[-1]
            cos, sin = cos_sin_cache.index_select(0, positions.view(-1)).chunk(2, dim=-1)
            q3, k3 = query.view(num_tokens, -1, head_size), key.view(num_tokens, -1, head_size)
            q_out, k_out = fns.rotary_embedding(q3, k3, sin, cos, rot_dim, is_neox)
            # Rotated in place by the 2.8 CPU build (checked in the xpu tier); copy if a build returns new tensors.
            for dst, src in ((q3, q_out), (k3, k_out)):
                if src.data_ptr() != dst.data_ptr():
                    dst.copy_(src)

        def supports_full_rotation(positions: Tensor, query: Tensor, key: Tensor | None, head_size: int,
                                   cos_sin_cache: Tensor, is_neox: bool) -> bool:
            # The CPU build asserts that sin/cos span the whole head (or half of it): no partial rotary.
            return (cos_sin_cache.shape[-1] == head_size
                    and _rotary_supported(positions, query, key, head_size, cos_sin_cache, is_neox))

        return IpexKernel("rotary_embedding(q, k, sin[pos], cos[pos], rot_dim, is_neox)", run_gathered,
                          supports_full_rotation)
    return None


#: customop op name -> binder. Ops absent here have no IPEX kernel (their chain starts at Triton).
BINDERS: dict[str, Callable[[ModuleType], IpexKernel | None]] = {
    "customop::rms_norm": _bind_rms_norm,
    "customop::fused_add_rms_norm": _bind_fused_add_rms_norm,
    "customop::silu_and_mul": _bind_silu_and_mul,
    "customop::gelu_and_mul": _bind_gelu_and_mul,
    "customop::quick_gelu": _bind_quick_gelu,
    "customop::rotary_embedding": _bind_rotary_embedding,
}


def bind_all(fns: ModuleType, modules: Any = None) -> dict[str, IpexKernel]:
    """The IPEX kernels this build of ``llm.functional`` (and ``llm.modules``: GatedMLPMOE)
    provides, by op name; the attention and MoE binders live in ``ipex_attention``/``ipex_moe``."""
    bound = {op: binder(fns) for op, binder in BINDERS.items()}
    bound["customop::mm_encoder_attn"] = ipex_attention.bind(fns, modules)
    bound["customop::fused_experts"] = ipex_moe.bind(fns, modules)
    return {op: kernel for op, kernel in bound.items() if kernel is not None}
