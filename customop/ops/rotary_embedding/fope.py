"""Fourier position embedding (FoPE, InternS1-Pro; get_rope: ``default`` with ``use_fope``): each
KV head mixes the RoPE frequencies with learned coefficients.

- Frequencies: ``inv = base^(-2i / rotary_dim)``, the first ``num_inv_freq`` of them if given,
  else those above ``2 pi / max_position`` (``F`` of them, the ``inv_freq`` buffer).
- Parameters ``cos_coef`` and ``sin_coef``, ``[kv_heads, F, F]`` (this rank's heads; the loader
  slices the checkpoint's and replicates when there are fewer heads than ranks).
- Cache ``[max_position, kv_heads, 2 * head_size]``, fp32 then ``dtype``: for head ``h`` and
  position ``t``, ``c = cos(t * inv) @ cos_coef[h]`` and ``s = sin(t * inv) @ sin_coef[h]``, padded
  to ``head_size / 2`` lanes with cos 1 and sin 0 (identity), each duplicated (``cat(c, c)``) and
  joined as ``cat(cos, sin)``. It is rebuilt on the first forward after the coefficients change
  (``weight_loader``), as vLLM rebuilds it on the first forward.
- ``forward(positions, query, key, offsets=None)``: a key is required; ``offsets``,
  ``rotary_dim`` and the style are not used (NeoX pairing over the whole head). Query head ``j``
  uses KV head ``j // (heads / kv_heads)``. Returns NEW 3-D tensors ``[T, heads, head_size]`` and
  ``[T, kv_heads, head_size]``, on every platform.

Only the per-head form (``fope_sep_head`` true) exists: vLLM's other form cannot be built.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from customop.distributed import get_tp_group
from customop.math import rotary as common
from customop.ops.rotary_embedding.base import RotaryEmbedding

Tensor = torch.Tensor


class FourierRotaryEmbedding(RotaryEmbedding):
    """The coefficients start as identity matrices (vLLM leaves them uninitialised), so an
    unloaded FoPE is plain RoPE on its ``F`` frequencies."""

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float,
                 is_neox_style: bool, dtype: torch.dtype, init_cache: bool, num_key_value_heads: int,
                 num_inv_freq: int | None, fope_sep_head: bool, fope_init_factor: float) -> None:
        op = type(self).__name__
        if not fope_sep_head:
            raise ValueError(f"{op}: only fope_sep_head=True is supported (vLLM's other form cannot be built)")
        self.num_key_value_heads = num_key_value_heads
        self.num_inv_freq = num_inv_freq
        self.fope_sep_head = fope_sep_head
        self.fope_init_factor = fope_init_factor  # stored, unused (as in vLLM)
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype, init_cache=False)
        self.inv_freq: Tensor
        self.register_buffer("inv_freq", self._compute_inv_freq(base), persistent=False)
        n = self.inv_freq.shape[-1]
        if 2 * n > head_size:
            raise ValueError(f"{op}: {n} frequencies do not fit heads of {head_size} lanes")
        eye = torch.eye(n).expand(num_key_value_heads, n, n)
        self.cos_coef = nn.Parameter(eye.clone(), requires_grad=False)
        self.sin_coef = nn.Parameter(eye.clone(), requires_grad=False)
        self.cos_coef.weight_loader = self.sin_coef.weight_loader = self.weight_loader
        self.register_buffer("cos_sin_cache", self._compute_cos_sin_cache().to(dtype), persistent=False)
        self.update_cache = False

    def _compute_inv_freq(self, base: float) -> Tensor:
        inv_freq = common.rope_inv_freq(base, self.rotary_dim)
        if self.num_inv_freq is not None:
            return inv_freq[: self.num_inv_freq]
        return inv_freq[inv_freq > 2.0 * math.pi / self.max_position_embeddings]

    def _compute_cos_sin_cache(self) -> Tensor:
        t = torch.arange(self.max_position_embeddings, dtype=torch.float, device=self.inv_freq.device)
        freqs = torch.outer(t, self.inv_freq)  # [L, F]
        cos = torch.einsum("tf,hfg->thg", freqs.cos(), self.cos_coef.float())
        sin = torch.einsum("tf,hfg->thg", freqs.sin(), self.sin_coef.float())
        pad = self.head_size // 2 - cos.shape[-1]
        cos = nn.functional.pad(cos, (0, pad), value=1.0)
        sin = nn.functional.pad(sin, (0, pad), value=0.0)
        return torch.cat((cos, cos, sin, sin), dim=-1)  # [L, kv_heads, 2 * head_size]

    def weight_loader(self, param: nn.Parameter, loaded: Tensor) -> None:
        """``loaded``: the checkpoint's ``[total_kv_heads, F, F]``; this rank keeps its heads."""
        tp = get_tp_group()
        size, rank = tp.tp_size, tp.tp_rank
        heads = loaded.shape[0]
        if heads < size:  # fewer heads than ranks: each head serves size // heads ranks
            rank, size = rank // (size // heads), heads
        part = loaded.chunk(size, dim=0)[rank]
        if part.shape != param.shape:
            raise ValueError(f"{type(self).__name__}.weight_loader: this rank's slice has shape {tuple(part.shape)}, "
                             f"the parameter {tuple(param.shape)}")
        param.data.copy_(part)
        self.update_cache = True

    def forward_native(self, positions: Tensor, query: Tensor, key: Tensor,
                       offsets: Tensor | None = None) -> tuple[Tensor, Tensor]:
        op = type(self).__name__
        if key is None:
            raise ValueError(f"{op}: key is required")
        if self.update_cache:
            self.cos_sin_cache.copy_(self._compute_cos_sin_cache().to(self.cos_sin_cache.dtype))
            self.update_cache = False
        positions = positions.flatten()
        tokens, kv_heads = positions.shape[0], self.num_key_value_heads
        cache = self._cache_for(query)
        common.check_positions_in_range(op, positions, cache.shape[0])
        cos, sin = cache.index_select(0, positions).chunk(2, dim=-1)  # [T, kv_heads, head_size] each
        cos, sin = cos[..., : self.head_size // 2].reshape(tokens * kv_heads, 1, -1), \
            sin[..., : self.head_size // 2].reshape(tokens * kv_heads, 1, -1)
        q = query.reshape(tokens, -1, self.head_size)
        k = key.reshape(tokens, -1, self.head_size)
        if q.shape[1] % kv_heads or k.shape[1] != kv_heads:
            raise ValueError(f"{op}: expected {kv_heads} key heads and a multiple of them as query heads, got "
                             f"{k.shape[1]} and {q.shape[1]}")
        out_q = common.rotate(q.reshape(tokens * kv_heads, -1, self.head_size), cos, sin, True)
        out_k = common.rotate(k.reshape(tokens * kv_heads, 1, self.head_size), cos, sin, True)
        return out_q.reshape(q.shape), out_k.reshape(k.shape)

    forward_cpu = forward_cuda = forward_hip = forward_xpu = forward_tpu = forward_kernel = forward_native
