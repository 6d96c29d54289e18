"""LongRoPE (``longrope``, Phi-3 / Phi-4 long-context models): per-frequency rescale factors, one
list for the original context and one for the long one.

With ``O`` = ``original_max_position_embeddings``, ``L`` = max_position, ``d = rotary_dim``:

- ``inv_X[i] = 1 / (factor_X[i] * base^(2i/d))`` for X in (short, long), ``d/2`` factors each;
- magnitude ``f = sqrt(1 + ln(L/O) / ln(O))`` (1 when ``L <= O``); ``short_mscale`` and
  ``long_mscale`` default to it;
- the cache stacks the short table (``O`` rows at ``inv_short``, times ``short_mscale``) above the
  long one (``L`` rows at ``inv_long``, times ``long_mscale``): ``[O + L, d]``, also reachable as
  ``long_short_cos_sin_cache`` (vLLM's name);
- the row of a token is ``positions (+ O when use_long_rope) (+ offsets)``. ``use_long_rope`` is
  ``max_model_len > O``, fixed per instance as in vLLM 0.33 (no per-batch switch). vLLM reads
  ``max_model_len`` from its global config; customop takes it as an argument (get_rope: the
  ``max_model_len`` key of ``rope_parameters``), defaulting to ``L``.

NeoX pairing only (vLLM raises otherwise). Unlike vLLM's plain module, this is a RotaryEmbedding:
the same dispatch, kernels and checks as its siblings; ``key`` may be None.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from customop.math import rotary as common
from customop.ops.rotary_embedding.base import OffsetsForward, RotaryEmbedding

Tensor = torch.Tensor


def longrope_mscale(max_position: int, original_max_position: int) -> float:
    scale = max_position / original_max_position
    return 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(original_max_position))


class Phi3LongRoPEScaledRotaryEmbedding(OffsetsForward, RotaryEmbedding):
    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int,
                 original_max_position_embeddings: int, base: float, is_neox_style: bool, dtype: torch.dtype,
                 short_factor: Sequence[float], long_factor: Sequence[float], short_mscale: float | None = None,
                 long_mscale: float | None = None, *, max_model_len: int | None = None) -> None:
        op = type(self).__name__
        if not is_neox_style:
            raise ValueError(f"{op}: only NeoX style (is_neox_style=True) is supported")
        for name, factors in (("short_factor", short_factor), ("long_factor", long_factor)):
            if len(factors) != rotary_dim // 2:
                raise ValueError(f"{op}: {name} needs rotary_dim/2 = {rotary_dim // 2} entries, got {len(factors)}")
        self.original_max_position_embeddings = original_max_position_embeddings
        self.short_factor, self.long_factor = list(short_factor), list(long_factor)
        self.max_model_len = max_position_embeddings if max_model_len is None else max_model_len
        self.use_long_rope = self.max_model_len > original_max_position_embeddings
        default = longrope_mscale(max_position_embeddings, original_max_position_embeddings)
        self.short_mscale = default if short_mscale is None else short_mscale
        self.long_mscale = default if long_mscale is None else long_mscale
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype,
                         init_cache=False)
        short = self._table(original_max_position_embeddings, self.short_factor, self.short_mscale).to(dtype)
        long = self._table(max_position_embeddings, self.long_factor, self.long_mscale).to(dtype)
        self.register_buffer("cos_sin_cache", torch.cat((short, long)), persistent=False)

    def _table(self, rows: int, factors: list[float], mscale: float) -> Tensor:
        pos_freqs = self.base ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim)
        inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * pos_freqs)
        return common.cos_sin_cache(torch.arange(rows, dtype=torch.float), inv_freq, mscale)

    @property
    def long_short_cos_sin_cache(self) -> Tensor:
        return self.cos_sin_cache

    def _cache_index(self, positions: Tensor, offsets: Tensor | None) -> Tensor:
        if self.use_long_rope:
            positions = positions + self.original_max_position_embeddings
        return positions if offsets is None else positions + offsets

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", original_max_position_embeddings={self.original_max_position_embeddings}, "
                f"use_long_rope={self.use_long_rope}")
