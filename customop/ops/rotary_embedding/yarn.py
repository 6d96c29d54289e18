"""YaRN scaling (arXiv:2309.00071): interpolate the low frequencies, keep the high ones, ramp
linearly in between, and scale cos/sin by ``mscale`` (attention temperature).

For rotary lane pair ``i`` (``d = rotary_dim``, ``L`` = the original context, ``s`` = factor):

- ``corr(r) = d * ln(L / (2 pi r)) / (2 ln base)`` is the pair that turns ``r`` times over ``L``;
  ``low = floor(corr(beta_fast))``, ``high = ceil(corr(beta_slow))`` (no rounding when
  ``truncate=False``, as gpt-oss uses), clamped to ``[0, d - 1]``;
- ``ramp[i] = clamp((i - low) / (high - low), 0, 1)``; ``keep = (1 - ramp) * extrapolation_factor``;
- ``inv_freq = inv_freq_base / s * (1 - keep) + inv_freq_base * keep``;
- ``mscale = (0.1 ln s + 1) * attn_factor`` (1 for ``s <= 1``); the cache covers
  ``ceil(L * s)`` positions.
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


def yarn_inv_freq(base: float, rotary_dim: int, scaling_factor: float, max_position: int,
                  beta_fast: float, beta_slow: float, extrapolation_factor: float = 1.0,
                  truncate: bool = True) -> torch.Tensor:
    """The blended inverse frequencies (fp32) described in the module docstring."""
    extrapolated = common.rope_inv_freq(base, rotary_dim)
    interpolated = extrapolated / scaling_factor
    low, high = yarn_find_correction_range(beta_fast, beta_slow, rotary_dim, base, max_position, truncate)
    keep = (1 - yarn_linear_ramp_mask(low, high, rotary_dim // 2)) * extrapolation_factor
    return interpolated * (1 - keep) + extrapolated * keep


class YaRNScalingRotaryEmbedding(RotaryEmbedding):
    """``max_position_embeddings`` is the ORIGINAL context (``original_max_position_embeddings``)."""

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float,
                 is_neox_style: bool, scaling_factor: float, dtype: torch.dtype, *,
                 extrapolation_factor: float = 1, attn_factor: float = 1, beta_fast: float = 32,
                 beta_slow: float = 1, apply_yarn_scaling: bool = True, truncate: bool = True) -> None:
        self.scaling_factor = scaling_factor
        self.extrapolation_factor = extrapolation_factor
        self.attn_factor = attn_factor
        self.beta_fast = beta_fast
        self.beta_slow = beta_slow
        self.truncate = truncate
        self.mscale = float(yarn_get_mscale(scaling_factor) * attn_factor if apply_yarn_scaling else attn_factor)
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)

    def _compute_inv_freq(self, base: float) -> torch.Tensor:
        return yarn_inv_freq(base, self.rotary_dim, self.scaling_factor, self.max_position_embeddings,
                             self.beta_fast, self.beta_slow, self.extrapolation_factor, self.truncate)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        t = torch.arange(common.cache_length(self.max_position_embeddings, self.scaling_factor), dtype=torch.float)
        return common.cos_sin_cache(t, self._compute_inv_freq(self.base), self.mscale)
