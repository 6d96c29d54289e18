"""Every parallel layer at tp_size N against the same layer at tp_size 1, inside one N-rank job.

Run by tests/distributed/test_tp_layers.py through ``_launch.run_ranks`` (gloo, CPU), or on GPUs
with torchrun (issue 8; the NVLink-multicast switches as there)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        torchrun --nproc-per-node 2 -m tests.distributed._tp_checks --backend nccl

Each check builds the tp-N layer under the job's group and the reference under
``use_tp_group(None)`` (tp 1) from the same full weights, runs both ``forward_native`` and
``forward_cpu``, and compares. Checks issue the same collectives on every rank and compare only
afterwards, so a failing assertion cannot leave a peer waiting in a collective.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from customop.distributed import (TPGroup, init_tp_group, tensor_model_parallel_all_gather,
                                  tensor_model_parallel_all_reduce, tensor_model_parallel_gather, use_tp_group)
from customop.ops.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                 ReplicatedLinear, RowParallelLinear)
from customop.ops.logits_processor import LogitsProcessor
from customop.ops.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from customop.platforms import CpuPlatform
from customop.testing import assert_close, forced_platform

#: Where tensors and layers live: the CPU under gloo, this rank's GPU under NCCL (set by main).
DEVICE = torch.device("cpu")
CHECKS: dict[str, Callable[[TPGroup], None]] = {}
#: Run only with ``--compile`` (Dynamo start-up costs ~10 s here, so a separate, slow job).
COMPILE_CHECKS: dict[str, Callable[[TPGroup], None]] = {}


def check(fn: Callable[[TPGroup], None]) -> Callable[[TPGroup], None]:
    CHECKS[fn.__name__.removeprefix("check_")] = fn
    return fn


def compile_check(fn: Callable[[TPGroup], None]) -> Callable[[TPGroup], None]:
    COMPILE_CHECKS[fn.__name__.removeprefix("check_")] = fn
    return fn


class GatherToRank0Platform(CpuPlatform):
    """The CPU platform, but logits are gathered to rank 0 (as on TPU)."""

    def use_all_gather(self) -> bool:
        return False


# ---- helpers ------------------------------------------------------------------------------------


def full(*shape: int, seed: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    """The same random tensor on every rank (the "checkpoint")."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


def build(tp: TPGroup | None, cls: type, *args, **kwargs):
    with use_tp_group(tp), torch.device(DEVICE):
        return cls(*args, **kwargs)


def load(layer, **tensors: torch.Tensor | None) -> None:
    for name, tensor in tensors.items():
        if tensor is not None:
            param = getattr(layer, name)
            param.weight_loader(param, tensor)


def run_paths(layer, *args) -> dict[str, object]:
    """Both the spec and the CPU path (the latter may use oneDNN), same collectives in both."""
    return {"native": layer.forward_native(*args), "cpu": layer.forward_cpu(*args)}


def rank_slice(n: int, tp: TPGroup) -> slice:
    size = n // tp.tp_size
    return slice(tp.tp_rank * size, (tp.tp_rank + 1) * size)


# ---- checks -------------------------------------------------------------------------------------


@check
def check_collectives(tp: TPGroup) -> None:
    parts = [torch.arange(24.0, device=DEVICE).reshape(2, 3, 4) + 100 * r for r in range(tp.tp_size)]
    mine = parts[tp.tp_rank]
    got = {f"all_gather dim {d}": tp.all_gather(mine, d) for d in (0, 1, 2, -1)}
    got["all_gather bf16"] = tp.all_gather(mine.bfloat16(), 1)
    got["gather dim 1"] = tp.gather(mine, dst=0, dim=1)
    got["all_reduce"] = tp.all_reduce(mine.clone())
    got["vllm names"] = (tensor_model_parallel_all_gather(mine, 1), tensor_model_parallel_all_reduce(mine.clone()),
                         tensor_model_parallel_gather(mine, 0, 0))
    sub = dist.new_group(list(range(tp.tp_size)))  # a subgroup built by the caller works the same
    with use_tp_group(sub) as sub_tp:
        got["subgroup all_reduce"] = sub_tp.all_reduce(mine.clone())
    total = sum(parts)
    for d in (0, 1, 2, -1):
        assert_close(got[f"all_gather dim {d}"], torch.cat(parts, d), what=f"all_gather dim {d}")
    assert_close(got["all_gather bf16"], torch.cat(parts, 1).bfloat16(), what="all_gather bf16")
    assert_close(got["all_reduce"], total, what="all_reduce")
    assert_close(got["subgroup all_reduce"], total, what="subgroup all_reduce")
    gathered, vgather, vreduce, vgather0 = got["gather dim 1"], *got["vllm names"]
    assert_close(vgather, torch.cat(parts, 1), what="tensor_model_parallel_all_gather")
    assert_close(vreduce, total, what="tensor_model_parallel_all_reduce")
    if tp.tp_rank == 0:
        assert_close(gathered, torch.cat(parts, 1), what="gather")
        assert_close(vgather0, torch.cat(parts, 0), what="tensor_model_parallel_gather")
    else:
        assert gathered is None and vgather0 is None, "gather: non-destination ranks must get None"


@check
def check_replicated(tp: TPGroup) -> None:
    w, b, x = full(40, 48, seed=1, scale=0.15), full(40, seed=2), full(5, 48, seed=3)
    for bias in (True, False):
        layer, ref = (build(g, ReplicatedLinear, 48, 40, bias=bias) for g in (tp, None))
        for m in (layer, ref):
            load(m, weight=w, bias=b if bias else None)
        want = F.linear(x, w, b if bias else None)
        for path, (out, out_bias) in run_paths(layer, x).items():
            assert_close(out, want, what=f"replicated bias={bias} {path}")
            assert out_bias is None
        assert_close(ref(x)[0], want, what="replicated tp1")


@check
def check_column(tp: TPGroup) -> None:
    w, b, x = full(40, 48, seed=4, scale=0.15), full(40, seed=5), full(2, 3, 48, seed=6)
    cols = rank_slice(40, tp)
    for bias in (True, False):
        for gather in (True, False):
            for skip in (False, True):
                kw = dict(bias=bias, gather_output=gather, skip_bias_add=skip)
                layer, ref = (build(g, ColumnParallelLinear, 48, 40, **kw) for g in (tp, None))
                for m in (layer, ref):
                    load(m, weight=w, bias=b if bias else None)
                want, want_bias = ref.forward_native(x)
                what = f"column bias={bias} gather={gather} skip={skip}"
                for path, (out, out_bias) in run_paths(layer, x).items():
                    assert_close(out, want if gather else want[..., cols], what=f"{what} {path}")
                    if bias and skip:  # the caller adds this rank's bias shard (vLLM's contract)
                        assert_close(out_bias, b[cols], what=f"{what} bias")
                    else:
                        assert out_bias is None, what
                assert_close(want, F.linear(x, w, b if bias and not skip else None), what=f"{what} tp1")


@check
def check_merged(tp: TPGroup) -> None:
    sizes = [24, 40]
    gate, up, x = full(24, 32, seed=7, scale=0.2), full(40, 32, seed=8, scale=0.2), full(5, 32, seed=9)
    gb, ub = full(24, seed=10), full(40, seed=11)
    by_id, fused, ref = (build(g, MergedColumnParallelLinear, 32, sizes) for g in (tp, tp, None))
    gathered = build(tp, MergedColumnParallelLinear, 32, sizes, gather_output=True)
    for m in (by_id, gathered, ref):
        m.weight_loader(m.weight, gate, 0)
        m.weight_loader(m.weight, up, 1)
        m.weight.weight_loader(m.bias, gb, 0)  # the attribute form model loaders use
        m.bias.weight_loader(m.bias, ub, 1)
    fused.weight_loader(fused.weight, torch.cat([gate, up]))
    fused.weight_loader(fused.bias, torch.cat([gb, ub]))
    want = ref.forward_native(x)[0]
    g_full, u_full = want.split(sizes, dim=-1)
    local_want = torch.cat([g_full[..., rank_slice(24, tp)], u_full[..., rank_slice(40, tp)]], -1)
    outs = {**{f"by_id {k}": v[0] for k, v in run_paths(by_id, x).items()},
            **{f"fused {k}": v[0] for k, v in run_paths(fused, x).items()}}
    gathered_out = gathered.forward_native(x)[0]
    for what, out in outs.items():
        assert_close(out, local_want, what=f"merged {what}")
    # gathered layout is rank-major: [gate_0, up_0, gate_1, up_1, ...]
    per_rank = [torch.cat([g_full[..., slice(r * 24 // tp.tp_size, (r + 1) * 24 // tp.tp_size)],
                           u_full[..., slice(r * 40 // tp.tp_size, (r + 1) * 40 // tp.tp_size)]], -1)
                for r in range(tp.tp_size)]
    assert_close(gathered_out, torch.cat(per_rank, -1), what="merged gather_output")


@check
def check_qkv(tp: TPGroup) -> None:
    hidden = 32
    x = full(3, hidden, seed=12)
    # (heads, kv heads, head size, v head size, bias): kv >= tp, kv < tp (replicated), v_head_size != head_size
    configs = ((4, 2, 8, 8, True), (4, 1, 8, 8, True), (6, 6, 4, 6, False), (2, 2, 16, 16, False))
    for heads, kv, hs, vhs, bias in configs:
        sizes = ((heads, hs), (kv, hs), (kv, vhs))
        q, k, v = (full(n * d, hidden, seed=13 + i, scale=0.2) for i, (n, d) in enumerate(sizes))
        qb, kb, vb = (full(t.shape[0], seed=20 + i) for i, t in enumerate((q, k, v)))
        kw = dict(total_num_kv_heads=kv, bias=bias, v_head_size=vhs)
        by_id, fused, ref = (build(g, QKVParallelLinear, hidden, hs, heads, **kw) for g in (tp, tp, None))
        for m in (by_id, ref):
            for sid, t, tb in (("q", q, qb), ("k", k, kb), ("v", v, vb)):
                m.weight_loader(m.weight, t, sid)
                if bias:
                    m.weight_loader(m.bias, tb, sid)
        fused.weight_loader(fused.weight, torch.cat([q, k, v]))
        if bias:
            fused.weight_loader(fused.bias, torch.cat([qb, kb, vb]))
        want = ref.forward_native(x)[0]
        wq, wk, wv = want.split([heads * hs, kv * hs, kv * vhs], dim=-1)
        owner = tp.tp_rank // by_id.num_kv_head_replicas  # KV head owner when heads are replicated
        nkv = by_id.num_kv_heads
        local_want = torch.cat([wq[..., rank_slice(heads * hs, tp)], wk[..., owner * nkv * hs:(owner + 1) * nkv * hs],
                                wv[..., owner * nkv * vhs:(owner + 1) * nkv * vhs]], -1)
        what = f"qkv heads={heads} kv={kv} hs={hs} vhs={vhs} bias={bias}"
        assert by_id.num_kv_head_replicas == max(1, tp.tp_size // kv), what
        for name, layer in (("by_id", by_id), ("fused", fused)):
            for path, (out, _) in run_paths(layer, x).items():
                assert_close(out, local_want, what=f"{what} {name} {path}")


@check
def check_row(tp: TPGroup) -> None:
    w, b, x = full(40, 48, seed=30, scale=0.15), full(40, seed=31), full(2, 5, 48, seed=32)
    x_local = x[..., rank_slice(48, tp)]
    for bias in (True, False):
        for parallel in (True, False):
            for skip in (False, True):
                kw = dict(bias=bias, input_is_parallel=parallel, skip_bias_add=skip)
                layer, ref = (build(g, RowParallelLinear, 48, 40, **kw) for g in (tp, None))
                for m in (layer, ref):
                    load(m, weight=w, bias=b if bias else None)
                want, _ = ref.forward_native(x)
                what = f"row bias={bias} input_is_parallel={parallel} skip={skip}"
                for path, (out, out_bias) in run_paths(layer, x_local if parallel else x).items():
                    assert_close(out, want, what=f"{what} {path}")
                    if bias and skip:
                        assert_close(out_bias, b, what=f"{what} bias")
                    else:
                        assert out_bias is None, what
                assert_close(want, F.linear(x, w, b if bias and not skip else None), what=f"{what} tp1")
    partial = build(tp, RowParallelLinear, 48, 40, bias=False, reduce_results=False)
    load(partial, weight=w)
    local = {path: out for path, (out, _) in run_paths(partial, x_local).items()}
    summed = {path: tp.all_reduce(out.clone()) for path, out in local.items()}
    for path in local:
        assert_close(local[path], F.linear(x_local, w[:, rank_slice(48, tp)]), what=f"row partial {path}")
        assert_close(summed[path], F.linear(x, w), what=f"row reduce_results=False then all_reduce {path}")


@check
def check_mlp(tp: TPGroup) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        w1, b1 = full(64, 32, seed=40, scale=0.2, dtype=dtype), full(64, seed=41, dtype=dtype)
        w2, b2 = full(32, 64, seed=42, scale=0.15, dtype=dtype), full(32, seed=43, dtype=dtype)
        x = full(7, 32, seed=44, dtype=dtype)
        layers = {}
        for name, g in (("tp", tp), ("ref", None)):
            up = build(g, ColumnParallelLinear, 32, 64, params_dtype=dtype)
            down = build(g, RowParallelLinear, 64, 32, params_dtype=dtype)
            load(up, weight=w1, bias=b1)
            load(down, weight=w2, bias=b2)
            layers[name] = (up, down)
        out = {name: down(F.gelu(up(x)[0]))[0] for name, (up, down) in layers.items()}
        # bf16: each rank's partial sum is rounded before the reduce, so allow a few bf16 ulps.
        atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (3e-2, 3e-2)
        assert_close(out["tp"], out["ref"], atol=atol, rtol=rtol, what=f"mlp {dtype}")
        want = F.linear(F.gelu(F.linear(x.double(), w1.double(), b1.double())), w2.double(), b2.double())
        assert_close(out["tp"].double(), want, dtype, atol=atol * 3, rtol=rtol * 3, what=f"mlp {dtype} vs float64")


def _boundary_ids(vocab: int, tp: TPGroup, padded: int) -> torch.Tensor:
    per = padded // tp.tp_size
    edges = {0, 1, vocab // 2, vocab - 1}
    for r in range(tp.tp_size):
        edges |= {r * per - 1, r * per, (r + 1) * per - 1}
    return torch.tensor(sorted(i for i in edges if 0 <= i < vocab), device=DEVICE)


@check
def check_vocab_embedding(tp: TPGroup) -> None:
    for vocab in (100, 64, 130, 33, 1):
        w = full(vocab, 16, seed=50 + vocab)
        layer, ref = build(tp, VocabParallelEmbedding, vocab, 16), build(None, VocabParallelEmbedding, vocab, 16)
        partial = build(tp, VocabParallelEmbedding, vocab, 16, reduce_results=False)
        for m in (layer, ref, partial):
            load(m, weight=w)
        ids = _boundary_ids(vocab, tp, layer.num_embeddings_padded)
        ids = torch.stack([ids, ids.flip(0)])  # 2-D ids
        outs = run_paths(layer, ids)
        local = partial.forward_native(ids)
        summed = tp.all_reduce(local.clone())
        want = F.embedding(ids, w)
        what = f"embedding vocab={vocab}"
        assert layer.num_embeddings_padded % 64 == 0
        assert layer.weight.shape[0] == layer.num_embeddings_padded // tp.tp_size
        real = layer.shard.org_end - layer.shard.org_start
        assert torch.all(layer.weight[real:] == 0), f"{what}: padding rows must be zero"
        for path, out in outs.items():
            assert_close(out, want, what=f"{what} {path}")
        assert_close(ref(ids), want, what=f"{what} tp1")
        owned = (ids >= layer.shard.org_start) & (ids < layer.shard.org_end)
        assert torch.all(local[~owned] == 0), f"{what}: rows of tokens another rank owns must be zero"
        assert_close(summed, want, what=f"{what} reduce_results=False then all_reduce")


@check
def check_added_vocab(tp: TPGroup) -> None:
    """An added (LoRA) vocab: each rank holds [its original rows | its added rows]; lookups of ids on
    both sides of every boundary match the full table, and the logits keep the original vocab."""
    dim = 16
    hidden = full(2, 3, dim, seed=90)
    for org, vocab in ((90, 100), (33, 40), (64, 65), (128, 200)):
        table = full(vocab, dim, seed=91 + vocab)
        layers = {name: build(g, VocabParallelEmbedding, vocab, dim, org_num_embeddings=org) for name, g in
                  (("tp", tp), ("ref", None))}
        head = build(tp, ParallelLMHead, vocab, dim, org_num_embeddings=org)
        for m in (*layers.values(), head):
            m.weight_loader(m.weight, table[:org])
            m.added_vocab_loader(m.weight, table[org:])
        per_org, per_added = layers["tp"].shard.org_rows, layers["tp"].shard.added_rows
        edges = {0, org - 1, org, vocab - 1}
        for r in range(tp.tp_size + 1):
            edges |= {r * per_org - 1, r * per_org, org + r * per_added - 1, org + r * per_added}
        ids = torch.tensor(sorted(i for i in edges if 0 <= i < vocab), device=DEVICE)
        outs = run_paths(layers["tp"], ids)
        proc = LogitsProcessor(vocab, org_vocab_size=org)
        logits = run_paths(proc, head, hidden)
        what = f"added vocab org={org} vocab={vocab}"
        want = F.embedding(ids, table)
        for path, out in outs.items():
            assert_close(out, want, what=f"{what} embedding {path}")
        assert_close(layers["ref"](ids), want, what=f"{what} embedding tp1")
        for path, out in logits.items():
            assert out is not None and out.shape == (2, 3, org), f"{what} logits {path}: shape"
            assert_close(out, F.linear(hidden, table[:org]), what=f"{what} logits {path}")


@check
def check_logits(tp: TPGroup) -> None:
    dim = 24
    hidden = full(2, 3, dim, seed=60)
    for vocab in (100, 130, 33):
        w, b = full(vocab, dim, seed=61 + vocab, scale=0.3), full(vocab, seed=62 + vocab)
        for bias in (False, True):
            heads = {name: build(g, ParallelLMHead, vocab, dim, bias=bias) for name, g in (("tp", tp), ("ref", None))}
            for head in heads.values():
                load(head, weight=w, bias=b if bias else None)
            for all_gather in (True, False):
                for kwargs in ({}, {"soft_cap": 2.0, "scale": 0.5}, {"scale": 3.0}):
                    platform = CpuPlatform() if all_gather else GatherToRank0Platform()
                    with forced_platform(platform):
                        proc = LogitsProcessor(vocab, **kwargs)
                    ref_out = proc.forward_native(heads["ref"], hidden)
                    outs = run_paths(proc, heads["tp"], hidden)
                    logits = F.linear(hidden.double(), w.double(), b.double() if bias else None)
                    if "soft_cap" in kwargs:
                        logits = torch.tanh(logits / kwargs["soft_cap"]) * kwargs["soft_cap"]
                    want = logits * kwargs.get("scale", 1.0)
                    what = f"logits vocab={vocab} bias={bias} all_gather={all_gather} {kwargs}"
                    assert proc.use_all_gather is all_gather, what
                    assert_close(ref_out.double(), want, torch.float32, what=f"{what} tp1")
                    for path, out in outs.items():
                        if all_gather or tp.tp_rank == 0:
                            assert out is not None and out.shape == (2, 3, vocab), f"{what} {path}: shape"
                            assert_close(out, ref_out, what=f"{what} {path}")
                        else:
                            assert out is None, f"{what} {path}: non-zero ranks get None when gathering to rank 0"
    # skip_gather: this rank's slice of the padded logits, no collective
    vocab = 100
    w = full(vocab, dim, seed=65, scale=0.3)
    head = build(tp, ParallelLMHead, vocab, dim)
    load(head, weight=w)
    padded = torch.cat([w, w.new_zeros(head.num_embeddings_padded - vocab, dim)])
    mine = F.linear(hidden, padded)[..., rank_slice(head.num_embeddings_padded, tp)][..., :vocab]
    for path, out in run_paths(LogitsProcessor(vocab, soft_cap=2.0), head, hidden, None, True).items():
        assert_close(out, torch.tanh(mine / 2.0) * 2.0, what=f"logits skip_gather {path}")
    # embedding_bias (a local shard, vLLM's argument) and tied embeddings
    vocab = 100
    w, b = full(vocab, dim, seed=70, scale=0.3), full(vocab, seed=71)
    embed = build(tp, VocabParallelEmbedding, vocab, dim)
    load(embed, weight=w)
    head = build(tp, ParallelLMHead, vocab, dim).tie_weights(embed)
    bias_head = build(tp, ParallelLMHead, vocab, dim, bias=True)
    load(bias_head, bias=b)
    proc = LogitsProcessor(vocab)
    out = proc.forward_native(head, hidden, bias_head.bias)
    assert_close(out, F.linear(hidden, w, b), what="logits tied + embedding_bias")


@check
def check_rank_mismatch_errors(tp: TPGroup) -> None:
    def raises(fn: Callable[[], object], *needles: str) -> None:
        try:
            fn()
        except (ValueError, RuntimeError) as err:
            for needle in needles:
                assert needle in str(err), f"error {err!r} does not mention {needle!r}"
            return
        raise AssertionError(f"no error raised; expected one mentioning {needles}")

    col = build(tp, ColumnParallelLinear, 32, 40)
    raises(lambda: col.weight_loader(col.weight, full(20, 32, seed=80)), "full checkpoint", "tp_size=2", "(40, 32)")
    row = build(tp, RowParallelLinear, 32, 8)
    raises(lambda: row.weight_loader(row.weight, full(8, 16, seed=81)), "full checkpoint", "tp_size=2")
    raises(lambda: build(tp, ColumnParallelLinear, 32, 41), "41", "not divisible by tp_size=2")
    raises(lambda: build(tp, RowParallelLinear, 33, 8), "33", "tp_size=2")
    raises(lambda: build(tp, MergedColumnParallelLinear, 32, [24, 9]), "9", "tp_size=2")
    raises(lambda: build(tp, QKVParallelLinear, 32, 8, 4, 3), "total_num_kv_heads")
    raises(lambda: build(tp, QKVParallelLinear, 32, 8, 3, 1), "total_num_heads")
    raises(lambda: build(tp, VocabParallelEmbedding, 99, 8, padding_size=3), "tp_size=2")
    emb = build(tp, VocabParallelEmbedding, 100, 8)
    raises(lambda: emb.weight_loader(emb.weight, full(64, 8, seed=82)), "full checkpoint", "tp_size=2")
    world = dist.group.WORLD
    raises(lambda: TPGroup(tp_rank=1 - tp.tp_rank, tp_size=2, group=world), "do not match")
    raises(lambda: TPGroup(tp_rank=0, tp_size=3, group=world), "do not match")
    raises(lambda: TPGroup(tp_rank=0, tp_size=2), "needs a torch.distributed process group")


@compile_check
def check_compile_fullgraph(tp: TPGroup) -> None:
    """Column (all-gather) -> row (split input, all-reduce) and the logits gather trace as one graph:
    Dynamo maps the torch.distributed calls to functional collectives, no graph break."""
    w1, w2, x = full(64, 32, seed=90, scale=0.2), full(16, 64, seed=91, scale=0.15), full(5, 32, seed=92)
    up = build(tp, ColumnParallelLinear, 32, 64, bias=False, gather_output=True)
    down = build(tp, RowParallelLinear, 64, 16, input_is_parallel=False)
    load(up, weight=w1)
    load(down, weight=w2, bias=full(16, seed=93))
    head = build(tp, ParallelLMHead, 100, 32)
    load(head, weight=full(100, 32, seed=94))
    proc = LogitsProcessor(100, soft_cap=5.0)
    # an added (LoRA) vocab: the rank-local row mapping and the logits reorder trace too
    lora_table = full(100, 32, seed=95)
    lora_embed = build(tp, VocabParallelEmbedding, 100, 32, org_num_embeddings=90)
    lora_head = build(tp, ParallelLMHead, 100, 32, org_num_embeddings=90)
    for layer in (lora_embed, lora_head):
        layer.weight_loader(layer.weight, lora_table[:90])
        layer.added_vocab_loader(layer.weight, lora_table[90:])
    lora_proc = LogitsProcessor(100, org_vocab_size=90)
    ids = torch.tensor([0, 63, 64, 89, 90, 94, 95, 99], device=DEVICE)
    for path in ("forward_native", "forward_cpu"):
        def mlp(t, path=path):
            return getattr(down, path)(getattr(up, path)(t)[0])[0]

        def logits(t, path=path):
            return getattr(proc, path)(head, t)

        def lora_logits(t, path=path):
            return getattr(lora_proc, path)(lora_head, t)

        def lora_embedding(t, path=path):
            return getattr(lora_embed, path)(t)

        for name, fn, arg in (("mlp", mlp, x), ("logits", logits, x), ("lora logits", lora_logits, x),
                              ("lora embedding", lora_embedding, ids)):
            got = torch.compile(fn, fullgraph=True, backend="eager")(arg)
            assert_close(got, fn(arg), what=f"compiled {name} {path}")


def main() -> int:
    global DEVICE
    parser = argparse.ArgumentParser()
    for arg in ("--rank", "--world-size", "--port"):
        parser.add_argument(arg, type=int, help="omit all three under torchrun (env:// rendezvous)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--out", help="write the {check: traceback or null} report here; else print it")
    parser.add_argument("--compile", action="store_true", help="run COMPILE_CHECKS instead of CHECKS")
    args = parser.parse_args()
    timeout = datetime.timedelta(seconds=60)
    if args.backend == "nccl":
        DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(DEVICE)
    if args.rank is None:  # torchrun
        dist.init_process_group(args.backend, timeout=timeout)
    else:
        dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                                world_size=args.world_size, timeout=timeout)
    tp = init_tp_group()
    results: dict[str, str | None] = {}
    for name, fn in (COMPILE_CHECKS if args.compile else CHECKS).items():
        try:
            fn(tp)
            results[name] = None
        except Exception:  # reported to the parent test, which fails that case with this text
            results[name] = traceback.format_exc()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f)
    else:
        for name, err in results.items():
            print(f"rank {tp.tp_rank} {name}: {'ok' if err is None else 'FAILED'}" + (f"\n{err}" if err else ""))
    dist.barrier()  # no rank tears down its connections while a peer still uses them
    dist.destroy_process_group()
    return 0 if all(err is None for err in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
