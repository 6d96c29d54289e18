"""Proportional RoPE (``proportional``, Gemma 4): partial rotation whose frequencies are spaced
over the whole head.

With ``n = rotary_dim / 2`` rotating pairs out of ``head_size / 2``:
``inv_freq[i] = base^(-2i / head_size)`` for ``i < n`` (the exponent's denominator is the head
size, not the rotary dim) and 0 for the other ``head_size/2 - n`` pairs. The op then rotates the
WHOLE head (its ``rotary_dim`` attribute is ``head_size``; ``rope_angles`` keeps ``n``): a zero
frequency is the identity (cos 1, sin 0). With NeoX pairing ``(i, i + head_size/2)`` the lanes
left alone are the tail of each half, not the tail of the head as in ordinary partial RoPE.
"""

from __future__ import annotations

import torch

from customop.ops.rotary_embedding.base import RotaryEmbedding


class Gemma4RotaryEmbedding(RotaryEmbedding):
    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float,
                 is_neox_style: bool, dtype: torch.dtype) -> None:
        self.rope_angles = rotary_dim // 2
        self.nope_angles = head_size // 2 - self.rope_angles
        super().__init__(head_size, head_size, max_position_embeddings, base, is_neox_style, dtype)

    def _compute_inv_freq(self, base: float) -> torch.Tensor:
        exponents = torch.arange(0, 2 * self.rope_angles, 2, dtype=torch.float) / self.head_size
        return torch.cat((1.0 / base ** exponents, torch.zeros(max(self.nope_angles, 0), dtype=torch.float)))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", rope_angles={self.rope_angles}, nope_angles={self.nope_angles}"
