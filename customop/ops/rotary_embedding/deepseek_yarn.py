"""DeepSeek-YaRN (``deepseek_yarn``): YaRN's frequencies with DeepSeek's magnitude correction

    mscale = yarn_get_mscale(s, mscale) / yarn_get_mscale(s, mscale_all_dim) * attn_factor

where ``yarn_get_mscale(s, m) = 0.1 * m * ln(s) + 1`` (1 for ``s <= 1``). DeepSeek-V2/V3 set
``mscale == mscale_all_dim``, so the cache is unscaled and the model instead multiplies the
attention softmax scale by ``yarn_get_mscale(s, mscale_all_dim) ** 2``.
"""

from __future__ import annotations

import torch

from customop.math import rotary as common
from customop.ops.rotary_embedding.base import RotaryEmbedding
from customop.ops.rotary_embedding.yarn import yarn_get_mscale, yarn_inv_freq


class DeepseekScalingRotaryEmbedding(RotaryEmbedding):
    """``max_position_embeddings`` is the ORIGINAL context (``original_max_position_embeddings``)."""

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float,
                 is_neox_style: bool, scaling_factor: float, dtype: torch.dtype, *,
                 extrapolation_factor: float = 1, attn_factor: float = 1, beta_fast: float = 32,
                 beta_slow: float = 1, mscale: float = 1, mscale_all_dim: float = 0) -> None:
        self.scaling_factor = scaling_factor
        self.extrapolation_factor = extrapolation_factor
        self.attn_factor = attn_factor
        self.beta_fast = beta_fast
        self.beta_slow = beta_slow
        self.mscale = float(yarn_get_mscale(scaling_factor, mscale)
                            / yarn_get_mscale(scaling_factor, mscale_all_dim) * attn_factor)
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)

    def _compute_inv_freq(self, base: float) -> torch.Tensor:
        return yarn_inv_freq(base, self.rotary_dim, self.scaling_factor, self.max_position_embeddings,
                             self.beta_fast, self.beta_slow, self.extrapolation_factor)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        t = torch.arange(common.cache_length(self.max_position_embeddings, self.scaling_factor), dtype=torch.float)
        return common.cos_sin_cache(t, self._compute_inv_freq(self.base), self.mscale)
