"""Vocabulary-parallel embedding and the parallel LM head (op-semantics.md D.7).

The vocabulary is padded to a multiple of ``padding_size`` (64) and each rank holds one equal,
contiguous slice of the padded rows. A lookup maps the ids this rank owns to local rows and every
other id to row 0, zeroes the rows it does not own, and sums over ranks (all-reduce): each token
has exactly one owner, so the sum is that owner's row.

``ParallelLMHead`` shares the layout; its forward raises, because its weight is consumed by
``LogitsProcessor`` (hidden · Wᵀ gives this rank's slice of the logits).

Not implemented: vLLM's extra (LoRA) vocabulary appended after the padded original one
(``org_num_embeddings`` smaller than ``num_embeddings``), and quantized embeddings.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from customop.custom_op import CustomOp
from customop.distributed import TPGroup, get_tp_group

DEFAULT_VOCAB_PADDING_SIZE = 64


def pad_vocab_size(vocab_size: int, pad_to: int = DEFAULT_VOCAB_PADDING_SIZE) -> int:
    """The smallest multiple of ``pad_to`` that is at least ``vocab_size``."""
    return -(-vocab_size // pad_to) * pad_to


@dataclasses.dataclass(frozen=True)
class VocabShard:
    """This rank's rows: ids ``[start, end)`` are real tokens it owns; the local table has
    ``rows`` entries (``end - start`` real ones, then padding)."""

    start: int
    end: int
    rows: int

    @classmethod
    def of(cls, vocab_size: int, padded_size: int, tp: TPGroup, what: str) -> VocabShard:
        rows = tp.shard_size(padded_size, f"{what} padded vocab (vocab {vocab_size} padded to {padded_size})")
        start = tp.tp_rank * rows
        return cls(start=min(start, vocab_size), end=min(start + rows, vocab_size), rows=rows)


def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor, shard: VocabShard, tp: TPGroup,
                             reduce_results: bool = True) -> torch.Tensor:
    """``out[t] = W_full[ids[t]]``: local lookup of the ids in ``[start, end)`` (others read row 0 and
    are zeroed), then a sum over ranks."""
    if tp.tp_size == 1:
        return F.embedding(ids, weight)
    owned = (ids >= shard.start) & (ids < shard.end)
    local_ids = torch.where(owned, ids - shard.start, torch.zeros_like(ids))
    out = F.embedding(local_ids, weight).masked_fill(~owned.unsqueeze(-1), 0)
    return tp.all_reduce(out) if reduce_results else out


@CustomOp.register("vocab_parallel_embedding")
class VocabParallelEmbedding(CustomOp):
    """Embedding table sharded over ranks by vocabulary rows (vLLM's argument names)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, params_dtype: torch.dtype | None = None,
                 org_num_embeddings: int | None = None, padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
                 quant_config: object = None, prefix: str = "", *, reduce_results: bool = True,
                 disable_tp: bool = False) -> None:
        super().__init__()
        name = type(self).__name__
        if quant_config is not None:
            raise NotImplementedError(f"{name}: quantized embeddings are not implemented")
        if org_num_embeddings not in (None, num_embeddings):
            raise NotImplementedError(f"{name}: an added (LoRA) vocabulary (org_num_embeddings="
                                      f"{org_num_embeddings} < num_embeddings={num_embeddings}) is not implemented")
        if num_embeddings < 1 or padding_size < 1:
            raise ValueError(f"{name}: num_embeddings={num_embeddings} and padding_size={padding_size} must be >= 1")
        self.tp = TPGroup() if disable_tp else get_tp_group()
        self.tp_rank, self.tp_size = self.tp.tp_rank, self.tp.tp_size
        self.num_embeddings = self.org_vocab_size = num_embeddings
        self.embedding_dim, self.padding_size, self.prefix = embedding_dim, padding_size, prefix
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, padding_size)
        self.shard = VocabShard.of(num_embeddings, self.num_embeddings_padded, self.tp, name)
        self.num_embeddings_per_partition = self.shard.rows
        self.reduce_results = reduce_results
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = self._param((self.shard.rows, embedding_dim), dtype)

    def _param(self, shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
        p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
        p.weight_loader, p.output_dim = self.weight_loader, 0
        return p

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copies this rank's rows of the full ``(num_embeddings, ...)`` tensor; padding rows get 0."""
        expected = (self.num_embeddings, *param.shape[1:])
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(
                f"{type(self).__name__}.weight_loader: expected the full checkpoint tensor of shape {expected}, "
                f"got {tuple(loaded_weight.shape)} (rank {self.tp_rank} of tp_size={self.tp_size} keeps rows "
                f"{self.shard.start}:{self.shard.end} of the vocab padded to {self.num_embeddings_padded}); "
                "pass the unsharded tensor")
        n = self.shard.end - self.shard.start
        param.data[:n].copy_(loaded_weight[self.shard.start:self.shard.end])
        param.data[n:].zero_()

    def _check(self, ids: torch.Tensor) -> None:
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise TypeError(f"{type(self).__name__}: token ids must be an integer tensor, got {ids.dtype}")

    def forward_native(self, input_: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embedding(input_, self.weight, self.shard, self.tp, self.reduce_results)

    def forward_cpu(self, input_: torch.Tensor) -> torch.Tensor:
        # A gather of rows is bandwidth-bound and already one aten kernel: nothing faster to call.
        self._check(input_)
        return self.forward_native(input_)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"num_embeddings_padded={self.num_embeddings_padded}, tp_size={self.tp_size}")


@CustomOp.register("parallel_lm_head")
class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, sharded like the embedding (padded vocab rows per rank). Pass it to
    ``LogitsProcessor``; calling it directly raises. ``bias`` is sharded like the rows."""

    #: A weight holder with no forward: ``customop check`` has nothing to run (LogitsProcessor's
    #: samples exercise its weights).
    has_forward = False

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False,
                 params_dtype: torch.dtype | None = None, org_num_embeddings: int | None = None,
                 padding_size: int = DEFAULT_VOCAB_PADDING_SIZE, quant_config: object = None, prefix: str = "", *,
                 disable_tp: bool = False) -> None:
        super().__init__(num_embeddings, embedding_dim, params_dtype, org_num_embeddings, padding_size,
                         quant_config, prefix, disable_tp=disable_tp)
        self.bias = self._param((self.shard.rows,), self.weight.dtype) if bias else None

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> ParallelLMHead:
        """Shares the embedding's weight (tied word embeddings); the shards must line up."""
        if (embed_tokens.num_embeddings_padded, embed_tokens.tp_size) != (self.num_embeddings_padded, self.tp_size):
            raise ValueError("ParallelLMHead.tie_weights: the embedding is padded or sharded differently "
                             f"({embed_tokens.num_embeddings_padded} rows over tp_size={embed_tokens.tp_size} vs "
                             f"{self.num_embeddings_padded} over {self.tp_size})")
        self.weight = embed_tokens.weight
        return self

    def forward_native(self, *args, **kwargs):
        raise RuntimeError("ParallelLMHead is not called directly: its weight is consumed by "
                           "LogitsProcessor; use logits_processor(lm_head, hidden_states)")

    def forward_cpu(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)
