"""NTK-aware scaling (``ntk``), fixed and mixed (https://kexue.fm/archives/9706).

``d = rotary_dim``, ``s`` = factor, pair ``i < d/2``:

- fixed (``mixed_b`` None): ``inv_freq[i] = (base * s)^(-2i/d) / s^(2/d)``;
- mixed: ``a = ln(s) / (d/2)^b``, ``inv_freq[i] = base^(-2i/d) / exp(a * (i + 1)^b)``.

The cache holds ``max_position`` rows, positions unscaled, no magnitude.
"""

from __future__ import annotations

import torch

from customop.ops.rotary_embedding.base import RotaryEmbedding


class NTKScalingRotaryEmbedding(RotaryEmbedding):
    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float,
                 is_neox_style: bool, scaling_factor: float, dtype: torch.dtype,
                 mixed_b: float | None = None) -> None:
        self.scaling_factor = scaling_factor
        self.mixed_b = mixed_b
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)

    def _compute_inv_freq(self, base: float) -> torch.Tensor:
        if self.mixed_b is None:
            return super()._compute_inv_freq(base * self.scaling_factor) / self.scaling_factor ** (2 / self.rotary_dim)
        # ln(s) of a 0-d tensor in the default dtype, as vLLM takes it
        a = torch.tensor(self.scaling_factor).log() / (self.rotary_dim / 2) ** self.mixed_b
        pair = torch.arange(1, self.rotary_dim // 2 + 1).float()
        return super()._compute_inv_freq(base) / (a * pair ** self.mixed_b).exp()
