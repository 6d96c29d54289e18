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
from customop.ops.rotary_embedding.yarn import yarn_get_mscale, yarn_inv_freq

Tensor = torch.Tensor


def mrope_select(rows: Tensor, mrope_section: list[int], interleaved: bool) -> Tensor:
    """``rows`` ``[3, T, rotary_dim/2]`` -> ``[T, rotary_dim/2]``: each lane from its section's row."""
    if interleaved:
        lane = torch.arange(rows.shape[-1], device=rows.device)
        out = torch.where((lane % 3 == 1) & (lane < 3 * mrope_section[1]), rows[1], rows[0])
        return torch.where((lane % 3 == 2) & (lane < 3 * mrope_section[2]), rows[2], out)
    return torch.cat([part[i] for i, part in enumerate(rows.split(mrope_section, dim=-1))], dim=-1)


def mrope_rotary_embedding(positions: Tensor, query: Tensor, key: Tensor | None, head_size: int,
                           cos_sin_cache: Tensor, is_neox_style: bool, mrope_section: list[int],
                           interleaved: bool = False) -> tuple[Tensor, Tensor | None]:
    """M-RoPE; ``positions`` ``[T]`` falls back to plain RoPE. Returns new tensors."""
    if positions.dim() == 1:
        return common.rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox_style)
    cos, sin = cos_sin_cache[positions].to(query.dtype).chunk(2, dim=-1)  # [3, T, rotary_dim/2] each
    cos, sin = mrope_select(cos, mrope_section, interleaved), mrope_select(sin, mrope_section, interleaved)
    query = common.rotate_heads(query, cos, sin, head_size, is_neox_style)
    if key is not None:
        key = common.rotate_heads(key, cos, sin, head_size, is_neox_style)
    return query, key


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE, optionally with YaRN frequencies (``scaling_factor`` given).

    As in vLLM, the cache holds ``4 * max_position_embeddings`` positions (video position ids
    grow with duration), and with YaRN that enlarged length is also the context the correction
    range is computed from.
    """

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float,
                 is_neox_style: bool, dtype: torch.dtype, mrope_section: list[int] | None = None,
                 mrope_interleaved: bool = False, *, scaling_factor: float | None = None,
                 extrapolation_factor: float = 1, attn_factor: float = 1, beta_fast: float = 32,
                 beta_slow: float = 1, truncate: bool = True) -> None:
        if mrope_section is not None and (len(mrope_section) != 3 or sum(mrope_section) != rotary_dim // 2):
            raise ValueError(f"MRotaryEmbedding: mrope_section must be three sizes summing to rotary_dim/2 = "
                             f"{rotary_dim // 2}, got {mrope_section}")
        self.mrope_section = list(mrope_section) if mrope_section is not None else None
        self.mrope_interleaved = mrope_interleaved
        self.scaling_factor = scaling_factor
        self.extrapolation_factor = extrapolation_factor
        self.attn_factor = attn_factor
        self.beta_fast = beta_fast
        self.beta_slow = beta_slow
        self.truncate = truncate
        self.mscale = 1.0 if scaling_factor is None else float(yarn_get_mscale(scaling_factor) * attn_factor)
        super().__init__(head_size, rotary_dim, 4 * max_position_embeddings, base, is_neox_style, dtype)

    def _compute_inv_freq(self, base: float) -> Tensor:
        if self.scaling_factor is None:
            return super()._compute_inv_freq(base)
        return yarn_inv_freq(base, self.rotary_dim, self.scaling_factor, self.max_position_embeddings,
                             self.beta_fast, self.beta_slow, self.extrapolation_factor, self.truncate)

    def _compute_cos_sin_cache(self) -> Tensor:
        if self.scaling_factor is None:
            return super()._compute_cos_sin_cache()
        t = torch.arange(common.cache_length(self.max_position_embeddings, self.scaling_factor), dtype=torch.float)
        return common.cos_sin_cache(t, self._compute_inv_freq(self.base), self.mscale)

    def forward_native(self, positions: Tensor, query: Tensor,
                       key: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """``positions`` ``[T]`` or ``[3, T]``; returns NEW tensors (on every platform)."""
        if positions.dim() == 2 and not self.mrope_section:
            raise ValueError("MRotaryEmbedding: positions [3, T] need mrope_section")
        return mrope_rotary_embedding(positions, query, key, self.head_size, self._cache_for(query),
                                      self.is_neox_style, self.mrope_section or [], self.mrope_interleaved)

    # Native everywhere: these names replace RotaryEmbedding's kernel paths.
    forward_cpu = forward_cuda = forward_hip = forward_xpu = forward_tpu = forward_native
