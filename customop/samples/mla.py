"""The MLA case table (``multi_head_latent_attention``): tiny DeepSeek-style layers (q LoRA or a plain
q projection; GPT-J DeepSeek-YaRN RoPE; the softmax scale with YaRN's ``mscale ** 2``) built from
customop's own layers, and batches of requests on a paged latent cache: decodes with long contexts,
a prefill with cached context (chunked prefill), a fresh prefill, a one-token prefill. Blocks are
handed out in a shuffled order so that the block table's indirection matters. The float64
reference is the tests' (``tests/cases/mla.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import torch

from customop.math.mla import MLAMetadata
from customop.ops.layernorm import RMSNorm
from customop.ops.linear import ReplicatedLinear
from customop.ops.mla import MLAModules, MultiHeadLatentAttentionWrapper
from customop.ops.rotary_embedding.deepseek_yarn import DeepseekScalingRotaryEmbedding
from customop.testing import FLOAT_DTYPES, Sample, randn, register_samples

HIDDEN, HEADS, NOPE, ROPE, V, KV_RANK, Q_RANK = 64, 4, 16, 8, 16, 24, 32
BLOCK_SIZE, NUM_BLOCKS = 4, 48
#: DeepSeek-YaRN: factor 4 over 16 original positions; DeepSeek scales the softmax by mscale ** 2
ROPE_FACTOR, ORIGINAL_POSITIONS = 4.0, 16
SCALE = (NOPE + ROPE) ** -0.5 * (0.1 * math.log(ROPE_FACTOR) + 1.0) ** 2


def _linear(n_in: int, n_out: int, dtype: torch.dtype, gen: torch.Generator, device) -> ReplicatedLinear:
    layer = ReplicatedLinear(n_in, n_out, bias=False, params_dtype=dtype, disable_tp=True).to(device)
    layer.weight.data = randn(n_out, n_in, dtype=dtype, device=device, scale=n_in ** -0.5, generator=gen)
    return layer


def _norm(n: int, dtype: torch.dtype, gen: torch.Generator, device) -> RMSNorm:
    norm = RMSNorm(n, dtype=dtype).to(device).requires_grad_(False)
    norm.weight.data = 1.0 + randn(n, dtype=dtype, device=device, scale=0.2, generator=gen)
    return norm


def build_modules(q_lora: bool, dtype: torch.dtype, device: str | torch.device = "cpu",
                  generator: torch.Generator | None = None) -> MLAModules:
    gen = generator or torch.Generator().manual_seed(0)
    rope = DeepseekScalingRotaryEmbedding(ROPE, ROPE, ORIGINAL_POSITIONS, 10000.0, False, ROPE_FACTOR, torch.float32,
                                          mscale=1.0, mscale_all_dim=1.0).to(device)
    common = {"kv_a_layernorm": _norm(KV_RANK, dtype, gen, device), "kv_b_proj": _linear(KV_RANK, HEADS * (NOPE + V), dtype, gen, device),
              "rotary_emb": rope, "o_proj": _linear(HEADS * V, HIDDEN, dtype, gen, device)}
    if q_lora:
        return MLAModules(**common, fused_qkv_a_proj=_linear(HIDDEN, Q_RANK + KV_RANK + ROPE, dtype, gen, device),
                          kv_a_proj_with_mqa=None, q_a_layernorm=_norm(Q_RANK, dtype, gen, device),
                          q_b_proj=_linear(Q_RANK, HEADS * (NOPE + ROPE), dtype, gen, device), q_proj=None)
    return MLAModules(**common, fused_qkv_a_proj=None, kv_a_proj_with_mqa=_linear(HIDDEN, KV_RANK + ROPE, dtype, gen, device),
                      q_a_layernorm=None, q_b_proj=None, q_proj=_linear(HIDDEN, HEADS * (NOPE + ROPE), dtype, gen, device))


def init_kwargs(modules: MLAModules, q_lora: bool) -> dict[str, Any]:
    return {"hidden_size": HIDDEN, "num_heads": HEADS, "scale": SCALE, "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE,
            "v_head_dim": V, "q_lora_rank": Q_RANK if q_lora else None, "kv_lora_rank": KV_RANK, "mla_modules": modules}


@dataclasses.dataclass(frozen=True)
class Batch:
    """Requests as ``(cached context, new tokens)``; the first ``num_decodes`` are decodes."""

    label: str
    requests: tuple[tuple[int, int], ...]
    num_decodes: int

    def build(self, dtype: torch.dtype, device: str | torch.device = "cpu", generator: torch.Generator | None = None):
        """``(positions, hidden_states, kv_cache, metadata)``; the cache holds random rows at the
        requests' cached positions (earlier steps' writes) and NaN everywhere else, so a read of
        an unwritten row shows."""
        gen = generator or torch.Generator().manual_seed(1)
        order = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
        free = iter(order)
        cache = torch.full((NUM_BLOCKS, BLOCK_SIZE, KV_RANK + ROPE), float("nan"), dtype=dtype)
        width = max(-(-(c + n) // BLOCK_SIZE) for c, n in self.requests)
        table = torch.zeros(len(self.requests), width, dtype=torch.int32)
        positions, slots, starts = [], [], [0]
        for r, (cached, new) in enumerate(self.requests):
            blocks = [next(free) for _ in range(-(-(cached + new) // BLOCK_SIZE))]
            table[r, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            for p in range(cached):
                cache[blocks[p // BLOCK_SIZE], p % BLOCK_SIZE] = randn(KV_RANK + ROPE, dtype=dtype, generator=gen)
            positions += range(cached, cached + new)
            slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(cached, cached + new)]
            starts.append(starts[-1] + new)
        meta = MLAMetadata(torch.tensor(slots, device=device), table.to(device),
                           torch.tensor([c + n for c, n in self.requests], device=device),
                           torch.tensor(starts, device=device), self.num_decodes)
        hidden = randn(len(positions), HIDDEN, dtype=dtype, device=device, generator=gen)
        return torch.tensor(positions, device=device), hidden, cache.to(device), meta


class OneRequest:
    """One request of ``tokens`` tokens over the blocks [7, 2, 5] of a layer built like the
    samples' (no q LoRA): ``step(cache, start, count, decode)`` runs ``forward_kernel`` on tokens
    ``start .. start + count`` as one prefill or decode step, ``fresh()`` is an all-NaN cache.
    For decode == prefill checks: the same hidden states stepped in different splits."""

    def __init__(self, dtype: torch.dtype, tokens: int = 9, seed: int = 5):
        self.op = MultiHeadLatentAttentionWrapper(**init_kwargs(build_modules(False, dtype), False))
        self.dtype = dtype
        self.hidden = randn(tokens, HIDDEN, dtype=dtype, generator=torch.Generator().manual_seed(seed))
        self.table = torch.tensor([[7, 2, 5]], dtype=torch.int32)

    def fresh(self) -> torch.Tensor:
        return torch.full((NUM_BLOCKS, BLOCK_SIZE, KV_RANK + ROPE), float("nan"), dtype=self.dtype)

    def step(self, cache: torch.Tensor, start: int, count: int, decode: bool) -> torch.Tensor:
        pos = torch.arange(start, start + count)
        slots = self.table[0, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        meta = MLAMetadata(slots, self.table, torch.tensor([start + count]), torch.tensor([0, count]), int(decode))
        return self.op.forward_kernel(pos, self.hidden[start:start + count], cache, meta)


BATCHES = (
    Batch("2 decodes + chunked prefill + prefill", ((13, 1), (6, 1), (5, 7), (0, 9)), 2),
    Batch("decode only, 1 to 3 blocks", ((3, 1), (11, 1), (0, 1)), 3),
    Batch("prefills: one token, one block, odd", ((0, 1), (0, 4), (2, 13)), 0),
)
DTYPES = FLOAT_DTYPES


@register_samples("multi_head_latent_attention", DTYPES)
def _samples(dtype: torch.dtype, device: str, gen: torch.Generator) -> list[Sample]:
    samples = []
    for q_lora, batch in itertools.product((True, False), BATCHES[:2]):
        modules = build_modules(q_lora, dtype, device, gen)
        samples.append(Sample(init_kwargs(modules, q_lora), batch.build(dtype, device, gen),
                              label=f"{'q_lora' if q_lora else 'q_proj'} {batch.label}"))
    return samples
