"""DeepSeek-YaRN (``deepseek_yarn``, alias ``deepseek_llama_scaling``): YaRN's frequencies (always
truncated) with DeepSeek's magnitude

    m = get_mscale(s, mscale) / get_mscale(s, mscale_all_dim)

where ``get_mscale(s, x) = 0.1 * x * ln(s) + 1`` (1 for ``s <= 1``). DeepSeek-V2/V3 set
``mscale == mscale_all_dim``, so the cache is unscaled and the model instead multiplies the
attention softmax scale by ``get_mscale(s, mscale_all_dim) ** 2``. The cache has ``ceil(L * s)``
rows (``L`` = the original context).

``forward(positions, query, key=None, offsets=None)`` as in vLLM 0.33: the cache row is
``positions + offsets``. customop also takes ``key=None`` and flat ``[T, heads * head_size]``
inputs (vLLM's needs a key and 3-D inputs); the rotation is the family's.
"""

from __future__ import annotations

import torch

from customop.math import rotary as common
from customop.ops.rotary_embedding.base import OffsetsForward, RotaryEmbedding
from customop.ops.rotary_embedding.yarn import yarn_get_mscale, yarn_inv_freq


class DeepseekScalingRotaryEmbedding(OffsetsForward, RotaryEmbedding):
    """``max_position_embeddings`` is the ORIGINAL context (``original_max_position_embeddings``)."""

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float,
                 is_neox_style: bool, scaling_factor: float, dtype: torch.dtype, *, beta_fast: float = 32,
                 beta_slow: float = 1, mscale: float = 1, mscale_all_dim: float = 0,
                 init_cache: bool = True) -> None:
        self.scaling_factor = scaling_factor
        self.beta_fast = beta_fast
        self.beta_slow = beta_slow
        self.mscale = float(yarn_get_mscale(scaling_factor, float(mscale))
                            / yarn_get_mscale(scaling_factor, float(mscale_all_dim)))
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype,
                         init_cache=init_cache)

    def _compute_inv_freq(self, base: float) -> torch.Tensor:
        return yarn_inv_freq(base, self.rotary_dim, self.scaling_factor, self.max_position_embeddings,
                             self.beta_fast, self.beta_slow)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        t = torch.arange(common.cache_length(self.max_position_embeddings, self.scaling_factor), dtype=torch.float)
        return common.cos_sin_cache(t, self._compute_inv_freq(self.base), self.mscale)
