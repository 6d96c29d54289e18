"""Vocabulary-parallel embedding and the parallel LM head (op-semantics.md D.7).

The vocabulary is padded to a multiple of ``padding_size`` (64) and each rank holds one equal,
contiguous slice of the padded rows. A lookup maps the ids this rank owns to local rows and every
other id to row 0, zeroes the rows it does not own, and sums over ranks (all-reduce): each token
has exactly one owner, so the sum is that owner's row.

An added vocabulary (LoRA adapters' extra tokens: ``org_num_embeddings < num_embeddings``) follows
vLLM's layout: the original vocab is padded on its own, the added one after it, and each rank's
table is ``[its slice of the padded original rows | its slice of the padded added rows]``. Token
ids keep their global numbering (added tokens start at ``org_num_embeddings``). Checkpoints hold
the original rows only (``weight_loader``); adapters fill the added ones (``added_vocab_loader``).

``ParallelLMHead`` shares the layout; its forward raises, because its weight is consumed by
``LogitsProcessor`` (hidden · Wᵀ gives this rank's slice of the logits).

Not implemented: quantized embeddings.
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
    """This rank's rows (vLLM's ``VocabParallelEmbeddingShardIndices``). The local table holds
    ``org_rows`` rows for the original vocab, then ``added_rows`` for the added one; ids in
    ``[org_start, org_end)`` are local rows ``0..``, ids in ``[added_start, added_end)`` local rows
    ``org_rows..``; the rest of each part is padding."""

    org_start: int
    org_end: int
    org_rows: int
    added_start: int = 0
    added_end: int = 0
    added_rows: int = 0

    @property
    def rows(self) -> int:
        return self.org_rows + self.added_rows

    @classmethod
    def of(cls, org_vocab: int, vocab: int, padding_size: int, tp: TPGroup, what: str) -> VocabShard:
        org_padded = pad_vocab_size(org_vocab, padding_size)
        padded = pad_vocab_size(org_padded + vocab - org_vocab, padding_size)
        org_rows = tp.shard_size(org_padded, f"{what} padded vocab (vocab {org_vocab} padded to {org_padded})")
        added_rows = tp.shard_size(padded - org_padded, f"{what} padded added vocab "
                                   f"({vocab - org_vocab} tokens padded to {padded - org_padded})")
        org_start, added_start = tp.tp_rank * org_rows, org_vocab + tp.tp_rank * added_rows
        return cls(org_start=min(org_start, org_vocab), org_end=min(org_start + org_rows, org_vocab),
                   org_rows=org_rows, added_start=min(added_start, vocab),
                   added_end=min(added_start + added_rows, vocab), added_rows=added_rows)

    def local_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(local row of each id, whether this rank owns it); ids it does not own read row 0."""
        in_org = (ids >= self.org_start) & (ids < self.org_end)
        local = torch.where(in_org, ids - self.org_start, torch.zeros_like(ids))
        if self.added_rows == 0:
            return local, in_org
        in_added = (ids >= self.added_start) & (ids < self.added_end)
        local = torch.where(in_added, ids - self.added_start + self.org_rows, local)
        return local, in_org | in_added


def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor, shard: VocabShard, tp: TPGroup,
                             reduce_results: bool = True) -> torch.Tensor:
    """``out[t] = W_full[ids[t]]``: local lookup of the ids this rank owns (others read row 0 and
    are zeroed), then a sum over ranks."""
    if tp.tp_size == 1 and shard.added_rows == 0:  # local rows are the ids themselves
        return F.embedding(ids, weight)
    local_ids, owned = shard.local_rows(ids)
    out = F.embedding(local_ids, weight)
    if tp.tp_size == 1:
        return out
    out = out.masked_fill(~owned.unsqueeze(-1), 0)
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
        org_vocab = num_embeddings if org_num_embeddings is None else org_num_embeddings
        if num_embeddings < 1 or padding_size < 1 or not 1 <= org_vocab <= num_embeddings:
            raise ValueError(f"{name}: need 1 <= org_num_embeddings={org_num_embeddings} <= num_embeddings="
                             f"{num_embeddings} and padding_size={padding_size} >= 1")
        self.tp = TPGroup() if disable_tp else get_tp_group()
        self.tp_rank, self.tp_size = self.tp.tp_rank, self.tp.tp_size
        self.num_embeddings, self.org_vocab_size = num_embeddings, org_vocab
        self.num_added_embeddings = num_embeddings - org_vocab
        self.embedding_dim, self.padding_size, self.prefix = embedding_dim, padding_size, prefix
        self.shard = VocabShard.of(org_vocab, num_embeddings, padding_size, self.tp, name)
        self.org_vocab_size_padded = self.shard.org_rows * self.tp_size
        self.num_embeddings_padded = self.shard.rows * self.tp_size
        self.num_embeddings_per_partition = self.shard.rows
        self.reduce_results = reduce_results
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = self._param((self.shard.rows, embedding_dim), dtype)

    def _param(self, shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
        p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
        p.weight_loader, p.output_dim = self.weight_loader, 0
        return p

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copies this rank's rows of the full ``(org_num_embeddings, ...)`` checkpoint tensor (the
        original vocab); every other row (padding, the added vocab) becomes 0."""
        shard = self.shard
        self._check_full(loaded_weight, param, self.org_vocab_size, "weight_loader", "the full checkpoint tensor")
        n = shard.org_end - shard.org_start
        param.data[:n].copy_(loaded_weight[shard.org_start:shard.org_end])
        param.data[n:].zero_()

    def added_vocab_loader(self, param: nn.Parameter, added_weight: torch.Tensor) -> None:
        """Copies this rank's rows of the added vocab, ``(num_embeddings - org_num_embeddings, ...)``
        for ids ``org_num_embeddings..``, into the added part of the table (its padding: 0)."""
        shard = self.shard
        self._check_full(added_weight, param, self.num_added_embeddings, "added_vocab_loader", "all added rows")
        n = shard.added_end - shard.added_start
        first = shard.added_start - self.org_vocab_size
        param.data[shard.org_rows:shard.org_rows + n].copy_(added_weight[first:first + n])
        param.data[shard.org_rows + n:].zero_()

    def _check_full(self, tensor: torch.Tensor, param: nn.Parameter, rows: int, where: str, what: str) -> None:
        expected = (rows, *param.shape[1:])
        if tuple(tensor.shape) != expected:
            s = self.shard
            raise ValueError(
                f"{type(self).__name__}.{where}: expected {what} of shape {expected}, got {tuple(tensor.shape)} "
                f"(rank {self.tp_rank} of tp_size={self.tp_size} keeps ids {s.org_start}:{s.org_end}"
                + (f" and added ids {s.added_start}:{s.added_end}" if self.num_added_embeddings else "")
                + f" of the vocab padded to {self.num_embeddings_padded}); pass the unsharded tensor")

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
        return (f"num_embeddings={self.num_embeddings}, org_vocab_size={self.org_vocab_size}, "
                f"embedding_dim={self.embedding_dim}, num_embeddings_padded={self.num_embeddings_padded}, "
                f"tp_size={self.tp_size}")


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
        if (embed_tokens.shard, embed_tokens.tp_size) != (self.shard, self.tp_size):
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
