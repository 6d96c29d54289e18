"""Llama-3.1 scaling (``llama3``): per-frequency interpolation by wavelength.

With ``L`` = ``original_max_position``, ``s`` = factor, ``wavelen = 2 pi / inv_freq``:

- ``wavelen < L / high_freq_factor`` (high frequencies): unchanged;
- ``wavelen > L / low_freq_factor`` (low frequencies): ``inv_freq / s``;
- in between: ``(1 - a) * inv_freq / s + a * inv_freq`` with
  ``a = (L / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)``.

The cache covers ``max_position_embeddings`` positions (the extended context), unscaled.
"""

from __future__ import annotations

import math

import torch

from customop.math import rotary as common
from customop.ops.rotary_embedding.base import RotaryEmbedding


def llama3_inv_freq(base: float, rotary_dim: int, scaling_factor: float, low_freq_factor: float,
                    high_freq_factor: float, original_max_position: int) -> torch.Tensor:
    inv_freq = common.rope_inv_freq(base, rotary_dim)
    wavelen = 2 * math.pi / inv_freq
    if low_freq_factor != high_freq_factor:
        smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    else:
        smooth = torch.zeros_like(inv_freq)  # no band in between: a step from kept to scaled
    blended = (1 - smooth) * inv_freq / scaling_factor + smooth * inv_freq
    scaled = torch.where(wavelen > original_max_position / low_freq_factor, inv_freq / scaling_factor, blended)
    return torch.where(wavelen < original_max_position / high_freq_factor, inv_freq, scaled)


class Llama3RotaryEmbedding(RotaryEmbedding):
    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float,
                 is_neox_style: bool, dtype: torch.dtype, scaling_factor: float, low_freq_factor: float,
                 high_freq_factor: float, orig_max_position: int) -> None:
        self.scaling_factor = scaling_factor
        self.low_freq_factor = low_freq_factor
        self.high_freq_factor = high_freq_factor
        self.orig_max_position = orig_max_position
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)

    def _compute_inv_freq(self, base: float) -> torch.Tensor:
        return llama3_inv_freq(base, self.rotary_dim, self.scaling_factor, self.low_freq_factor,
                               self.high_freq_factor, self.orig_max_position)
