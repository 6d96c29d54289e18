"""Logits from the last hidden states (op-semantics.md D.6).

1. local logits: ``hidden · W_localᵀ (+ bias)`` with the LM head's weight (this rank's vocab rows);
2. under tensor parallelism, the ranks' slices are concatenated on the last dim: an all-gather
   when ``current_platform().use_all_gather()`` (read at construction), else a gather to rank 0,
   whose other ranks return None;
3. the vocab padding is sliced off: ``logits[..., :org_vocab_size]``; when the LM head also holds
   an added (LoRA) vocab, each rank's slice is ``[original rows | added rows]`` and only the
   original rows are kept (vLLM's base processor drops the added vocab too; its LoRA wrapper
   computes those logits);
4. soft cap, then scale: ``logits = cap · tanh(logits / cap)``; ``logits *= scale`` (scale != 1).

The bias is ``embedding_bias`` when given (vLLM's argument), else the LM head's own bias if it has
one (vLLM ignores ``lm_head.bias`` unless the model passes it; here it is not silently dropped).
"""

from __future__ import annotations

import torch

from customop.custom_op import CustomOp
from customop.distributed import TPGroup, get_tp_group
from customop.ops.linear import Gemm, cpu_linear, linear
from customop.ops.vocab_parallel_embedding import VocabShard
from customop.platforms import current_platform


def gather_logits(local: torch.Tensor, tp: TPGroup, use_all_gather: bool) -> torch.Tensor | None:
    """Every rank's vocab slice concatenated on the last dim; on rank 0 only unless all-gather."""
    return tp.all_gather(local, dim=-1) if use_all_gather else tp.gather(local, dst=0, dim=-1)


def postprocess_logits(logits: torch.Tensor, org_vocab_size: int | None, soft_cap: float | None,
                       scale: float) -> torch.Tensor:
    """Drops padding columns (unless ``org_vocab_size`` is None), applies ``cap·tanh(x/cap)`` and
    then the scale (in that order)."""
    if org_vocab_size is not None:
        logits = logits[..., :org_vocab_size]
    if soft_cap is not None:
        logits = torch.tanh(logits / soft_cap) * soft_cap
    if scale != 1.0:
        logits = logits * scale
    return logits


def original_vocab(logits: torch.Tensor, shard: VocabShard | None, tp_size: int) -> torch.Tensor:
    """The gathered logits of the original vocab in id order: every rank's slice is ``[its
    original rows | its added rows]``, so the added columns are dropped rank by rank."""
    if shard is None or shard.added_rows == 0:
        return logits
    return logits.unflatten(-1, (tp_size, shard.rows))[..., :shard.org_rows].flatten(-2)


def compute_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: TPGroup,
                   use_all_gather: bool, org_vocab_size: int, soft_cap: float | None, scale: float,
                   gemm: Gemm = linear, shard: VocabShard | None = None,
                   skip_gather: bool = False) -> torch.Tensor | None:
    """The whole path above; None on the ranks that do not receive the gathered logits.
    ``skip_gather``: this rank's slice only, no collective (then sliced, capped and scaled as
    vLLM does; for callers that gather themselves)."""
    local = gemm(hidden, weight, bias)
    if skip_gather:
        return postprocess_logits(local, org_vocab_size, soft_cap, scale)
    logits = gather_logits(local, tp, use_all_gather)
    if logits is None:
        return None
    return postprocess_logits(original_vocab(logits, shard, tp.tp_size), org_vocab_size, soft_cap, scale)


@CustomOp.register("logits_processor")
class LogitsProcessor(CustomOp):
    """``forward(lm_head, hidden_states, embedding_bias=None, skip_gather=False)`` -> logits
    ``[..., org_vocab_size]`` (or None on non-zero ranks when the platform gathers to rank 0;
    this rank's slice with ``skip_gather=True``)."""

    def __init__(self, vocab_size: int, org_vocab_size: int | None = None, scale: float = 1.0,
                 logits_as_input: bool = False, soft_cap: float | None = None) -> None:
        super().__init__()
        if soft_cap is not None and soft_cap <= 0:
            raise ValueError(f"LogitsProcessor: soft_cap must be positive, got {soft_cap}")
        self.vocab_size = vocab_size
        self.org_vocab_size = org_vocab_size or vocab_size
        self.scale, self.soft_cap, self.logits_as_input = scale, soft_cap, logits_as_input
        self.use_all_gather = current_platform().use_all_gather()

    def _inputs(self, lm_head, embedding_bias):
        tp = getattr(lm_head, "tp", None) or get_tp_group()
        bias = embedding_bias if embedding_bias is not None else getattr(lm_head, "bias", None)
        return tp, bias

    def _run(self, lm_head, hidden_states: torch.Tensor, embedding_bias: torch.Tensor | None, gemm: Gemm,
             skip_gather: bool):
        if self.logits_as_input:  # already full logits: vLLM neither gathers nor slices them
            return postprocess_logits(hidden_states, None, self.soft_cap, self.scale)
        tp, bias = self._inputs(lm_head, embedding_bias)
        return compute_logits(hidden_states, lm_head.weight, bias, tp, self.use_all_gather, self.org_vocab_size,
                              self.soft_cap, self.scale, gemm, getattr(lm_head, "shard", None), skip_gather)

    def forward_native(self, lm_head, hidden_states: torch.Tensor, embedding_bias: torch.Tensor | None = None,
                       skip_gather: bool = False):
        return self._run(lm_head, hidden_states, embedding_bias, linear, skip_gather)

    def forward_cpu(self, lm_head, hidden_states: torch.Tensor, embedding_bias: torch.Tensor | None = None,
                    skip_gather: bool = False):
        self._check(lm_head, hidden_states)
        return self._run(lm_head, hidden_states, embedding_bias, cpu_linear, skip_gather)

    def _check(self, lm_head, hidden_states: torch.Tensor) -> None:
        if self.logits_as_input:
            return
        weight = getattr(lm_head, "weight", None)
        if weight is None:
            raise TypeError(f"LogitsProcessor: lm_head must have a .weight (a ParallelLMHead), got {type(lm_head)}")
        if hidden_states.shape[-1] != weight.shape[-1]:
            raise ValueError(f"LogitsProcessor: hidden size {hidden_states.shape[-1]} != lm_head embedding_dim "
                             f"{weight.shape[-1]}")

    def extra_repr(self) -> str:
        return (f"vocab_size={self.vocab_size}, org_vocab_size={self.org_vocab_size}, scale={self.scale}, "
                f"soft_cap={self.soft_cap}, use_all_gather={self.use_all_gather}")
