"""``multi_head_latent_attention`` (DeepSeek MLA over a paged latent cache): every batch of its table
(``customop/samples/mla.py``), with q LoRA and with a plain q projection, on forward_native and
forward_cpu against the float64 reference (``tests/cases/mla.py``: per-head up-projected attention,
never the absorbed form), the rows written to the cache, decode == prefill on one sequence,
``llama_4_scaling``, the profile run, bad metadata, conformance; forward_cpu's CPU decode
(``backends/cpu/mla.py``) and packed prefill on a batch of odd contexts. The decode kernel
(``customop::mla_decode``) is tested in tests/backends/triton/test_mla_triton.py.

fp32 is compared elementwise; bf16/fp16 by normwise relative error, at most four unit roundoffs
(the layer stores ~10 intermediate results in the dtype, the reference none).
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from customop.backends.cpu.mla import latent_decode_by_rows
from customop.math.mla import paged_latent_decode
from customop.ops import linear as linear_module
from customop.ops.linear import fp32_linear
from customop.ops.mla import MLAMetadata, MultiHeadLatentAttentionWrapper
from customop.samples.mla import BATCHES, BLOCK_SIZE, DTYPES, Batch, build_modules, init_kwargs
from customop.testing import assert_close, assert_conforms, randn
from tests.cases.mla import reference

NORMWISE = {torch.bfloat16: 4 * 2.0 ** -8, torch.float16: 4 * 2.0 ** -11}


def close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    if dtype == torch.float32:
        assert_close(got, expected, dtype, what=what)
        return
    err = float((got.double() - expected).norm() / expected.norm())
    assert err <= NORMWISE[dtype], f"{what}: normwise relative error {err:.2e} > {NORMWISE[dtype]:.2e}"


def make(q_lora: bool, batch: Batch, dtype: torch.dtype):
    op = MultiHeadLatentAttentionWrapper(**init_kwargs(build_modules(q_lora, dtype), q_lora))
    return (op, *batch.build(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", ["forward_native", "forward_cpu"])
@pytest.mark.parametrize("q_lora,batch", list(itertools.product((True, False), BATCHES)),
                         ids=lambda v: v.label if isinstance(v, Batch) else ("q_lora" if v else "q_proj"))
def test_matches_float64_reference(q_lora, batch, path, dtype):
    op, positions, hidden, cache, meta = make(q_lora, batch, dtype)
    before = cache.clone()
    expected, rows = reference(op, positions, hidden, before, meta)
    got = getattr(op, path)(positions, hidden, cache, meta)
    assert got.dtype == dtype and got.shape == hidden.shape
    close(got, expected, dtype, f"{batch.label} {path}")
    written = cache.view(-1, cache.shape[-1])[meta.slot_mapping]
    close(written, rows, dtype, "cache rows")
    untouched = torch.ones(cache.numel() // cache.shape[-1], dtype=torch.bool)
    untouched[meta.slot_mapping] = False
    assert torch.equal(cache.view(-1, cache.shape[-1])[untouched].isnan(), before.view(-1, cache.shape[-1])[untouched].isnan())


#: decodes at odd contexts (1, 23: partial blocks; a request with 3 decode tokens, causal among
#: them), a chunked prefill and a fresh odd prefill: forward_cpu's CPU decode and packed prefill
CPU_ROUTE_BATCH = Batch("odd decodes + chunked + fresh prefill", ((0, 1), (22, 1), (9, 3), (30, 2), (4, 5), (0, 11)), 4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("q_lora", [True, False], ids=["q_lora", "q_proj"])
def test_forward_cpu_route_matches_float64_reference(q_lora, dtype):
    """forward_cpu's own pieces (``latent_decode_by_rows``, the packed causal prefill) on fresh
    random weights and inputs, against the float64 reference; and the CPU decode alone against
    ``customop::mla_decode``'s reference body, an empty row included."""
    gen = torch.Generator().manual_seed(11)
    op = MultiHeadLatentAttentionWrapper(**init_kwargs(build_modules(q_lora, dtype, generator=gen), q_lora))
    positions, hidden, cache, meta = CPU_ROUTE_BATCH.build(dtype, generator=gen)
    expected, rows = reference(op, positions, hidden, cache.clone(), meta)
    close(op.forward_cpu(positions, hidden, cache, meta), expected, dtype, "forward_cpu")
    close(cache.view(-1, cache.shape[-1])[meta.slot_mapping], rows, dtype, "cache rows")

    q_latent, q_pe = (randn(5, op.num_heads, n, dtype=dtype, generator=gen)
                      for n in (op.kv_lora_rank, op.qk_rope_head_dim))
    table = meta.block_table[[1, 3, 0, 2, 3]]
    seq_lens = torch.tensor([23, 0, 1, 11, 30], dtype=torch.int32)
    args = (q_latent, q_pe, cache, table, seq_lens, 30, op.dims.scale)
    got, want = latent_decode_by_rows(*args), paged_latent_decode(*args[:5], op.dims.scale)
    assert got.dtype == dtype and torch.equal(got[1], torch.zeros_like(got[1]))
    close(got, want.double(), dtype, "latent_decode_by_rows")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_forward_cpu_up_projects_prefills_on_cpu_linear(dtype, monkeypatch):
    """Where ``FP32_GEMM_FROM_ROWS`` sends half-precision GEMMs to fp32 (AVX2 CPUs; set here for
    this dtype from one row, so every CPU runs it), the prefills' ``kv_b_proj`` up-projection (the
    packed fresh prefill and the chunked one) takes it too, and the layer stays within the float64
    reference's tolerance."""
    monkeypatch.setattr(linear_module, "FP32_GEMM_FROM_ROWS", {dtype: 1})
    seen = []

    def recording(x, weight, bias=None):
        seen.append(tuple(weight.shape))
        return fp32_linear(x, weight, bias)

    monkeypatch.setattr(linear_module, "fp32_linear", recording)
    gen = torch.Generator().manual_seed(13)
    op = MultiHeadLatentAttentionWrapper(**init_kwargs(build_modules(False, dtype, generator=gen), False))
    positions, hidden, cache, meta = CPU_ROUTE_BATCH.build(dtype, generator=gen)
    expected, _ = reference(op, positions, hidden, cache.clone(), meta)
    close(op.forward_cpu(positions, hidden, cache, meta), expected, dtype, "forward_cpu, fp32 GEMMs")
    assert seen.count(tuple(op.kv_b_proj.weight.shape)) == 2, seen  # one packed prefill, one chunked


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("q_lora", [True, False], ids=["q_lora", "q_proj"])
def test_decode_equals_prefill(q_lora, dtype):
    """One 9-token sequence: prefilled at once, or 5 tokens prefilled then 4 decode steps through
    the cache and block table. Absorbed decode and up-projected prefill must agree."""
    op = MultiHeadLatentAttentionWrapper(**init_kwargs(build_modules(q_lora, dtype), q_lora))
    gen = torch.Generator().manual_seed(5)
    hidden = randn(9, op.hidden_size, dtype=dtype, generator=gen)
    table = torch.tensor([[7, 2, 5]], dtype=torch.int32)  # 3 blocks of 4 hold 9 positions

    def step(cache, start, count, decode):
        pos = torch.arange(start, start + count)
        slots = table[0, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        meta = MLAMetadata(slots, table, torch.tensor([start + count]), torch.tensor([0, count]), int(decode))
        return op(pos, hidden[start:start + count], cache, meta)

    fresh = lambda: torch.full((8, BLOCK_SIZE, op.kv_lora_rank + op.qk_rope_head_dim), float("nan"), dtype=dtype)  # noqa: E731
    whole = step(fresh(), 0, 9, decode=False)
    cache = fresh()
    parts = [step(cache, 0, 5, decode=False)] + [step(cache, t, 1, decode=True) for t in range(5, 9)]
    close(torch.cat(parts).double(), whole.double(), dtype, "decode vs prefill")


def test_llama_4_scaling_and_profile_run():
    op, positions, hidden, cache, meta = make(True, BATCHES[0], torch.float32)
    scaling = 1.0 + randn(hidden.shape[0], 1, 1, generator=torch.Generator().manual_seed(3)).abs()
    expected, _ = reference(op, positions, hidden, cache.clone(), meta, scaling)
    assert_close(op(positions, hidden, cache, meta, llama_4_scaling=scaling), expected, torch.float32)
    assert torch.equal(op(positions, hidden), torch.zeros_like(hidden))  # no metadata: vLLM's profile run


def _bad(meta: MLAMetadata, **changes) -> MLAMetadata:
    return dataclasses.replace(meta, **changes)


def test_bad_metadata_and_inputs():
    op, positions, hidden, cache, meta = make(True, BATCHES[0], torch.float32)
    table = meta.block_table.clone()
    table[1, 0] = 48
    cases = [
        (_bad(meta, block_table=table), "cache block table out of range: request 1 uses blocks"),
        (_bad(meta, slot_mapping=meta.slot_mapping + 48 * BLOCK_SIZE), "slot_mapping must be"),
        (_bad(meta, query_start_loc=torch.tensor([0, 1, 2, 9, 17])), "query_start_loc"),
        (_bad(meta, seq_lens=torch.tensor([14, 7, 3, 9])), "request 2 has 7 new tokens in a context of 3"),
        (_bad(meta, num_decodes=5), "4 requests but num_decodes=5"),
    ]
    for bad, match in cases:
        with pytest.raises(ValueError, match=f"customop.multi_head_latent_attention: {match}"):
            op(positions, hidden, cache, bad)
    with pytest.raises(ValueError, match="hidden_states must be"):
        op(positions, hidden[:, :10], cache, meta)
    with pytest.raises(ValueError, match="kv_cache must be"):
        op(positions, hidden, cache[..., :-1], meta)
    with pytest.raises(ValueError, match="needs mla_modules.fused_qkv_a_proj"):
        MultiHeadLatentAttentionWrapper(**init_kwargs(build_modules(False, torch.float32), True))
    with pytest.raises(NotImplementedError, match="sparse MLA"):
        modules = dataclasses.replace(build_modules(True, torch.float32), is_sparse=True)
        MultiHeadLatentAttentionWrapper(**init_kwargs(modules, True))


@pytest.mark.slow
@pytest.mark.parametrize("path", ["forward_native", "forward_kernel"])
def test_compiles_fullgraph_with_the_attention_as_one_node(path):
    """Inside ``torch.compile(fullgraph=True)`` the per-request walk runs as the opaque
    ``customop::mla_attention``: no graph break, the same output and cache rows as eager."""
    op, positions, hidden, cache, meta = make(True, BATCHES[-1], torch.float32)
    eager_cache, compiled_cache = cache.clone(), cache.clone()
    torch._dynamo.reset()
    with torch.no_grad():
        want = getattr(op, path)(positions, hidden, eager_cache, meta)
        got = torch.compile(getattr(op, path), fullgraph=True, backend="aot_eager")(positions, hidden, compiled_cache,
                                                                                     meta)
    assert_close(got, want, torch.float32)
    assert_close(compiled_cache, eager_cache, torch.float32, what="cache")  # NaN poison kept alike


@pytest.mark.parametrize("use_kernels", [False, True])
def test_opcheck_mla_attention(use_kernels):
    op, positions, hidden, cache, meta = make(False, BATCHES[-1], torch.float32)
    with torch.no_grad():
        q, kv_c_normed, k_pe = op._qkv(positions, hidden)
    d = op.dims
    args = (q, kv_c_normed, k_pe, cache.nan_to_num(0.0), meta.slot_mapping, meta.block_table, meta.seq_lens,
            meta.query_start_loc, op.kv_b_proj.weight.detach(), meta.num_decodes, d.sizes, d.scale, use_kernels)
    torch.library.opcheck(torch.ops.customop.mla_attention.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_conforms():
    assert_conforms(MultiHeadLatentAttentionWrapper)
