"""Benchmark specs of MLA decode (``mla_decode``, the latent attention of DeepSeek MLA's absorbed
decode): DeepSeek-V3 shapes (128 heads, kv_lora_rank 512, rope 64, blocks of 64), bf16, batch 1,
16 and 64 at contexts 4096 and 32768, every row the full context, blocks shuffled (issue 13).

Implementations:
- ``customop``: ``torch.ops.customop.mla_decode`` (the Triton split-context kernel on GPUs), the
  context bound given as a host int as the layer gives it;
- ``eager``: the absorbed math of ``customop/math/mla.py`` (``latent_attention``: fp32 scores,
  softmax, ``P @ kv_c``) batched over rows of equal length: one gather of the rows through the
  block table, then bmm / softmax / bmm;
- ``compile``: ``torch.compile`` of ``eager`` (the issue's baseline: 21-31% of copy bandwidth);
- ``spec``: the op's reference, ``paged_latent_decode`` (a loop over rows).

Decode is bound by the latent cache read: ``bytes_moved`` counts each row of the cache once
(``batch * context * (L + R) * 2``) plus q and the output, so the runner's GB/s column over the
copy bandwidth is the fraction of the floor reached (target: >= 70% at 64 x 4096 and 1 x 32768).
"""

from __future__ import annotations

from typing import Any

import torch

from customop.benchmarks.specs import OpSpec, Shape, compiled
from customop.math import mla as native

HEADS, LATENT, ROPE, BLOCK = 128, 512, 64, 64
SCALE = (128 + ROPE) ** -0.5

SHAPES = tuple(
    Shape(batch, HEADS * LATENT, f"b{batch} ctx{context}", {"context": context},
          quick=(batch, context) in ((64, 4096), (1, 32768)))
    for batch in (1, 16, 64) for context in (4096, 32768)
)


def _inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    batch, context = shape.tokens, shape.extra["context"]
    if device.type == "cpu":
        context = min(context, 2 * BLOCK + 3)  # the runner's dry run (interpreter): check the pipeline, not sizes
    width = -(-context // BLOCK)
    cache = torch.randn(batch * width, BLOCK, LATENT + ROPE, device=device).to(dtype)
    table = torch.randperm(batch * width, device=device).view(batch, width).int()
    return {"q_latent": torch.randn(batch, HEADS, LATENT, device=device).to(dtype),
            "q_pe": torch.randn(batch, HEADS, ROPE, device=device).to(dtype),
            "cache": cache, "table": table, "context": context,
            "lens": torch.full((batch,), context, dtype=torch.int32, device=device)}


def _bytes(shape: Shape, dtype: torch.dtype) -> int:
    batch, context = shape.tokens, shape.extra["context"]
    return (batch * context * (LATENT + ROPE) + batch * HEADS * (2 * LATENT + ROPE)) * dtype.itemsize


def _customop(i):
    args = (i["q_latent"], i["q_pe"], i["cache"], i["table"], i["lens"], i["context"], SCALE)
    return lambda: torch.ops.customop.mla_decode(*args)


def batched_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, table: torch.Tensor,
                   context: int) -> torch.Tensor:
    """``latent_attention`` for rows that all see ``context`` positions, batched."""
    pos = torch.arange(context, device=cache.device)
    rows = cache[table[:, pos // BLOCK].long(), pos % BLOCK].float()  # [B, context, L + R]
    query = torch.cat((q_latent, q_pe), dim=-1).float()
    scores = torch.einsum("bnc,bsc->bns", query, rows) * SCALE
    return torch.einsum("bns,bsl->bnl", scores.softmax(-1), rows[..., :LATENT]).to(q_latent.dtype)


def _eager(i):
    return lambda: batched_decode(i["q_latent"], i["q_pe"], i["cache"], i["table"], i["context"])


def _compile(i):
    fn = compiled(batched_decode)
    return lambda: fn(i["q_latent"], i["q_pe"], i["cache"], i["table"], i["context"])


def _spec(i):
    return lambda: native.paged_latent_decode(i["q_latent"], i["q_pe"], i["cache"], i["table"], i["lens"], SCALE)


SPECS = [
    OpSpec(name="mla_decode", family="mla", shapes=SHAPES, make_inputs=_inputs, bytes_moved=_bytes,
           impls={"customop": _customop, "eager": _eager, "compile": _compile, "spec": _spec},
           dtypes=(torch.bfloat16,)),
]
