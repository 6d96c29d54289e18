"""No compile on the request path: the CPU compiled tiers' first graph serves every token count
(one-token inputs get one graph of their own), and ``customop.warmup`` builds those graphs at
start-up from small inputs. Compiles are counted on both routes of the compiled tier: Dynamo's
own counter (one per graph) and the standalone route's artifacts (``standalone.compiles``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import customop
from customop import Config, CustomOp, use_config
from customop.backends.cpu import compile_cache, standalone
from customop.ops import activation as A
from customop.ops.activation import SiluAndMul
from customop.ops.layernorm import RMSNorm
from customop.ops.quantization import GroupShape, QuantFP8
from customop.ops.rotary_embedding import RotaryEmbedding
from customop.testing import assert_close


def graphs() -> int:
    """Compiles on either route: Dynamo's graphs and the standalone route's artifacts."""
    return counters["stats"]["unique_graphs"] + standalone.compiles


@pytest.fixture(autouse=True)
def fresh_compiles():
    """Each test starts as a fresh process would: no graph, no shape class known."""
    compile_cache.reset()
    yield
    compile_cache.reset()


def enabled(cls, *args, **kwargs):
    with use_config(Config(custom_ops=["all"])):
        return cls(*args, **kwargs)


def test_one_graph_serves_every_token_count(monkeypatch):
    monkeypatch.setattr(SiluAndMul, "cpu_tiers", SiluAndMul.cpu_tiers.compiling_from(1))
    op = enabled(SiluAndMul)
    before = graphs()
    for shape in [(5, 64), (9, 64), (33, 64), (2, 3, 64), (7, 200)]:  # sizes, a 3-D input, another width
        x = torch.randn(shape)
        assert_close(op(x), op.forward_native(x), torch.float32)
        assert graphs() - before == 1, f"{shape} compiled again"
    op(torch.randn(1, 64))  # one token: Dynamo specialises size 1, one graph of its own
    op(torch.randn(1, 96))
    op(torch.randn(2, 64))
    assert graphs() - before == 2


def test_marks_do_not_stick_to_the_callers_tensors(monkeypatch):
    monkeypatch.setattr(SiluAndMul, "cpu_tiers", SiluAndMul.cpu_tiers.compiling_from(1))
    x = torch.randn(6, 64)
    enabled(SiluAndMul)(x)
    assert not hasattr(x, "_dynamo_weak_dynamic_indices")


@pytest.mark.slow
def test_norm_rotary_and_quant_compile_once_per_shape_class(monkeypatch):
    """The fused residual is marked with x (else the rows would be pinned to one size); rotary's
    query and key follow the positions; a static per-token scale follows x's rows."""
    monkeypatch.setattr(QuantFP8, "cpu_tiers", QuantFP8.cpu_tiers.compiling_from(1))
    norm = enabled(RMSNorm, 64, dtype=torch.bfloat16)  # bf16 compiles from one 4096-element input
    norm.cpu_tiers = norm.cpu_tiers.compiling_from(1)
    rope = enabled(RotaryEmbedding, 32, 32, 256, 10000.0, True, torch.float32)
    quant = enabled(QuantFP8, True, GroupShape.PER_TOKEN)
    calls = {
        "fused_add_rms_norm": lambda t: norm(torch.randn(t, 64, dtype=torch.bfloat16),
                                             torch.randn(t, 64, dtype=torch.bfloat16)),
        "rotary": lambda t: rope(torch.arange(t), torch.randn(t, 4 * 32), torch.randn(t, 2 * 32)),
        "static per-token quant": lambda t: quant(torch.randn(t, 64), torch.rand(t, 1) + 0.01),
    }
    for name, call in calls.items():
        before = graphs()
        for tokens in (5, 9, 40):
            call(tokens)
        assert graphs() - before == 1, name


def test_warmup_compiles_before_the_first_request():
    """SiluAndMul compiles from 512K fp32 elements: warmup builds that artifact from a 16 x 256
    input, and its aligned one (x's width a multiple of 64: ``CpuTiers.aligned_widths``), which
    the 600 x 4096 request runs."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.act = enabled(SiluAndMul)
            with use_config(Config(custom_ops=["none"])):
                self.off = SiluAndMul()  # disabled: runs forward_native, nothing to warm

    model = Model()
    before = graphs()
    rows = customop.warmup(model, sizes=(1, 16))
    assert graphs() - before == 2  # one token of 256 is below the threshold: no graph for it
    assert [(r.op, r.tokens, r.outcome) for r in rows] == [
        ("silu_and_mul", 1, "ran"), ("silu_and_mul", 16, "ran"), ("silu_and_mul", None, "skipped: runs "
                                                                   "forward_native, not forward_cpu")]
    before = graphs()
    x = torch.randn(600, 4096)  # 2.4M elements: the compiled tier
    assert_close(model.act(x), model.act.forward_native(x), torch.float32)
    assert graphs() == before


@pytest.mark.slow
def test_warmup_rotary_takes_the_head_counts_of_its_attention_module():
    """Rotary graphs are per head count (dynamic ones ran 1.5-2x slower): warmup reads vLLM's
    num_heads / num_kv_heads from the module holding the op, or skips it saying why."""
    class Attention(nn.Module):
        num_heads, num_kv_heads = 4, 2

        def __init__(self):
            super().__init__()
            self.rotary_emb = enabled(RotaryEmbedding, 32, 32, 256, 10000.0, True, torch.float32)

    attn = Attention()
    rows = customop.warmup(attn, sizes=(1, 16))
    assert [r.outcome for r in rows] == ["ran", "ran"]
    before = graphs()
    for tokens in (1, 3, 50, 300):
        pos = torch.arange(tokens) % 256
        attn.rotary_emb(pos, torch.randn(tokens, 4 * 32), torch.randn(tokens, 2 * 32))
        qkv = torch.randn(tokens, (4 + 2 * 2) * 32)  # vLLM's q, k, v from one projection
        q, k = qkv[:, :128], qkv[:, 128:192]  # at 300 tokens q is above _COPY_MAX: kept strided
        out = attn.rotary_emb(pos, q, k)
        want = attn.rotary_emb.forward_native(pos, q, k)
        assert_close(out[0], want[0], torch.float32)
        assert_close(out[1], want[1], torch.float32)
    assert graphs() == before
    rows = customop.warmup([attn.rotary_emb])  # no holder, no heads=: nothing to go by
    assert rows[0].outcome == "skipped: head counts unknown (pass heads=(q, kv))"


def test_warmup_reports_ops_it_cannot_feed():
    @CustomOp.register("warmup_test_op")
    class Unknown(CustomOp):
        def forward_native(self, x):
            return x

    try:
        rows = customop.warmup([enabled(Unknown)])
        assert len(rows) == 1 and rows[0].outcome.startswith("skipped: no warm-up inputs known")
    finally:
        CustomOp.op_registry.pop("warmup_test_op", None)


@pytest.mark.parametrize("sizes", [(), (0,), 16, (1.5,), (True,)])
def test_warmup_rejects_bad_sizes(sizes):
    with pytest.raises(ValueError, match="customop.warmup: sizes must be a sequence of positive token counts"):
        customop.warmup(enabled(SiluAndMul), sizes=sizes)


def test_warmup_rejects_what_is_not_an_op():
    with pytest.raises(TypeError, match="customop.warmup: expected a module or CustomOp instances, got Linear"):
        customop.warmup([nn.Linear(2, 2)])


@pytest.mark.slow
def test_apply_rotary_compiles_once_per_shape_class(monkeypatch):
    """x [S, heads, D] with cos/sin [S, D/2]: S is the token dim (marked in x and in cos/sin); the
    heads and head size stay static."""
    from customop.ops.rotary_embedding.apply_rotary import ApplyRotaryEmb

    monkeypatch.setattr(ApplyRotaryEmb, "cpu_tiers", ApplyRotaryEmb.cpu_tiers.compiling_from(1))
    op = ApplyRotaryEmb(True)
    before = graphs()
    for s in (5, 9, 40):
        x, cos, sin = torch.randn(s, 4, 32), torch.rand(s, 16), torch.rand(s, 16)
        assert_close(op(x, cos, sin), op.forward_native(x, cos, sin), torch.float32)
    assert graphs() - before == 1


@pytest.mark.slow
def test_warmup_covers_every_width_of_the_activations_and_quant():
    """Activations and QuantFP8 cannot tell warmup their width: their graphs and standalone
    artifacts are dynamic in it, so warming at its default width leaves no compile for requests
    of any width (odd, 4K-ish, 2 x 14336) and row count, one row included where one row reaches
    the threshold (silu_and_mul_with_clamp compiles from 8K bf16 elements)."""
    ops = {"gated": enabled(A.SiluAndMulWithClamp, 7.0, 1.702, 1.0), "gelu_new": enabled(A.NewGELU),
           "per-group quant": enabled(QuantFP8, False, GroupShape(1, 128))}
    rows = customop.warmup(list(ops.values()), dtypes=(torch.bfloat16,))
    assert all(r.outcome == "ran" for r in rows)
    before = graphs()
    widths = {"gated": (7 * 2, 4232, 14336 * 2), "gelu_new": (7, 4231, 14336), "per-group quant": (384, 4224, 14336)}
    with torch.no_grad():
        for name, op in ops.items():
            for width in widths[name]:
                for tokens in (1, 3, 40):
                    x = torch.randn(tokens, width).to(torch.bfloat16)
                    got, want = op(x), op.forward_native(x)
                    if name == "per-group quant":
                        assert torch.equal(got[1], want[1]) and torch.equal(got[0].float(), want[0].float())
                    else:
                        assert_close(got, want, torch.bfloat16)
                    assert graphs() == before, (name, width, tokens)


def test_situ_small_size_band_compiles_before_the_first_request(monkeypatch):
    """SituAndMul runs compiled from 1M elements and, below that, in a band of 1 to 64K elements
    (``CpuTiers.compiled_up_to``): warm-up builds the band's artifacts too (its one-token one
    included), so 1-4 rows of 2 x 8192 compile nothing on the request path, match the spec and
    take the compiled tier; 8 rows (128K elements) run the eager tier. (The AVX-512 CPUs' tiers,
    set on every CPU: on AVX2 ones the op compiles at every size.)"""
    op = enabled(A.SituAndMul, 4.0, 25.0)
    op.cpu_tiers = tiers = A.SITU_BAND_CPU_TIERS
    assert tiers.runs_compiled(1 << 16, torch.float32) and not tiers.runs_compiled((1 << 16) + 1, torch.float32)
    assert tiers.runs_compiled(1 << 20, torch.bfloat16) and not tiers.runs_compiled(0, torch.float32)
    assert not tiers.compiling_from(1 << 20).runs_compiled(1, torch.float32)  # experiments: no band
    rows = customop.warmup([op], dtypes=(torch.bfloat16,))
    assert all(r.outcome == "ran" for r in rows)
    before = graphs()
    compiled_calls = []
    real_run = standalone.run

    def counting_run(*args, **kwargs):
        compiled_calls.append(args[1].shape[0])
        return real_run(*args, **kwargs)

    monkeypatch.setattr(standalone, "run", counting_run)
    with torch.no_grad():
        for tokens in (1, 4, 8):
            x = torch.randn(tokens, 2 * 8192).to(torch.bfloat16)
            assert_close(op(x), op.forward_native(x), torch.bfloat16)
            assert graphs() == before, tokens
    assert compiled_calls == [1, 4]  # 8 rows: the eager tier


@pytest.mark.parametrize("name", ["gelu_new", "gelu_fast", "per-token quant"])
def test_one_thread_bands_compile_before_the_first_request(monkeypatch, name):
    """gelu_new and gelu_fast run compiled below their 16K threshold too (``compiled_up_to``),
    compiled for one thread up to 8K elements (``one_thread_up_to``); QuantFP8 below its 64K
    threshold, for one thread below 32K. Warm-up builds both thread counts' artifacts, one-token ones
    included, so no request compiles: small ones take the one-thread artifacts, the rest the
    threaded ones (one row too), each matching the spec."""
    op = (enabled(A.NewGELU) if name == "gelu_new" else enabled(A.FastGELU) if name == "gelu_fast"
          else enabled(QuantFP8, False, GroupShape.PER_TOKEN))
    rows = customop.warmup([op], dtypes=(torch.bfloat16,))
    assert all(r.outcome == "ran" for r in rows)
    before = graphs()
    taken = []
    real_run = standalone.run

    def recording_run(fam, x, *args, **kwargs):
        taken.append((tuple(x.shape), fam.options.get("cpp.threads", "threads")))
        return real_run(fam, x, *args, **kwargs)

    monkeypatch.setattr(standalone, "run", recording_run)
    shapes = ((1, 4096), (2, 4096), (3, 4096), (1, 40000), (1, 65536), (16, 4096), (600, 4096))
    with torch.no_grad():
        for shape in shapes:
            x = torch.randn(*shape).to(torch.bfloat16)
            got, want = op(x), op.forward_native(x)
            if name == "per-token quant":
                assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
            else:
                assert_close(got, want, torch.bfloat16)
            assert graphs() == before, shape
    one_thread = op.cpu_tiers.one_thread_up_to
    assert one_thread == (1 << 13 if name != "per-token quant" else (1 << 15) - 1)
    assert taken == [(s, 1 if s[0] * s[1] <= one_thread else "threads") for s in shapes]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_warmup_apply_rotary_from_its_attention_module(monkeypatch, dtype):
    """ApplyRotaryEmb's graphs are per head count, head size and rotary width: warmup reads
    num_heads / num_kv_heads, head_size and rotary_dim from the module holding it (or heads= and
    head_size=) and warms both head counts and both cos/sin layouts (contiguous, and chunked from
    one gather: row-strided, traced so), so that requests of 1, 3 and 50 tokens compile nothing; values within tolerance of the
    float64 spec. Without a head size it is skipped, saying what to pass."""
    from customop.math.rotary import apply_rotary_emb
    from customop.ops.rotary_embedding import ApplyRotaryEmb

    monkeypatch.setattr(ApplyRotaryEmb, "cpu_tiers", ApplyRotaryEmb.cpu_tiers.compiling_from(1))

    class Attention(nn.Module):
        num_heads, num_kv_heads, head_size, rotary_dim = 4, 2, 32, 16

        def __init__(self):
            super().__init__()
            self.apply_rotary = enabled(ApplyRotaryEmb)

    attn = Attention()
    rows = customop.warmup(attn, sizes=(1, 16), dtypes=(dtype,))
    assert [(r.op, r.tokens, r.outcome) for r in rows] == [("apply_rotary_emb", 1, "ran"),
                                                          ("apply_rotary_emb", 16, "ran")]
    before = graphs()
    gen = torch.Generator().manual_seed(7)
    for tokens in (1, 3, 50, 4100):  # 4100 x 8 cos elements: above _COPY_MAX, kept strided
        for heads in (4, 2):
            x = torch.randn(tokens, heads, 32, generator=gen).to(dtype)
            cache = torch.randn(tokens, 16, generator=gen).to(dtype)
            for cos, sin in (cache.chunk(2, dim=-1), (cache[:, :8].contiguous(), cache[:, 8:].contiguous())):
                want = apply_rotary_emb(x.double(), cos.double(), sin.double())
                assert_close(attn.apply_rotary(x, cos, sin), want.to(dtype), dtype)
    assert graphs() == before
    rows = customop.warmup([attn.apply_rotary], heads=(4, 2))  # no holder, no head_size=
    assert rows[0].outcome == ("skipped: head counts or head size unknown (pass heads=(q, kv) and "
                               "head_size=)")
    before = graphs()
    rows = customop.warmup([attn.apply_rotary], sizes=(5,), dtypes=(dtype,), heads=(3, 3), head_size=8)
    assert rows[0].outcome == "ran" and graphs() - before == 2  # one head count: two cos/sin layouts
    before = graphs()
    attn.apply_rotary(torch.randn(9, 3, 8).to(dtype), *torch.randn(9, 8).to(dtype).chunk(2, dim=-1))
    assert graphs() == before  # rotary_dim defaults to the whole head


@pytest.mark.slow
def test_warmup_apply_rotary_one_token_compiles_only_where_one_token_would():
    """One token of ApplyRotaryEmb is [1, heads, D]: its token count is 1 whatever the heads, so
    warmup builds the one-token graph only where one token reaches the threshold (16K elements:
    128 heads of 128, not 32 heads of 128, which run eagerly)."""
    from customop.ops.rotary_embedding import ApplyRotaryEmb

    op = enabled(ApplyRotaryEmb)
    before = graphs()
    customop.warmup([op], sizes=(1,), heads=(32, 32), head_size=128)
    assert graphs() == before
    customop.warmup([op], sizes=(1,), heads=(128, 128), head_size=128)
    assert graphs() - before == 1
