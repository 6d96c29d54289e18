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


class DeepseekV4ScalingRotaryEmbedding(DeepseekScalingRotaryEmbedding):
    """DeepSeek-V4's variant (get_rope: ``is_deepseek_v4`` in ``rope_parameters``): the same
    frequencies, magnitude and rows, but

    - the cache is always fp32, and the rotation runs in fp32 and is cast back to the query's dtype;
    - the LAST ``rotary_dim`` lanes of each head rotate (the pass-through lanes come first), and the
      head size is ``query.shape[-1]`` (one instance serves heads of several sizes: pass
      ``[..., heads, head_size]``);
    - ``forward(positions, query, key=None, offsets=None, inverse=False)``: ``inverse`` rotates by
      the negative angle.

    customop runs it natively on every platform (the kernel entry point rotates the leading lanes).
    """

    def __init__(self, *args, **kwargs) -> None:
        kwargs.pop("init_cache", None)
        super().__init__(*args, **kwargs, init_cache=False)
        self.register_buffer("cos_sin_cache", self._compute_cos_sin_cache(), persistent=False)

    def forward_native(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None,
                       offsets: torch.Tensor | None = None,
                       inverse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        op = type(self).__name__
        rows = positions if offsets is None else positions + offsets
        cache = self.cos_sin_cache.to(query.device)
        common.check_positions_in_range(op, rows, cache.shape[0])
        cos, sin = cache[rows].chunk(2, dim=-1)  # fp32, [*positions.shape, rotary_dim/2]
        if inverse:
            sin = -sin

        def rotate(x: torch.Tensor) -> torch.Tensor:
            if x.shape[-1] < self.rotary_dim or x.shape[: positions.dim()] != positions.shape:
                raise ValueError(f"{op}: an input of shape {tuple(x.shape)} must start with positions' shape "
                                 f"{tuple(positions.shape)} and end in heads of at least {self.rotary_dim} lanes")
            lanes = (1,) * (x.dim() - positions.dim() - 1) + (self.rotary_dim // 2,)
            c, s = cos.reshape(*positions.shape, *lanes), sin.reshape(*positions.shape, *lanes)
            split = x.shape[-1] - self.rotary_dim
            rotated = common.rotate(x[..., split:].float(), c, s, self.is_neox_style)
            return torch.cat((x[..., :split], rotated.to(x.dtype)), dim=-1)

        return rotate(query), None if key is None else rotate(key)

    forward_cpu = forward_cuda = forward_hip = forward_xpu = forward_tpu = forward_kernel = forward_native
