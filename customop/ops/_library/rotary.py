"""Kernel entry point of the rotary family: ``torch.ops.customop.rotary_embedding``.

The schema is a contract with the backends (Triton for CUDA/ROCm/XPU) that register device kernels
for it; do not change it. ``positions`` is flattened to ``[T]``; ``query``/``key`` are
``[T, heads * head_size]`` or anything viewable as ``[T, -1, head_size]``; only the first
``rotary_dim = cos_sin_cache.shape[-1]`` lanes of each head rotate (NeoX halves or GPT-J pairs).
``cos_sin_cache`` is ``[max_pos, rotary_dim]`` = ``cat(cos, sin)``, in the query's dtype.
``query`` and ``key`` are rotated IN PLACE; ``key`` may be None.

The body below is the reference (runs on any device): the pure math, written back with
``copy_``. The fake returns nothing: the op only mutates its inputs.
"""

from __future__ import annotations

import torch

from customop.math import rotary as _math

Tensor = torch.Tensor

#: Written out rather than inferred so that the contract reads exactly as the backends see it
#: (inference would spell ``int`` as ``SymInt``).
SCHEMAS = {
    "rotary_embedding": "(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size, "
                        "Tensor cos_sin_cache, bool is_neox) -> ()",
}


@torch.library.custom_op("customop::rotary_embedding", mutates_args=("query", "key"),
                         schema=SCHEMAS["rotary_embedding"])
def rotary_embedding(positions: Tensor, query: Tensor, key: Tensor | None, head_size: int,
                     cos_sin_cache: Tensor, is_neox: bool) -> None:
    """In place: ``query``/``key`` <- RoPE of themselves at ``positions``."""
    _math.check_rotary_inputs("customop::rotary_embedding", positions, query, key, head_size, cos_sin_cache)
    new_query, new_key = _math.rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)
    query.copy_(new_query)
    if key is not None:
        key.copy_(new_key)


@rotary_embedding.register_fake
def _(positions: Tensor, query: Tensor, key: Tensor | None, head_size: int,
      cos_sin_cache: Tensor, is_neox: bool) -> None:
    return None
