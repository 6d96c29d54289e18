"""Multimodal RoPE (M-RoPE, Qwen2-VL arXiv:2409.12191): three position rows (temporal, height,
width), each driving its own section of the rotary frequencies.

``positions`` is ``[T]`` (text only: plain RoPE) or ``[3, T]``. With ``mrope_section = [t, h, w]``
(``t + h + w = rotary_dim / 2``), frequency lane ``j`` takes its cos/sin from row 0 for the first
``t`` lanes, row 1 for the next ``h``, row 2 for the last ``w``. The interleaved layout (Qwen3-VL)
instead assigns lane ``j`` to row 1 when ``j % 3 == 1 and j < 3h``, to row 2 when
``j % 3 == 2 and j < 3w``, and to row 0 otherwise.

Runs ``forward_native`` on every platform (no kernel entry point for the per-section gather).
"""

from __future__ import annotations

import torch

from customop.math import rotary as common
from customop.ops.rotary_embedding.base import RotaryEmbedding
from customop.ops.rotary_embedding.yarn import yarn_inv_freq, yarn_magnitude

Tensor = torch.Tensor


def mrope_select(rows: Tensor, mrope_section: list[int], interleaved: bool) -> Tensor:
    """``rows`` ``[3, T, rotary_dim/2]`` -> ``[T, rotary_dim/2]``: each lane from its section's row."""
    if interleaved:
        lane = torch.arange(rows.shape[-1], device=rows.device)
        out = torch.where((lane % 3 == 1) & (lane < 3 * mrope_section[1]), rows[1], rows[0])
        return torch.where((lane % 3 == 2) & (lane < 3 * mrope_section[2]), rows[2], out)
    return torch.cat([part[i] for i, part in enumerate(rows.split(mrope_section, dim=-1))], dim=-1)


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE, optionally with YaRN frequencies (``scaling_factor`` given; the magnitude follows
    YaRN's rule, ``yarn.yarn_magnitude``).

    As in vLLM 0.33, the cache holds ``positions_factor * max_position_embeddings`` positions
    (get_rope's ``mrope_positions_factor``, 4 by default: video position ids grow with duration),
    and with YaRN that enlarged length is also the context the correction range is computed from
    (``ceil(positions_factor * L * s)`` rows).

    ``forward(positions, query, key=None, offsets=None)``: vLLM's signature; ``offsets`` is accepted
    and ignored, as there.
    """

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float,
                 is_neox_style: bool, dtype: torch.dtype, mrope_section: list[int] | None = None,
                 mrope_interleaved: bool = False, *, positions_factor: int = 4, scaling_factor: float | None = None,
                 beta_fast: float = 32, beta_slow: float = 1, mscale: float | None = None,
                 mscale_all_dim: float | None = None, attention_factor: float | None = None,
                 truncate: bool = True) -> None:
        if mrope_section is not None and sum(mrope_section) != rotary_dim // 2:
            raise ValueError(f"{type(self).__name__}: mrope_section must sum to rotary_dim/2 = "
                             f"{rotary_dim // 2}, got {mrope_section}")
        self.mrope_section = list(mrope_section) if mrope_section is not None else None
        self.mrope_interleaved = mrope_interleaved
        self.positions_factor = positions_factor
        self.scaling_factor = scaling_factor
        self.beta_fast = beta_fast
        self.beta_slow = beta_slow
        self.truncate = truncate
        self.mscale = 1.0 if scaling_factor is None else yarn_magnitude(scaling_factor, mscale, mscale_all_dim,
                                                                        attention_factor)
        super().__init__(head_size, rotary_dim, positions_factor * max_position_embeddings, base, is_neox_style,
                         dtype)

    def _compute_inv_freq(self, base: float) -> Tensor:
        if self.scaling_factor is None:
            return super()._compute_inv_freq(base)
        return yarn_inv_freq(base, self.rotary_dim, self.scaling_factor, self.max_position_embeddings,
                             self.beta_fast, self.beta_slow, self.truncate)

    def _compute_cos_sin_cache(self) -> Tensor:
        if self.scaling_factor is None:
            return super()._compute_cos_sin_cache()
        t = torch.arange(common.cache_length(self.max_position_embeddings, self.scaling_factor), dtype=torch.float)
        return common.cos_sin_cache(t, self._compute_inv_freq(self.base), self.mscale)

    def select_cos_sin(self, positions: Tensor, cache: Tensor) -> tuple[Tensor, Tensor]:
        """``[3, T]`` positions -> per-token ``cos``, ``sin`` ``[T, rotary_dim/2]`` (this class's layout)."""
        cos, sin = cache[positions].chunk(2, dim=-1)  # [3, T, rotary_dim/2] each
        section = self.mrope_section or []
        return mrope_select(cos, section, self.mrope_interleaved), mrope_select(sin, section, self.mrope_interleaved)

    def forward_native(self, positions: Tensor, query: Tensor, key: Tensor | None = None,
                       offsets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """``positions`` ``[T]`` (plain RoPE) or ``[3, T]``; returns NEW tensors (on every platform)."""
        cache = self._cache_for(query)
        name = type(self).__name__
        if positions.dim() == 2:
            if not self.mrope_section:
                raise ValueError(f"{name}: positions [3, T] need mrope_section")
            if positions.shape[0] != 3:
                raise ValueError(f"{name}: 2-D positions must be [3, T] (t, h, w), got shape {tuple(positions.shape)}")
        elif positions.dim() != 1:
            raise ValueError(f"{name}: positions must be [T] or [3, T], got shape {tuple(positions.shape)}")
        common.check_rotary_inputs(name, positions[0] if positions.dim() == 2 else positions, query, key,
                                   self.head_size, cache)
        common.check_positions_in_range(name, positions, cache.shape[0])
        if positions.dim() == 1:
            return common.rotary_embedding(positions, query, key, self.head_size, cache, self.is_neox_style)
        cos, sin = self.select_cos_sin(positions, cache)
        cos, sin = cos.to(query.dtype), sin.to(query.dtype)
        query = common.rotate_heads(query, cos, sin, self.head_size, self.is_neox_style)
        if key is not None:
            key = common.rotate_heads(key, cos, sin, self.head_size, self.is_neox_style)
        return query, key

    # Native everywhere: these names replace RotaryEmbedding's kernel paths.
    forward_cpu = forward_cuda = forward_hip = forward_xpu = forward_tpu = forward_kernel = forward_native
