"""``RotaryEmbedding`` (``rotary_embedding``): RoPE with a precomputed cos/sin cache.

The scaling variants (linear, dynamic NTK, YaRN, Llama-3, DeepSeek-YaRN) are unregistered
subclasses that only override ``_compute_inv_freq`` / ``_compute_cos_sin_cache``; they share the
``rotary_embedding`` enable name and every forward path.

In-place contract: ``forward_native`` (and ``forward_cpu``) return NEW tensors and leave
``query``/``key`` untouched; the kernel paths (``forward_cuda``, ``forward_hip``, ``forward_xpu``,
``forward_tpu``) rotate ``query`` and ``key`` IN PLACE and return those same objects. Callers
must use the returned tensors and must not rely on either behaviour.
"""

from __future__ import annotations

import torch

from customop.backends.cpu import CpuTiers, run_tiered
from customop.custom_op import CustomOp
from customop.math import rotary as common

Tensor = torch.Tensor

#: On the CPU, compiled code won from a single token on (1 token, 32+8 heads of 128: ~20 us vs
#: ~45 us eager; eager runs ~15 ATen ops, the compiled function one fused loop), so only empty
#: inputs stay eager (benchmarks/results/cpu_rotary.md). Tiered on the positions' count.
#: head counts static (1.5-2x faster than dynamic ones); the compiled tier runs without Dynamo
#: (``standalone``: backends/cpu/standalone.py ``run_tokens``), 0.58-0.79x -> 0.87-1.07x
#: torch.compile at 1-16 tokens (BENCHMARKS.md, 2026-12-02)
ROTARY_CPU_TIERS = CpuTiers(1, rows=False, dynamic_hidden=False, standalone=True)


def buffer_like(module: torch.nn.Module, name: str, query: Tensor) -> Tensor:
    """Buffer ``name`` on the query's device and dtype. The buffer itself is never replaced: a
    bf16 call must not degrade the fp32 cache that a shared (``get_rope``) instance gives fp32
    callers. Converted copies are kept per (device, dtype), made outside compiled regions."""
    cache = getattr(module, name)
    if cache.device == query.device and cache.dtype == query.dtype:
        return cache
    variants = module.__dict__.get("_buffer_variants")
    key = (name, query.device, query.dtype)
    if variants is not None and key in variants and variants[key][0] is cache:
        return variants[key][1]
    converted = cache.to(query.device, dtype=query.dtype)
    if not torch.compiler.is_compiling():
        module.__dict__.setdefault("_buffer_variants", {})[key] = (cache, converted)
    return converted


@CustomOp.register("rotary_embedding")
class RotaryEmbedding(CustomOp):
    """Rotary position embedding (RoFormer, arXiv:2104.09864) on query and key heads.

    Args:
        head_size: lanes per head; ``query``/``key`` view as ``[T, -1, head_size]``.
        rotary_dim: the leading lanes of each head that rotate (even, ``<= head_size``).
        max_position_embeddings: rows of the cache (positions must be below it).
        base: the RoPE theta; ``inv_freq[i] = base^(-2i / rotary_dim)``.
        is_neox_style: pair the two halves (NeoX) or even/odd lanes (GPT-J).
        dtype: the cache's dtype at construction.
        init_cache: build the cache now (subclasses that need more fields first pass False).

    ``cos_sin_cache`` (``[max_pos, rotary_dim]`` = ``cat(cos, sin)``, a non-persistent buffer) is
    moved and cast to the query's device and dtype on first use, outside compiled regions.
    See the module docstring for the in-place contract.
    """

    cpu_tiers = ROTARY_CPU_TIERS

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float,
                 is_neox_style: bool, dtype: torch.dtype, init_cache: bool = True) -> None:
        super().__init__()
        common.check_rotary_dims(type(self).__name__, head_size, rotary_dim)
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        self.is_neox_style = is_neox_style
        self.dtype = dtype
        self.cos_sin_cache: Tensor
        if init_cache:
            self.register_buffer("cos_sin_cache", self._compute_cos_sin_cache().to(dtype), persistent=False)

    # ---- the cache (what the scaling variants override) ----------------------------------------

    def _compute_inv_freq(self, base: float) -> Tensor:
        return common.rope_inv_freq(base, self.rotary_dim)

    def _compute_cos_sin_cache(self) -> Tensor:
        t = torch.arange(self.max_position_embeddings, dtype=torch.float)
        return common.cos_sin_cache(t, self._compute_inv_freq(self.base))

    def _cache_for(self, query: Tensor) -> Tensor:
        return buffer_like(self, "cos_sin_cache", query)

    # ---- forwards ------------------------------------------------------------------------------

    def forward_native(self, positions: Tensor, query: Tensor,
                       key: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Returns NEW rotated tensors; ``query`` and ``key`` are left untouched."""
        cache = self._cache_for(query)
        common.check_rotary_inputs("rotary_embedding", positions, query, key, self.head_size, cache)
        return common.rotary_embedding(positions, query, key, self.head_size, cache, self.is_neox_style)

    def forward_cpu(self, positions: Tensor, query: Tensor,
                    key: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Compiled native math; NEW tensors."""
        cache = self._cache_for(query)
        common.check_rotary_inputs("rotary_embedding", positions, query, key, self.head_size, cache)
        return run_tiered(self.cpu_tiers, common.rotary_embedding, positions, query, key, self.head_size, cache,
                          self.is_neox_style)

    def forward_cuda(self, positions: Tensor, query: Tensor,
                     key: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        return self.forward_kernel(positions, query, key)

    forward_xpu = forward_tpu = forward_cuda

    def forward_kernel(self, positions: Tensor, query: Tensor,
                       key: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Rotates ``query`` and ``key`` IN PLACE with ``torch.ops.customop.rotary_embedding`` and
        returns them; while autograd records for them, the spec (NEW tensors) runs instead: torch attaches no backward to an in-place op."""
        cache = self._cache_for(query)
        common.check_rotary_inputs("rotary_embedding", positions, query, key, self.head_size, cache)
        if torch.is_grad_enabled() and (query.requires_grad or (key is not None and key.requires_grad)):
            # the spec, on inputs already checked (the check reads the positions on CPU tensors)
            return common.rotary_embedding(positions, query, key, self.head_size, cache, self.is_neox_style)
        torch.ops.customop.rotary_embedding(positions, query, key, self.head_size, cache, self.is_neox_style)
        return query, key

    def extra_repr(self) -> str:
        return (f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, "
                f"max_position_embeddings={self.max_position_embeddings}, base={self.base}, "
                f"is_neox_style={self.is_neox_style}")


class OffsetsForward:
    """Mixed into a RotaryEmbedding subclass whose vLLM 0.33 ``forward`` takes
    ``(positions, query, key=None, offsets=None)``: every path reads cache row
    ``self._cache_index(positions, offsets)`` (``positions + offsets`` unless the subclass says
    otherwise) and then runs RotaryEmbedding's own path, kernels included."""

    def _cache_index(self, positions: Tensor, offsets: Tensor | None) -> Tensor:
        return positions if offsets is None else positions + offsets

    def forward_native(self, positions: Tensor, query: Tensor, key: Tensor | None = None,
                       offsets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        return super().forward_native(self._cache_index(positions, offsets), query, key)

    def forward_cpu(self, positions: Tensor, query: Tensor, key: Tensor | None = None,
                    offsets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        return super().forward_cpu(self._cache_index(positions, offsets), query, key)

    def forward_kernel(self, positions: Tensor, query: Tensor, key: Tensor | None = None,
                       offsets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        return super().forward_kernel(self._cache_index(positions, offsets), query, key)

    def forward_cuda(self, positions: Tensor, query: Tensor, key: Tensor | None = None,
                     offsets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        return self.forward_kernel(positions, query, key, offsets)

    forward_xpu = forward_tpu = forward_cuda
