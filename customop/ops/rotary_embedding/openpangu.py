"""openPangu's interleaved M-RoPE (``openpangu``): each cos/sin lane takes its position from one
modality row, in an order that spreads the modalities as evenly as possible.

``mrope_section`` is ``[a, b]`` or ``[a, b, c]`` (sum ``rotary_dim / 2``). The modality order is
built greedily: for three sections ``a`` is first reduced by one; then, for ``a + b + c`` steps,
among the modalities with a count left and different from the previous pick (any with a count left
if none), the one with the smallest ``(placed / count, index)`` is placed; for three sections a
final 0 is appended. E.g. ``[2, 3, 3] -> 0,1,2,1,2,1,2,0`` and ``[3, 2] -> 0,1,0,1,0``. The order
is used twice (cos lanes, then sin lanes): lane ``j`` of a token's cache row comes from the row
``order[j]`` of ``positions`` (``[modalities, T]``).

``forward(positions, query, key=None)``; the cache holds ``4 * max_position`` rows. Like vLLM's,
no dispatch: ``forward_native`` on every platform; returns NEW tensors.
"""

from __future__ import annotations

import torch

from customop.math import rotary as common
from customop.ops.rotary_embedding.mrope import MRotaryEmbedding

Tensor = torch.Tensor


def interleaved_modalities(section: list[int]) -> list[int]:
    """The greedy modality order of the module docstring (one entry per frequency lane)."""
    counts = list(section) + [0] * (3 - len(section))
    if len(section) == 3:
        counts[0] -= 1
    placed, left, order, last = [0, 0, 0], list(counts), [], None
    for _ in range(sum(counts)):
        candidates = [m for m in range(3) if left[m] > 0 and m != last] or [m for m in range(3) if left[m] > 0]
        best = min(candidates, key=lambda m: (placed[m] / counts[m], m))
        order.append(best)
        placed[best] += 1
        left[best] -= 1
        last = best
    return order + [0] if len(section) == 3 else order


class MRotaryEmbeddingInterleaved(MRotaryEmbedding):
    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float,
                 is_neox_style: bool, dtype: torch.dtype, mrope_section: list[int] | None = None,
                 mrope_interleaved: bool = True) -> None:
        op = type(self).__name__
        if mrope_section is None:
            raise ValueError(f"{op}: mrope_section is required")
        if len(mrope_section) not in (2, 3):
            raise ValueError(f"{op}: mrope_section must have 2 or 3 sizes, got {mrope_section}")
        if sum(mrope_section) != rotary_dim // 2:
            raise ValueError(f"{op}: mrope_section must sum to rotary_dim/2 = {rotary_dim // 2}, got {mrope_section}")
        if not mrope_interleaved:
            raise ValueError(f"{op}: mrope_interleaved must be True")
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)
        self.mrope_section = list(mrope_section)
        self.mrope_interleaved = True
        self.mrope_dim = interleaved_modalities(self.mrope_section) * 2

    def forward_native(self, positions: Tensor, query: Tensor,
                       key: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        op = type(self).__name__
        rows = max(self.mrope_dim) + 1
        if positions.dim() != 2 or positions.shape[0] < rows:
            raise ValueError(f"{op}: positions must be [modalities >= {rows}, T], got shape {tuple(positions.shape)}")
        cache = self._cache_for(query)
        common.check_rotary_inputs(op, positions[0], query, key, self.head_size, cache)
        common.check_positions_in_range(op, positions, cache.shape[0])
        table = cache[positions]  # [modalities, T, rotary_dim]
        lanes = torch.tensor(self.mrope_dim, device=table.device)
        cos, sin = table.gather(0, lanes.expand(1, table.shape[1], -1)).squeeze(0).chunk(2, dim=-1)
        query = common.rotate_heads(query, cos, sin, self.head_size, self.is_neox_style)
        if key is not None:
            key = common.rotate_heads(key, cos, sin, self.head_size, self.is_neox_style)
        return query, key

    forward_cpu = forward_cuda = forward_hip = forward_xpu = forward_tpu = forward_kernel = forward_native
