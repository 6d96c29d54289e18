"""Kernel entry point of the MLA family: ``torch.ops.customop.mla_decode``, the latent half of
DeepSeek MLA's absorbed decode (``customop/math/mla.py``).

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
