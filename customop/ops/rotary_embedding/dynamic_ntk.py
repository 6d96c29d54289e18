"""Dynamic NTK-aware scaling (``dynamic``), in vLLM 0.33's static form: the base is enlarged once.

With ``factor`` (``DynamicNTKScalingRotaryEmbedding``): ``L`` = max_position (the rows of the
cache), ``T`` = ``max_trained_positions`` (get_rope's default: ``L``),
``base' = base * (s * L / T - (s - 1)) ^ (d / (d - 2))`` with ``d = rotary_dim``. With ``T = L``
the bracket is 1 and this is plain RoPE; the base grows only for a cache longer than the trained
context (Nomic-BERT passes ``max_position = max_model_len``). vLLM before 0.33 built ``L * s`` rows
with a bracket of ``s * s - (s - 1)``; that is gone.

With ``alpha`` (``DynamicNTKAlphaRotaryEmbedding``, HunYuan): ``base' = base * alpha ^ (d / (d - 2))``.

Both caches hold ``L`` rows at the new base, positions unscaled, no magnitude.
"""

from __future__ import annotations

import torch

from customop.math import rotary as common
from customop.ops.rotary_embedding.base import RotaryEmbedding


def dynamic_ntk_base(base: float, scaling_factor: float, rotary_dim: int, max_position: int,
                     max_trained_positions: int) -> float:
    """The enlarged RoPE base of the factor form (the expression above, Python floats)."""
    bracket = scaling_factor * max_position / max_trained_positions - (scaling_factor - 1)
    if bracket <= 0:  # a fractional power of a negative number: no real base
        raise ValueError(f"DynamicNTKScalingRotaryEmbedding: factor={scaling_factor} with max_position={max_position} "
                         f"and max_trained_positions={max_trained_positions} gives a non-positive NTK bracket "
                         f"{bracket}; max_position must be larger")
    return base * bracket ** (rotary_dim / (rotary_dim - 2))


class DynamicNTKScalingRotaryEmbedding(RotaryEmbedding):
    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, max_trained_positions: int,
                 base: float, is_neox_style: bool, scaling_factor: float, dtype: torch.dtype) -> None:
        self.scaling_factor = scaling_factor
        self.max_trained_positions = max_trained_positions
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        self.scaled_base = dynamic_ntk_base(self.base, self.scaling_factor, self.rotary_dim,
                                            self.max_position_embeddings, self.max_trained_positions)
        t = torch.arange(self.max_position_embeddings, dtype=torch.float)
        return common.cos_sin_cache(t, self._compute_inv_freq(self.scaled_base))


class DynamicNTKAlphaRotaryEmbedding(RotaryEmbedding):
    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float,
                 is_neox_style: bool, scaling_alpha: float, dtype: torch.dtype) -> None:
        self.scaling_alpha = scaling_alpha
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)

    def _compute_inv_freq(self, base: float) -> torch.Tensor:
        return super()._compute_inv_freq(base * self.scaling_alpha ** (self.rotary_dim / (self.rotary_dim - 2)))
