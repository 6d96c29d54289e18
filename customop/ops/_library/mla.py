"""Kernel entry points of the MLA family: ``torch.ops.customop.mla_decode``, the latent half of
DeepSeek MLA's absorbed decode (``customop/math/mla.py``), and ``customop::mla_attention``, the
layer's whole cache write + attention as one opaque node for ``torch.compile`` (below).

The schema is a contract with the backends that register device kernels for it (Triton's
split-context launcher for CUDA/ROCm/XPU); do not change it:

- ``q_latent`` ``[B, N, L]`` (each row's query after absorbing ``W_UK``) and ``q_pe``
  ``[B, N, R]`` (its rotated rope part), one dtype; one query per row ``b``.
- ``kv_cache`` ``[num_blocks, block_size, L + R]``: per token its latent ``kv_c`` then its rope key.
- ``block_table`` ``[B, max_blocks]`` int32 and ``seq_lens`` ``[B]`` int32: row ``b`` attends to
  positions ``0 .. seq_lens[b] - 1``, position ``p`` at block ``block_table[b, p // block_size]``,
  offset ``p % block_size``. Entries beyond a row's length are never read (padding is free).
- ``max_seq_len``: an upper bound on ``seq_lens`` known on the host (a kernel sizes its context
  split by it), or ``0`` for "unknown" (then ``max_blocks * block_size`` bounds it: no host sync).
- ``scale``: the softmax scale. Scores and softmax in fp32.
- Returns a new contiguous ``[B, N, L]`` latent output in q's dtype; zeros where ``seq_lens[b]``
  is 0 (a softmax over nothing).

The body is the reference (``paged_latent_decode``: a loop over the rows); the fake gives the shape.
"""

from __future__ import annotations

import torch

from customop.math import mla as _math

Tensor = torch.Tensor

SCHEMAS = {
    "mla_decode": "(Tensor q_latent, Tensor q_pe, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
                  "int max_seq_len, float scale) -> Tensor",
    "mla_attention": "(Tensor q, Tensor kv_c_normed, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping, "
                     "Tensor block_table, Tensor seq_lens, Tensor query_start_loc, Tensor kv_b_weight, "
                     "int num_decodes, int[] dims, float scale, bool use_kernels) -> Tensor",
}


@torch.library.custom_op("customop::mla_decode", mutates_args=(), schema=SCHEMAS["mla_decode"])
def mla_decode(q_latent: Tensor, q_pe: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
               max_seq_len: int, scale: float) -> Tensor:
    """Absorbed MLA decode over a paged latent cache: ``[B, N, L]`` latent output."""
    return _math.paged_latent_decode(q_latent, q_pe, kv_cache, block_table, seq_lens, scale).contiguous()


@mla_decode.register_fake
def _(q_latent: Tensor, q_pe: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, max_seq_len: int,
      scale: float) -> Tensor:
    return q_latent.new_empty(q_latent.shape)


# ---- customop::mla_attention: the layer's attention as one node under torch.compile -------------
#
# ``mla_attention`` walks the batch's requests on the host (their lengths are data), which a traced
# graph cannot do; inside a caller's ``torch.compile`` the layer calls this op instead, so the
# projections around it fuse and the graph has no break. ``dims`` is ``MLADims.sizes``
# (``[num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank]``); ``use_kernels`` routes decode
# and fresh prefills through ``mla_decode`` / ``varlen_attn`` (the op's ``forward_kernel``) instead
# of the per-request spec (``forward_native``). Writes the batch's rows into ``kv_cache``.


@torch.library.custom_op("customop::mla_attention", mutates_args=("kv_cache",), schema=SCHEMAS["mla_attention"])
def mla_attention(q: Tensor, kv_c_normed: Tensor, k_pe: Tensor, kv_cache: Tensor, slot_mapping: Tensor,
                  block_table: Tensor, seq_lens: Tensor, query_start_loc: Tensor, kv_b_weight: Tensor,
                  num_decodes: int, dims: list[int], scale: float, use_kernels: bool) -> Tensor:
    meta = _math.MLAMetadata(slot_mapping, block_table, seq_lens, query_start_loc, num_decodes)
    kernels = {"latent_decode": torch.ops.customop.mla_decode,
               "varlen_attn": torch.ops.customop.varlen_attn} if use_kernels else {}
    return _math.mla_attention(q, kv_c_normed, k_pe, kv_cache, meta, kv_b_weight, _math.MLADims(*dims, scale),
                               **kernels)


@mla_attention.register_fake
def _(q: Tensor, kv_c_normed: Tensor, k_pe: Tensor, kv_cache: Tensor, slot_mapping: Tensor, block_table: Tensor,
      seq_lens: Tensor, query_start_loc: Tensor, kv_b_weight: Tensor, num_decodes: int, dims: list[int], scale: float,
      use_kernels: bool) -> Tensor:
    return q.new_empty(q.shape[0], dims[0] * dims[3])
