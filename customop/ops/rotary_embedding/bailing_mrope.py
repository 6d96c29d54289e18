"""Bailing M-RoPE (``bailing_mrope``): M-RoPE whose height and width frequencies alternate and
whose temporal ones come last.

``mrope_section = [t, h, w]`` with ``h == w`` and ``t + h + w = rotary_dim / 2``; with
``S = h + w``, frequency lane ``j < S`` takes row 1 (height) when ``j`` is even and row 2 (width)
when odd, and lanes ``S .. rotary_dim/2 - 1`` take row 0 (temporal). The cache holds
``4 * max_position`` rows (the factor is fixed at 4, get_rope's is not passed on). Positions must
be int32 or int64, ``[T]`` (plain RoPE) or ``[3, T]``; a key is required.
"""

from __future__ import annotations

import torch

from customop.ops.rotary_embedding.mrope import MRotaryEmbedding

Tensor = torch.Tensor


class BailingMRotaryEmbedding(MRotaryEmbedding):
    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float,
                 is_neox_style: bool, dtype: torch.dtype, mrope_section: list[int]) -> None:
        op = type(self).__name__
        if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_size:
            raise ValueError(f"{op}: rotary_dim must be even and in (0, head_size={head_size}], got {rotary_dim}")
        if len(mrope_section) != 3 or any(s < 0 for s in mrope_section):
            raise ValueError(f"{op}: mrope_section must be three non-negative sizes [t, h, w], got {mrope_section}")
        if mrope_section[1] != mrope_section[2]:
            raise ValueError(f"{op}: the h and w sections must be equal, got {mrope_section}")
        self.spatial_size = mrope_section[1] + mrope_section[2]
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype,
                         mrope_section=mrope_section)

    def select_cos_sin(self, positions: Tensor, cache: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = cache[positions].chunk(2, dim=-1)  # [3, T, rotary_dim/2] each
        even = torch.arange(self.spatial_size, device=cos.device) % 2 == 0
        s = self.spatial_size

        def pick(rows: Tensor) -> Tensor:
            return torch.cat((torch.where(even, rows[1, :, :s], rows[2, :, :s]), rows[0, :, s:]), dim=-1)

        return pick(cos), pick(sin)

    def forward_native(self, positions: Tensor, query: Tensor, key: Tensor | None = None,
                       offsets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        op = type(self).__name__
        if positions.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{op}: positions must be int32 or int64, got {positions.dtype}")
        if key is None:
            raise ValueError(f"{op}: key is required")
        return super().forward_native(positions, query, key, offsets)

    forward_cpu = forward_cuda = forward_hip = forward_xpu = forward_tpu = forward_kernel = forward_native
