"""``DualChunkRotaryEmbedding`` (``dual_chunk_rotary_embedding``): the position scheme of Dual
Chunk Attention (Qwen2.5-1M, arXiv:2402.17463), which keeps relative positions below the trained
context by reusing positions chunk by chunk.

With ``L = chunk_size - local_size`` five caches are built (``cat(cos, sin)`` rows, like the base
op's): ``q`` at positions ``0..L-1``; ``qc`` at ``L..2L-1`` clamped to ``chunk_size``; ``k`` at
``p mod L`` for every ``p < max_pos``; ``qc_no_clamp`` at ``L..2L-1``; ``q_inter`` at
``chunk_size..chunk_size+L-1``. ``forward(positions, query, key, offsets=None)`` returns the key
rotated with the ``k`` cache at ``p`` and a query that CONCATENATES five rotated variants along
the last dim, each ``[T, heads * head_size]``:

1. intra: ``q`` at ``p mod L``;  2. successor: ``qc`` at ``p mod L``;
3. inter: ``qc`` at ``L - 1`` for every token;  4. successor-critical: ``qc_no_clamp`` at ``p mod L``;
5. inter-critical: ``q_inter`` at ``p mod L``.

Runs ``forward_native`` on every platform (it is what vLLM's CUDA path runs too). The caches are
built on the CPU and follow the query's device and dtype on first use, like the base op's.
"""

from __future__ import annotations

import math

import torch

from customop.custom_op import CustomOp
from customop.math import rotary as common
from customop.ops.rotary_embedding.base import buffer_like

Tensor = torch.Tensor

CACHE_NAMES = ("cos_sin_q_cache", "cos_sin_qc_cache", "cos_sin_k_cache", "cos_sin_qc_no_clamp_cache",
               "cos_sin_q_inter_cache")


def _rotate_rows(cos_sin: Tensor, x: Tensor, head_size: int, is_neox_style: bool, width: int) -> Tensor:
    """``x`` rotated with per-token cache rows ``cos_sin`` ``[T, rotary_dim]``, as ``[T, width]``
    (the width spelled out: ``-1`` cannot be inferred from an empty batch)."""
    cos, sin = cos_sin.to(x.dtype).chunk(2, dim=-1)
    return common.rotate_heads(x, cos, sin, head_size, is_neox_style).reshape(cos.shape[0], width)


@CustomOp.register("dual_chunk_rotary_embedding")
class DualChunkRotaryEmbedding(CustomOp):
    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float,
                 is_neox_style: bool, dtype: torch.dtype, chunk_size: int, local_size: int) -> None:
        super().__init__()
        common.check_rotary_dims("DualChunkRotaryEmbedding", head_size, rotary_dim)
        if not 0 <= local_size < chunk_size:
            raise ValueError(f"DualChunkRotaryEmbedding: need 0 <= local_size < chunk_size, got "
                             f"local_size={local_size}, chunk_size={chunk_size}")
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        self.is_neox_style = is_neox_style
        self.dtype = dtype
        self.chunk_size = chunk_size
        self.local_size = local_size
        for name, cache in zip(CACHE_NAMES, self._compute_cos_sin_cache()):
            self.register_buffer(name, cache.to(dtype), persistent=False)

    def _compute_cos_sin_cache(self) -> tuple[Tensor, ...]:
        inv_freq = common.rope_inv_freq(self.base, self.rotary_dim)
        chunk_len = self.chunk_size - self.local_size
        local = torch.arange(chunk_len, dtype=torch.float)
        positions = (
            local,                                                    # q
            (local + chunk_len).clamp(max=self.chunk_size),           # qc
            torch.arange(self.max_position_embeddings, dtype=torch.float) % chunk_len,  # k
            local + chunk_len,                                        # qc_no_clamp
            local + self.chunk_size,                                  # q_inter
        )
        return tuple(common.cos_sin_cache(t, inv_freq) for t in positions)

    def forward_native(self, positions: Tensor, query: Tensor, key: Tensor,
                       offsets: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Returns NEW tensors: query ``[T, 5 * heads * head_size]``, key ``[T, kv_heads * head_size]``."""
        q_cache, qc_cache, k_cache, qc_no_clamp_cache, q_inter_cache = (
            buffer_like(self, name, query) for name in CACHE_NAMES)
        if offsets is not None:
            positions = positions + offsets
        q_width, k_width = (math.prod(x.shape[positions.dim():]) for x in (query, key))
        positions = positions.flatten()
        local = positions % (self.chunk_size - self.local_size)
        args = (self.head_size, self.is_neox_style)
        key = _rotate_rows(k_cache[positions], key, *args, k_width)
        query = torch.cat((
            _rotate_rows(q_cache[local], query, *args, q_width),
            _rotate_rows(qc_cache[local], query, *args, q_width),
            _rotate_rows(qc_cache[-1].expand(positions.shape[0], -1), query, *args, q_width),
            _rotate_rows(qc_no_clamp_cache[local], query, *args, q_width),
            _rotate_rows(q_inter_cache[local], query, *args, q_width),
        ), dim=-1)
        return query, key

    def extra_repr(self) -> str:
        return (f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, chunk_size={self.chunk_size}, "
                f"local_size={self.local_size}, is_neox_style={self.is_neox_style}")
