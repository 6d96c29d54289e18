"""Random-input builders for the linear, embedding and logits layers at tp_size 1.

Weights are scaled by ``1/sqrt(in_features)`` so outputs stay O(1) and the dtype tolerances apply.
Multi-rank behaviour is tested by tests/distributed (gloo, 2 ranks), not here.
``parallel_lm_head`` has no samples: its forward raises by design (LogitsProcessor's samples use it).
"""

from __future__ import annotations

import torch

from customop.distributed import TPGroup
from customop.ops.vocab_parallel_embedding import DEFAULT_VOCAB_PADDING_SIZE, ParallelLMHead, VocabShard
from customop.testing import Sample, randn, register_samples

#: (leading dims, in_features, out_features, bias)
_SHAPES = (((1,), 32, 48, True), ((7,), 173, 96, False), ((2, 3), 64, 64, True))


def _weights(n_out: int, n_in: int, bias: bool, dtype, device, gen) -> dict[str, torch.Tensor]:
    state = {"weight": randn(n_out, n_in, dtype=dtype, device=device, scale=n_in ** -0.5, generator=gen)}
    if bias:
        state["bias"] = randn(n_out, dtype=dtype, device=device, generator=gen)
    return state


def _x(lead, n_in, dtype, device, gen) -> torch.Tensor:
    return randn(*lead, n_in, dtype=dtype, device=device, generator=gen)


@register_samples("replicated_linear")
def _replicated(dtype, device, gen) -> list[Sample]:
    return [Sample({"input_size": k, "output_size": n, "bias": b, "skip_bias_add": skip, "params_dtype": dtype},
                   (_x(lead, k, dtype, device, gen),), state=_weights(n, k, b, dtype, device, gen),
                   label=f"replicated_linear {lead}x{k}->{n} bias={b} skip={skip}")
            for (lead, k, n, b), skip in zip(_SHAPES, (False, False, True))]


@register_samples("column_parallel_linear")
def _column(dtype, device, gen) -> list[Sample]:
    return [Sample({"input_size": k, "output_size": n, "bias": b, "gather_output": gather, "params_dtype": dtype},
                   (_x(lead, k, dtype, device, gen),), state=_weights(n, k, b, dtype, device, gen),
                   label=f"column_parallel_linear {lead}x{k}->{n} bias={b} gather={gather}")
            for (lead, k, n, b), gather in zip(_SHAPES, (True, False, True))]


@register_samples("merged_column_parallel_linear")
def _merged(dtype, device, gen) -> list[Sample]:
    return [Sample({"input_size": k, "output_sizes": sizes, "bias": b, "params_dtype": dtype},
                   (_x(lead, k, dtype, device, gen),), state=_weights(sum(sizes), k, b, dtype, device, gen),
                   label=f"merged_column_parallel_linear {lead}x{k}->{sizes} bias={b}")
            for lead, k, sizes, b in (((5,), 64, [48, 48], True), ((2, 3), 96, [32, 80], False))]


@register_samples("qkv_parallel_linear")
def _qkv(dtype, device, gen) -> list[Sample]:
    out = []
    for lead, hidden, head, heads, kv, b in (((5,), 64, 16, 4, 2, True), ((3,), 96, 8, 6, 1, False)):
        n_out = (heads + 2 * kv) * head
        out.append(Sample({"hidden_size": hidden, "head_size": head, "total_num_heads": heads,
                           "total_num_kv_heads": kv, "bias": b, "params_dtype": dtype},
                          (_x(lead, hidden, dtype, device, gen),), state=_weights(n_out, hidden, b, dtype, device, gen),
                          label=f"qkv_parallel_linear heads={heads} kv={kv} head={head} bias={b}"))
    return out


@register_samples("row_parallel_linear")
def _row(dtype, device, gen) -> list[Sample]:
    return [Sample({"input_size": k, "output_size": n, "bias": b, "input_is_parallel": parallel,
                    "params_dtype": dtype},
                   (_x(lead, k, dtype, device, gen),), state=_weights(n, k, b, dtype, device, gen),
                   label=f"row_parallel_linear {lead}x{k}->{n} bias={b} input_is_parallel={parallel}")
            for (lead, k, n, b), parallel in zip(_SHAPES, (True, False, True))]


def _vocab_table(vocab: int, dim: int, dtype, device, gen, org: int | None = None) -> torch.Tensor:
    """The tp-1 parameter in the layer's own layout (``VocabShard``): the real rows of the
    original vocab (``org`` of them, default all) and their padding, then the added rows and theirs."""
    org = vocab if org is None else org
    shard = VocabShard.of(org, vocab, DEFAULT_VOCAB_PADDING_SIZE, TPGroup(), "sample")
    table = torch.zeros(shard.rows, dim, dtype=dtype, device=device)
    table[:org] = randn(org, dim, dtype=dtype, device=device, generator=gen)
    table[shard.org_rows:shard.org_rows + vocab - org] = randn(vocab - org, dim, dtype=dtype, device=device,
                                                               generator=gen)
    return table


@register_samples("vocab_parallel_embedding")
def _embedding(dtype, device, gen) -> list[Sample]:
    out = []
    for vocab, org, dim, ids_shape in ((100, 100, 32, (7,)), (64, 64, 48, (2, 5)), (1000, 1000, 24, (1,)),
                                       (100, 90, 16, (3, 4))):
        ids = torch.randint(0, vocab, ids_shape, generator=gen).to(device)
        out.append(Sample({"num_embeddings": vocab, "embedding_dim": dim, "params_dtype": dtype,
                           "org_num_embeddings": org}, (ids,),
                          state={"weight": _vocab_table(vocab, dim, dtype, device, gen, org)},
                          label=f"vocab_parallel_embedding vocab={vocab} (original {org}) dim={dim} ids={ids_shape}"))
    return out


@register_samples("logits_processor")
def _logits(dtype, device, gen) -> list[Sample]:
    out = []
    for vocab, dim, lead, kwargs in ((100, 32, (3,), {}), (257, 64, (2, 2), {"soft_cap": 30.0, "scale": 0.5}),
                                      (64, 16, (1,), {"scale": 2.0}), (100, 16, (2,), {"org_vocab_size": 90})):
        org = kwargs.get("org_vocab_size")
        head = ParallelLMHead(vocab, dim, params_dtype=dtype, org_num_embeddings=org).to(device)
        with torch.no_grad():
            head.weight.copy_(_vocab_table(vocab, dim, dtype, device, gen, org) * dim ** -0.5)
        hidden = randn(*lead, dim, dtype=dtype, device=device, generator=gen)
        out.append(Sample({"vocab_size": vocab, **kwargs}, (head, hidden),
                          label=f"logits_processor vocab={vocab} dim={dim} {kwargs}"))
    return out
