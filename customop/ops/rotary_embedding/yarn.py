"""YaRN scaling (arXiv:2309.00071): interpolate the low frequencies, keep the high ones, ramp
linearly in between, and scale cos/sin by a magnitude ``m`` (attention temperature).

For rotary lane pair ``i`` (``d = rotary_dim``, ``L`` = the original context, ``s`` = factor):

- ``corr(r) = d * ln(L / (2 pi r)) / (2 ln base)`` is the pair that turns ``r`` times over ``L``;
  ``low = floor(corr(beta_fast))``, ``high = ceil(corr(beta_slow))`` (no rounding when
  ``truncate=False``, as gpt-oss uses), clamped to ``[0, d - 1]``;
- ``ramp[i] = clamp((i - low) / (high - low), 0, 1)``; ``keep = 1 - ramp``;
- ``inv_freq = 1 / (s * p) * (1 - keep) + 1 / p * keep`` with ``p = base^(2i/d)``;
- the magnitude, first rule that applies (vLLM 0.33): ``attention_factor`` if given; else
  ``get_mscale(s, mscale) / get_mscale(s, mscale_all_dim)`` when both are non-zero; else
  ``get_mscale(s) = 0.1 ln s + 1`` (1 for ``s <= 1``);
- the cache covers ``ceil(L * s)`` positions.
"""

from __future__ import annotations

import math

import torch

from customop.math import rotary as common
from customop.ops.rotary_embedding.base import RotaryEmbedding


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """``0.1 * mscale * ln(scale) + 1`` for ``scale > 1``, else 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_find_correction_dim(num_rotations: float, dim: int, base: float, max_position: int) -> float:
    return dim * math.log(max_position / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_find_correction_range(low_rot: float, high_rot: float, dim: int, base: float, max_position: int,
                               truncate: bool = True) -> tuple[float, float]:
    low = yarn_find_correction_dim(low_rot, dim, base, max_position)
    high = yarn_find_correction_dim(high_rot, dim, base, max_position)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_linear_ramp_mask(low: float, high: float, dim: int) -> torch.Tensor:
    if low == high:
        high += 0.001  # a step, not a division by zero
    return ((torch.arange(dim, dtype=torch.float) - low) / (high - low)).clamp(0, 1)


def yarn_magnitude(scaling_factor: float, mscale: float | None = None, mscale_all_dim: float | None = None,
                   attention_factor: float | None = None) -> float:
    """YaRN's cos/sin magnitude from the config keys (the module docstring's rule)."""
    if attention_factor is not None:
        return float(attention_factor)
    if mscale and mscale_all_dim:
        return float(yarn_get_mscale(scaling_factor, mscale) / yarn_get_mscale(scaling_factor, mscale_all_dim))
    return float(yarn_get_mscale(scaling_factor))


def yarn_inv_freq(base: float, rotary_dim: int, scaling_factor: float, max_position: int,
                  beta_fast: float, beta_slow: float, truncate: bool = True) -> torch.Tensor:
    """The blended inverse frequencies (fp32) described in the module docstring, rounded as vLLM's."""
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)
    low, high = yarn_find_correction_range(beta_fast, beta_slow, rotary_dim, base, max_position, truncate)
    keep = 1 - yarn_linear_ramp_mask(low, high, rotary_dim // 2)
    return 1.0 / (scaling_factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep


class YaRNScalingRotaryEmbedding(RotaryEmbedding):
    """``max_position_embeddings`` is the ORIGINAL context (``original_max_position_embeddings``).
    vLLM 0.33's constructor: the magnitude comes from ``mscale``/``mscale_all_dim``/``attention_factor``
    (the module docstring); the older ``extrapolation_factor``/``attn_factor`` keys are gone."""

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float,
                 is_neox_style: bool, scaling_factor: float, dtype: torch.dtype, *, beta_fast: float = 32,
                 beta_slow: float = 1, mscale: float | None = None, mscale_all_dim: float | None = None,
                 attention_factor: float | None = None, truncate: bool = True) -> None:
        self.scaling_factor = scaling_factor
        self.beta_fast = beta_fast
        self.beta_slow = beta_slow
        self.truncate = truncate
        self.mscale = yarn_magnitude(scaling_factor, mscale, mscale_all_dim, attention_factor)
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)

    def _compute_inv_freq(self, base: float) -> torch.Tensor:
        return yarn_inv_freq(base, self.rotary_dim, self.scaling_factor, self.max_position_embeddings,
                             self.beta_fast, self.beta_slow, self.truncate)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        t = torch.arange(common.cache_length(self.max_position_embeddings, self.scaling_factor), dtype=torch.float)
        return common.cos_sin_cache(t, self._compute_inv_freq(self.base), self.mscale)
