"""Linear (position-interpolation) scaling, arXiv:2306.15595: position ``p`` is read as ``p / s``.

With several factors the caches are stacked; ``scaling_factor_to_offset[s]`` is the first row of
factor ``s`` (add it to the positions to select that factor, as vLLM's LoRA long-context path does).
"""

from __future__ import annotations

import torch

from customop.math import rotary as common
from customop.ops.rotary_embedding.base import RotaryEmbedding


class LinearScalingRotaryEmbedding(RotaryEmbedding):
    """Cache rows ``p < ceil(max_pos * s)`` hold the angles ``(p / s) * inv_freq``."""

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float,
                 is_neox_style: bool, scaling_factors: list[float] | float, dtype: torch.dtype) -> None:
        if isinstance(scaling_factors, (int, float)):
            scaling_factors = [scaling_factors]
        if not scaling_factors or any(s <= 0 for s in scaling_factors):
            raise ValueError(f"LinearScalingRotaryEmbedding: scaling factors must be positive, got {scaling_factors}")
        self.scaling_factors: list[float] = list(scaling_factors)
        self._scaling_factor_to_offset: dict[float, int] = {}
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        inv_freq = self._compute_inv_freq(self.base)
        caches, offset = [], 0
        for factor in self.scaling_factors:
            t = torch.arange(common.cache_length(self.max_position_embeddings, factor), dtype=torch.float) / factor
            caches.append(common.cos_sin_cache(t, inv_freq))
            self._scaling_factor_to_offset[float(factor)] = offset
            offset += caches[-1].shape[0]
        return torch.cat(caches, dim=0)

    @property
    def scaling_factor_to_offset(self) -> dict[float, int]:
        return self._scaling_factor_to_offset
