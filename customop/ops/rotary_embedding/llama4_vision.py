"""Llama 4's vision-encoder RoPE (``mllama4``): a 2-D rotation per image patch, no positions.

``max_position_embeddings`` is the patch count ``N = (image_size // patch_size)^2``; with
``n = int(sqrt(N))`` patch ``p`` sits at column ``x = p mod n`` and row ``y = p div n``. Row ``p``
of the complex64 cache ``[N + 1, 1, rotary_dim]`` is ``exp(i * cat((x + 1) * f, (y + 1) * f))``
with ``f = base^(-2j / rotary_dim)`` (``rotary_dim / 2`` entries); the last row, the CLS token,
is 1 (no rotation).

``forward(query, key)``: ``query``/``key`` ``[B, N + 1, heads, head_size]`` with
``head_size = 2 * rotary_dim``; adjacent lanes ``(2j, 2j + 1)`` form a complex number that is
multiplied by row ``s``, lane ``j`` of the cache, in fp32 (complex64); the result is cast back.
Returns NEW tensors on every platform (vLLM runs this native on CUDA too).
"""

from __future__ import annotations

import math

import torch

from customop.math import rotary as common
from customop.ops.rotary_embedding.base import RotaryEmbedding

Tensor = torch.Tensor


class Llama4VisionRotaryEmbedding(RotaryEmbedding):
    """The cache stays complex64 whatever ``dtype`` says (vLLM's model passes complex64; a real
    dtype would drop the imaginary part)."""

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float,
                 is_neox_style: bool, dtype: torch.dtype) -> None:
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype,
                         init_cache=False)
        self.register_buffer("cos_sin_cache", self._compute_cos_sin_cache(), persistent=False)

    def _compute_cos_sin_cache(self) -> Tensor:
        inv_freq = common.rope_inv_freq(self.base, self.rotary_dim)
        patches = self.max_position_embeddings
        side = int(math.sqrt(patches))
        index = torch.arange(patches)
        x, y = (index % side + 1)[:, None], (index // side + 1)[:, None]
        freqs = torch.cat((x * inv_freq, y * inv_freq), dim=-1).float()
        freqs = torch.cat((freqs, freqs.new_zeros(1, freqs.shape[-1])))  # the CLS row: no rotation
        return torch.polar(torch.ones_like(freqs), freqs)[:, None, :]

    def forward_native(self, query: Tensor, key: Tensor) -> tuple[Tensor, Tensor]:
        op = "Llama4VisionRotaryEmbedding"
        if key is None:
            raise ValueError(f"{op}: key is required")
        rows = self.cos_sin_cache.shape[0]
        for name, x in (("query", query), ("key", key)):
            if x.dim() != 4 or x.shape[1] != rows or x.shape[-1] != 2 * self.rotary_dim:
                raise ValueError(f"{op}: {name} must be [batch, {rows} (patches + CLS), heads, "
                                 f"{2 * self.rotary_dim}], got shape {tuple(x.shape)}")
        freqs = self.cos_sin_cache.to(query.device).view(1, rows, 1, self.rotary_dim)

        def rotate(x: Tensor) -> Tensor:
            z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
            return torch.view_as_real(z * freqs).flatten(3).type_as(x)

        return rotate(query), rotate(key)

    # Native everywhere: these names replace RotaryEmbedding's kernel paths.
    forward_cpu = forward_cuda = forward_hip = forward_xpu = forward_tpu = forward_kernel = forward_native
