"""Dynamic NTK-aware scaling, in vLLM's static form: the base grows once, for the longest context.

``max_len = max_pos * s``; ``base' = base * (s * max_len / max_pos - (s - 1)) ^ (d / (d - 2))``
with ``d = rotary_dim``; the cache covers ``max_len`` positions at the new base. (HF's dynamic
variant recomputes the base per sequence length at run time; vLLM, and so customop, precompute
the longest one.)
"""

from __future__ import annotations

import torch

from customop.math import rotary as common
from customop.ops.rotary_embedding.base import RotaryEmbedding


def dynamic_ntk_base(base: float, scaling_factor: float, rotary_dim: int) -> float:
    """The enlarged RoPE base (the expression above with ``max_len / max_pos = s``)."""
    return base * (scaling_factor * scaling_factor - (scaling_factor - 1)) ** (rotary_dim / (rotary_dim - 2))


class DynamicNTKScalingRotaryEmbedding(RotaryEmbedding):
    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float,
                 is_neox_style: bool, scaling_factor: float, dtype: torch.dtype) -> None:
        self.scaling_factor = scaling_factor
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        max_len = common.cache_length(self.max_position_embeddings, self.scaling_factor)
        base = dynamic_ntk_base(self.base, self.scaling_factor, self.rotary_dim)
        return common.cos_sin_cache(torch.arange(max_len, dtype=torch.float), self._compute_inv_freq(base))
