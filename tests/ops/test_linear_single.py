"""The linear, embedding and logits layers at tp_size 1: math against a float64 reference written
here, the (output, bias) contract, loaders, errors, dispatch and compile. Multi-rank behaviour:
tests/distributed."""

import pytest
import torch
import torch.nn.functional as F

import customop
from customop.custom_op import CustomOp
from customop.ops import linear as lin
from customop.ops.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                 ReplicatedLinear, RowParallelLinear)
from customop.ops.logits_processor import LogitsProcessor
from customop.ops.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding, pad_vocab_size
from customop.testing import assert_close, assert_conforms, randn

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (leading dims, in_features, out_features): one token, odd sizes, a 3-D input, and one large.
SHAPES = (((1,), 64, 48), ((7,), 4231, 96), ((3, 5), 4096, 64), ((128,), 1024, 512))
PATHS = ("forward_native", "forward_cpu")


def ref_linear(x, w, b=None):
    """The float64 oracle: x·Wᵀ + b."""
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


def make(cls, *args, **kwargs):
    with customop.use_config(customop.Config(custom_ops=["all"])):
        return cls(*args, **kwargs)


def weights(n, k, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return randn(n, k, dtype=dtype, scale=k ** -0.5, generator=gen), randn(n, dtype=dtype, generator=gen)


def load(layer, **tensors):
    for name, t in tensors.items():
        param = getattr(layer, name)
        param.weight_loader(param, t)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,k,n", SHAPES)
@pytest.mark.parametrize("cls", [ReplicatedLinear, ColumnParallelLinear, RowParallelLinear])
def test_linear_math(cls, lead, k, n, dtype, path):
    w, b = weights(n, k, dtype)
    x = randn(*lead, k, dtype=dtype)
    layer = make(cls, k, n, params_dtype=dtype)
    load(layer, weight=w, bias=b)
    out, out_bias = getattr(layer, path)(x)
    assert out.dtype == dtype and out.shape == (*lead, n) and out_bias is None
    assert_close(out, ref_linear(x, w, b), dtype)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_merged_and_qkv_math(dtype, path):
    x = randn(5, 96, dtype=dtype)
    gate, gb = weights(40, 96, dtype, seed=1)
    up, ub = weights(56, 96, dtype, seed=2)
    merged = make(MergedColumnParallelLinear, 96, [40, 56], params_dtype=dtype)
    for i, (t, tb) in enumerate(((gate, gb), (up, ub))):
        merged.weight_loader(merged.weight, t, i)
        merged.weight_loader(merged.bias, tb, i)
    want = torch.cat([ref_linear(x, gate, gb), ref_linear(x, up, ub)], -1)
    assert_close(getattr(merged, path)(x)[0], want, dtype)

    q, qb = weights(4 * 16, 96, dtype, seed=3)
    k, kb = weights(2 * 16, 96, dtype, seed=4)
    v, vb = weights(2 * 24, 96, dtype, seed=5)
    qkv = make(QKVParallelLinear, 96, 16, 4, 2, params_dtype=dtype, v_head_size=24)
    qkv.weight_loader(qkv.weight, torch.cat([q, k, v]))  # fused checkpoint form
    qkv.weight_loader(qkv.bias, torch.cat([qb, kb, vb]))
    assert (qkv.q_size, qkv.kv_size, qkv.v_size, qkv.num_kv_head_replicas) == (64, 32, 48, 1)
    want = torch.cat([ref_linear(x, q, qb), ref_linear(x, k, kb), ref_linear(x, v, vb)], -1)
    assert_close(getattr(qkv, path)(x)[0], want, dtype)


@pytest.mark.parametrize("cls", [ReplicatedLinear, ColumnParallelLinear, RowParallelLinear])
def test_bias_contract(cls):
    w, b = weights(24, 32, torch.float32)
    x = randn(3, 32)
    skip = make(cls, 32, 24, skip_bias_add=True)
    plain = make(cls, 32, 24, return_bias=False)
    none = make(cls, 32, 24, bias=False)
    for layer in (skip, plain):
        load(layer, weight=w, bias=b)
    load(none, weight=w)
    out, out_bias = skip(x)
    assert_close(out, ref_linear(x, w), torch.float32)  # bias left to the caller...
    assert out_bias is skip.bias  # ...and handed back
    assert isinstance(plain(x), torch.Tensor)  # return_bias=False: the output only
    assert_close(plain(x), ref_linear(x, w, b), torch.float32)
    assert none.bias is None and none(x)[1] is None


def test_parameters_carry_loader_attributes():
    col, row = make(ColumnParallelLinear, 32, 24), make(RowParallelLinear, 32, 24)
    assert not col.weight.requires_grad  # inference layers, as in vLLM
    assert (col.weight.output_dim, col.weight.input_dim, row.weight.input_dim) == (0, 1, 1)
    assert col.weight.weight_loader == col.weight_loader and row.bias.weight_loader == row.weight_loader


def test_loader_and_constructor_errors():
    col = make(ColumnParallelLinear, 32, 24)
    with pytest.raises(ValueError, match=r"expected the full checkpoint tensor of shape \(24, 32\), got \(12, 32\)"):
        col.weight_loader(col.weight, torch.zeros(12, 32))
    merged = make(MergedColumnParallelLinear, 32, [8, 16])
    with pytest.raises(ValueError, match="shard_id 2"):
        merged.weight_loader(merged.weight, torch.zeros(8, 32), 2)
    with pytest.raises(ValueError, match="25 rows, expected 24 = 8 \\+ 16"):
        merged.weight_loader(merged.weight, torch.zeros(25, 32))
    qkv = make(QKVParallelLinear, 32, 8, 2)
    with pytest.raises(ValueError, match="shard_id must be 'q', 'k', 'v'"):
        qkv.weight_loader(qkv.weight, torch.zeros(16, 32), "o")
    with pytest.raises(ValueError, match="reduce_results=False"):
        make(RowParallelLinear, 32, 24, reduce_results=False)
    row = make(RowParallelLinear, 32, 24, input_is_parallel=False)
    with pytest.raises(ValueError, match=r"row_parallel_linear: x has shape \(2, 31\), expected \[\.\.\., 32\]"):
        row.forward_cpu(torch.zeros(2, 31))
    with pytest.raises(NotImplementedError, match="quantized"):
        make(ReplicatedLinear, 32, 24, quant_config=object())


def test_cpu_linear_chooses_onednn_only_where_measured():
    assert lin.onednn_linear_available() is lin.onednn_linear_available()  # probed once, cached
    w, b = weights(24, 32, torch.float32)
    cases = ((torch.float32, 4, lin.onednn_linear_available()), (torch.bfloat16, 4, False), (torch.float32, 1, False))
    for dtype, rows, onednn in cases:
        x, wd, bd = randn(rows, 32, dtype=dtype), w.to(dtype), b.to(dtype)
        assert lin.use_onednn(x, wd, bd) is onednn, (dtype, rows)
        assert_close(lin.cpu_linear(x, wd, bd), F.linear(x, wd, bd), dtype)
    # with autograd wanted, F.linear (oneDNN's private op has no derivative)
    xg = randn(4, 32).requires_grad_()
    assert not lin.use_onednn(xg, w, b)
    lin.cpu_linear(xg, w, b).sum().backward()
    assert xg.grad is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cpu_linear_runs_half_precision_in_fp32_from_the_table_rows(dtype, monkeypatch):
    """Where half-precision GEMMs get no hardware help (``FP32_GEMM_FROM_ROWS``, set on AVX2
    CPUs), calls of that many rows or more run in fp32 (with and without a bias, a 3-D input, odd
    sizes) and match the float64 reference; fewer rows, fp32, weights beyond
    ``FP32_GEMM_MAX_WEIGHT`` and compiled traces keep F.linear."""
    monkeypatch.setattr(lin, "FP32_GEMM_FROM_ROWS", {dtype: 7})
    w, b = weights(96, 4231, dtype)
    for lead, taken in (((6,), False), ((7,), True), ((3, 5), True)):
        x = randn(*lead, 4231, dtype=dtype)
        assert lin.use_fp32_gemm(x, w) is taken, lead
        for bias in (None, b):
            got = lin.cpu_linear(x, w, bias)
            assert got.dtype == dtype and got.shape == (*lead, 96)
            assert_close(got, ref_linear(x, w, bias).to(dtype), dtype)
    assert not lin.use_fp32_gemm(randn(8, 32), randn(24, 32))  # fp32: not in the table
    monkeypatch.setattr(lin, "FP32_GEMM_MAX_WEIGHT", w.numel() - 1)  # a weight too large to copy
    assert not lin.use_fp32_gemm(randn(8, 4231, dtype=dtype), w)
    compiled = torch.compile(lambda x: lin.use_fp32_gemm(x, w) and x.sum(), fullgraph=True)
    assert compiled(randn(8, 4231, dtype=dtype)) is False
    monkeypatch.undo()  # the shipped table: set on AVX2 CPUs only
    assert bool(lin.FP32_GEMM_FROM_ROWS) is (torch.backends.cpu.get_cpu_capability() == "AVX2")


def test_vocab_parallel_embedding():
    vocab, dim = 100, 24
    table = randn(vocab, dim)
    emb = make(VocabParallelEmbedding, vocab, dim)
    load(emb, weight=table)
    assert emb.num_embeddings_padded == pad_vocab_size(vocab) == 128 and emb.weight.shape == (128, dim)
    assert torch.all(emb.weight[vocab:] == 0)
    ids = torch.tensor([[0, 99, 5], [50, 1, 98]])
    for path in PATHS:
        assert_close(getattr(emb, path)(ids), table.double()[ids], torch.float32)
    with pytest.raises(TypeError, match="integer tensor"):
        emb.forward_cpu(ids.float())
    with pytest.raises(ValueError, match=r"full checkpoint tensor of shape \(100, 24\)"):
        emb.weight_loader(emb.weight, torch.zeros(128, dim))
    assert make(VocabParallelEmbedding, 64, 8).num_embeddings_padded == 64
    assert make(VocabParallelEmbedding, 65, 8, padding_size=8).num_embeddings_padded == 72
    with pytest.raises(ValueError, match="org_num_embeddings=101"):
        make(VocabParallelEmbedding, vocab, dim, org_num_embeddings=101)


def test_vocab_parallel_embedding_with_added_vocab():
    """vLLM's layout: the original 90 ids padded to 128 rows, the 10 added ids (90..99) after
    them, the whole padded to 192; checkpoints carry the original rows, adapters the added ones."""
    org, vocab, dim = 90, 100, 24
    table = randn(vocab, dim)
    emb = make(VocabParallelEmbedding, vocab, dim, org_num_embeddings=org)
    assert (emb.org_vocab_size, emb.num_added_embeddings) == (org, 10)
    assert (emb.org_vocab_size_padded, emb.num_embeddings_padded) == (128, 192)
    emb.weight.fill_(float("nan"))  # poison: every row must be written
    emb.weight_loader(emb.weight, table[:org])
    emb.added_vocab_loader(emb.weight, table[org:])
    assert torch.all(emb.weight[org:128] == 0) and torch.all(emb.weight[138:] == 0)
    assert torch.equal(emb.weight[128:138], table[org:])
    ids = torch.tensor([[0, 89, 90], [99, 45, 91]])
    for path in PATHS:
        assert_close(getattr(emb, path)(ids), table.double()[ids], torch.float32)
    with pytest.raises(ValueError, match=r"full checkpoint tensor of shape \(90, 24\)"):
        emb.weight_loader(emb.weight, table)
    with pytest.raises(ValueError, match=r"all added rows of shape \(10, 24\)"):
        emb.added_vocab_loader(emb.weight, table[:5])


def test_logits_processor_drops_the_added_vocab():
    org, vocab, dim = 90, 100, 16
    table, bias = randn(vocab, dim), randn(vocab)
    head = make(ParallelLMHead, vocab, dim, bias=True, org_num_embeddings=org)
    head.weight_loader(head.weight, table[:org])
    head.added_vocab_loader(head.weight, table[org:])
    head.weight_loader(head.bias, bias[:org])
    head.added_vocab_loader(head.bias, bias[org:])
    hidden = randn(3, dim)
    proc = make(LogitsProcessor, vocab, org_vocab_size=org)
    for path in PATHS:
        out = getattr(proc, path)(head, hidden)
        assert out.shape == (3, org)
        assert_close(out, ref_linear(hidden, table[:org], bias[:org]), torch.float32)


def test_parallel_lm_head_is_not_called_directly():
    head = make(ParallelLMHead, 100, 16, bias=True)
    assert head.bias.shape == (128,)
    with pytest.raises(RuntimeError, match="LogitsProcessor"):
        head(torch.zeros(2, 16))
    emb = make(VocabParallelEmbedding, 100, 16)
    assert head.tie_weights(emb).weight is emb.weight
    with pytest.raises(ValueError, match="padded or sharded differently"):
        head.tie_weights(make(VocabParallelEmbedding, 200, 16))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("soft_cap,scale", [(None, 1.0), (3.0, 0.5), (None, 2.0), (1.5, 1.0)])
def test_logits_processor(soft_cap, scale, dtype, path):
    vocab, dim = 131, 48
    table, bias = weights(vocab, dim, dtype, seed=7)
    head = make(ParallelLMHead, vocab, dim, bias=True, params_dtype=dtype)
    load(head, weight=table, bias=bias)
    hidden = randn(2, 3, dim, dtype=dtype)
    proc = make(LogitsProcessor, vocab, soft_cap=soft_cap, scale=scale)
    want = ref_linear(hidden, table, bias)
    if soft_cap is not None:
        want = soft_cap * torch.tanh(want / soft_cap)  # soft cap first ...
    want = want * scale  # ... then scale
    out = getattr(proc, path)(head, hidden)
    assert out.shape == (2, 3, vocab)  # the padding (131 -> 192) is sliced off
    assert_close(out, want, dtype)


def test_logits_processor_options():
    head = make(ParallelLMHead, 70, 8)
    load(head, weight=randn(70, 8))
    hidden = randn(4, 8)
    extra = torch.randn(128)
    proc = make(LogitsProcessor, 70, org_vocab_size=64)
    assert proc(head, hidden).shape == (4, 64)
    assert_close(proc(head, hidden, extra), (ref_linear(hidden, head.weight) + extra.double())[:, :64], torch.float32)
    skipped = proc(head, hidden, extra, skip_gather=True)  # tp 1: the local slice is everything
    assert_close(skipped, (ref_linear(hidden, head.weight) + extra.double())[:, :64], torch.float32)
    as_input = make(LogitsProcessor, 70, logits_as_input=True, soft_cap=2.0)
    logits = randn(4, 70) * 5
    assert_close(as_input(None, logits), 2.0 * torch.tanh(logits.double() / 2.0), torch.float32)
    with pytest.raises(ValueError, match="soft_cap must be positive"):
        make(LogitsProcessor, 70, soft_cap=0.0)
    with pytest.raises(ValueError, match="hidden size 9 != lm_head embedding_dim 8"):
        proc.forward_cpu(head, randn(4, 9))


NAMES = ("replicated_linear", "column_parallel_linear", "merged_column_parallel_linear", "qkv_parallel_linear",
         "row_parallel_linear", "vocab_parallel_embedding", "parallel_lm_head", "logits_processor")


def test_registered_and_in_the_dispatch_report():
    rows = {r.op: r for r in customop.dispatch_report(customop.Config(custom_ops=["all"]))}
    for name in NAMES:
        assert name in customop.list_ops() and name in rows
    with customop.use_config(customop.Config(custom_ops=["all", "-column_parallel_linear"])):
        layer = ColumnParallelLinear(8, 8)
    assert layer._forward_method == layer.forward_native


@pytest.mark.parametrize("name", [n for n in NAMES if n != "parallel_lm_head"])
def test_conforms_on_registered_samples(name):
    assert_conforms(CustomOp.op_registry[name])


def test_out_of_tree_replacement():
    @CustomOp.register_oot("ColumnParallelLinear")
    class VendorColumn(ColumnParallelLinear):
        def forward_oot(self, x):
            return self.forward_native(x)

    try:
        layer = ColumnParallelLinear(8, 16, bias=False)
        assert type(layer) is VendorColumn and layer.weight.shape == (16, 8)
        assert type(MergedColumnParallelLinear(8, [8, 8])) is MergedColumnParallelLinear  # its own op
    finally:
        CustomOp.unregister_oot("column_parallel_linear")


def test_compile_fullgraph():
    w1, b1 = weights(64, 32, torch.float32, seed=1)
    w2, b2 = weights(32, 64, torch.float32, seed=2)
    up, down = make(ColumnParallelLinear, 32, 64, gather_output=True), make(RowParallelLinear, 64, 32)
    load(up, weight=w1, bias=b1)
    load(down, weight=w2, bias=b2)
    emb, head = make(VocabParallelEmbedding, 100, 32), make(ParallelLMHead, 100, 32)
    load(emb, weight=randn(100, 32))
    head.tie_weights(emb)
    proc = make(LogitsProcessor, 100, soft_cap=4.0)

    def model(ids):
        h = emb(ids)
        h = h + down(F.silu(up(h)[0]))[0]
        return proc(head, h)

    ids = torch.tensor([[3, 99, 0, 42]])
    assert_close(torch.compile(model, fullgraph=True, backend="eager")(ids), model(ids))


@pytest.mark.slow
def test_compile_inductor_matches_eager():
    w, b = weights(48, 40, torch.float32)
    layer = make(RowParallelLinear, 40, 48)
    load(layer, weight=w, bias=b)
    x = randn(7, 40)
    assert_close(torch.compile(layer, fullgraph=True)(x)[0], ref_linear(x, w, b), torch.float32)
