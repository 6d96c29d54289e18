"""The norms' compiled tier without Dynamo (backends/cpu/standalone.py, issue 18): fresh random
inputs at odd row counts in every dtype against the float64 references and bitwise against the
Dynamo path it replaces; one artifact for every token count of two or more (one more for one
token), no Dynamo graph while the guards hold; each guard failing falls back to the Dynamo path
with the right result; a torch without ``standalone_compile`` degrades to that path, said once."""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch

from customop.backends.cpu import standalone
from customop.config import Config, use_config
from customop.ops import layernorm as L
from customop.ops.mamba import Mixer2RMSNormGated
from customop.samples.mamba import NORM_CASES
from customop.testing import assert_close
from tests.backends.cpu.compile_counting import fresh_compiles, graphs  # noqa: F401  (autouse fixture)
from tests.cases.layernorm import ref_fused_add, ref_gemma, ref_rms_norm
from tests.cases.mamba import norm_reference

H = 1031  # odd: the vector loops' tails run too
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def rms_norm(dtype, hidden=H, seed=0, weight_dtype=None):
    """An enabled RMSNorm compiling from one token, with a random weight (not ones)."""
    with use_config(Config(custom_ops=["all"])):
        op = L.RMSNorm(hidden, dtype=weight_dtype or dtype).requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    op.weight.copy_(torch.randn(hidden, generator=gen) * 0.3 + 1)
    op.cpu_tiers = op.cpu_tiers.compiling_from(1)
    return op


def via_dynamo(op):
    """The same op (parameters shared) with its compiled tier called through Dynamo, as before."""
    other = copy.copy(op)
    other.cpu_tiers = dataclasses.replace(op.cpu_tiers, standalone=False)
    return other


def randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_tiers_wiring():
    assert L.RMSNorm.cpu_tiers.standalone and Mixer2RMSNormGated.cpu_tiers.standalone
    assert L.GemmaRMSNorm.cpu_tiers.standalone  # its fp32 calls (bf16/fp16 run the hand-written kernel)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_float64_reference_and_bitwise_the_dynamo_path(dtype):
    """1, 7 and 4231 rows of fresh random inputs, rms_norm and the fused add: within the dtype's
    tolerance of the float64 reference, bitwise what the Dynamo path gives, with no Dynamo graph
    and four artifacts (two functions, one row and more)."""
    op = rms_norm(dtype)
    before, built = graphs(), standalone.compiles
    got = {}
    with torch.no_grad():
        for rows in (1, 7, 4231):
            x, residual = randn(rows, H, dtype=dtype, seed=rows), randn(rows, H, dtype=dtype, seed=rows + 1)
            got[rows] = x, residual, op.forward_cpu(x), op.forward_cpu(x, residual)
            assert_close(got[rows][2], ref_rms_norm(x, op.weight, op.eps), dtype)
            assert_close(got[rows][3], ref_fused_add(x, residual, op.weight, op.eps), dtype)
        assert graphs() == before and standalone.compiles - built == 4
        dynamo = via_dynamo(op)
        for rows, (x, residual, plain, fused) in got.items():
            assert torch.equal(plain, dynamo.forward_cpu(x)), rows
            assert all(map(torch.equal, fused, dynamo.forward_cpu(x, residual))), rows


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemma_float64_reference_and_bitwise_the_dynamo_path(dtype):
    """GemmaRMSNorm's compiled tier on the route (fp32 as shipped; bf16/fp16 where the hand-written
    kernel does not run): 1, 7 and 4231 rows of fresh random inputs and a random ``1 + w`` offset,
    the norm and the fused add within the dtype's tolerance of the float64 reference, bitwise
    the Dynamo path, no Dynamo graph, four artifacts."""
    with use_config(Config(custom_ops=["all"])):
        op = L.GemmaRMSNorm(H).requires_grad_(False)
    op.weight.copy_(torch.randn(H, generator=torch.Generator().manual_seed(3)) * 0.3)
    op.cpu_tiers = op.cpu_tiers.compiling_from(1)
    before, built = graphs(), standalone.compiles
    got = {}
    with torch.no_grad():
        for rows in (1, 7, 4231):
            x, residual = randn(rows, H, dtype=dtype, seed=rows + 5), randn(rows, H, dtype=dtype, seed=rows + 6)
            got[rows] = x, residual, op.forward_cpu(x), op.forward_cpu(x, residual)
            assert_close(got[rows][2], ref_gemma(x, op.weight, op.eps), dtype)
            assert_close(got[rows][3], ref_fused_add(x, residual, op.weight, op.eps, gemma=True), dtype)
        assert graphs() == before and standalone.compiles - built == 4
        dynamo = via_dynamo(op)
        for rows, (x, residual, plain, fused) in got.items():
            assert torch.equal(plain, dynamo.forward_cpu(x)), rows
            assert all(map(torch.equal, fused, dynamo.forward_cpu(x, residual))), rows


@pytest.mark.slow
def test_one_artifact_serves_every_token_count():
    op = rms_norm(torch.bfloat16)
    before, built = graphs(), standalone.compiles
    with torch.no_grad():
        for rows in (2, 3, 7, 64, 4231, 5, 1, 1, 2):
            x = randn(rows, H, dtype=torch.bfloat16, seed=rows)
            assert_close(op.forward_cpu(x), ref_rms_norm(x, op.weight, op.eps), torch.bfloat16)
        assert standalone.compiles - built == 2  # rows >= 2 (dynamic) and one row (static)
        x = randn(3, 5, H, dtype=torch.bfloat16, seed=9)  # 3-D: a view of its rows, same artifact
        out = op.forward_cpu(x)
        assert out.shape == x.shape and torch.equal(out.flatten(0, 1), op.forward_cpu(x.flatten(0, 1)))
        assert standalone.compiles - built == 2
        # a new key compiles a new artifact rather than reusing one: another hidden size, eps,
        # weight dtype
        for other in (rms_norm(torch.bfloat16, hidden=H + 2), rms_norm(torch.bfloat16, weight_dtype=torch.float32)):
            x = randn(6, other.hidden_size, dtype=torch.bfloat16, seed=6)
            assert_close(other.forward_cpu(x), ref_rms_norm(x, other.weight, other.eps), torch.bfloat16)
        op.eps = 1e-2
        x = randn(6, H, dtype=torch.bfloat16, seed=7)
        assert_close(op.forward_cpu(x), ref_rms_norm(x, op.weight, 1e-2), torch.bfloat16)
        assert standalone.compiles - built == 5
    assert graphs() == before


class _Sub(torch.Tensor):
    pass


def _guard_cases(dtype):
    x = randn(5, H, dtype=dtype, seed=11)
    return {
        "non-contiguous": randn(H, 5, dtype=dtype, seed=12).t(),
        "negative bit": torch._neg_view(x),
        "subclass": x.as_subclass(_Sub),
        "requires-grad": x.clone().requires_grad_(),
        "zero rows": x[:0],
    }


@pytest.mark.slow
def test_guard_failures_take_the_dynamo_path():
    """Each failing guard: ``standalone.run`` says no, and forward_cpu's result (through Dynamo)
    still matches the spec; autograd still records through the Dynamo path."""
    dtype = torch.bfloat16
    op = rms_norm(dtype)
    fam = op.cpu_tiers.standalone_family(L.rms_norm)
    built = standalone.compiles
    for name, x in _guard_cases(dtype).items():
        args = (op.weight, op.eps, None)
        assert standalone.run(fam, x, args) is None, name
        if name == "negative bit":  # torch.compile itself ignores the bit (torch 2.13: t * 2 of a
            continue                # negated view of ones gives 2), so the Dynamo path is no reference
        with torch.no_grad() if name != "requires-grad" else torch.enable_grad():
            out = op.forward_cpu(x)
        assert_close(out.detach(), L.rms_norm(x.detach(), op.weight, op.eps), dtype, what=name)
        if name == "requires-grad":
            assert out.requires_grad
            out.float().sum().backward()
            assert x.grad is not None and x.grad.shape == x.shape
    x = randn(5, H, dtype=dtype, seed=13)
    assert standalone.run(fam, x, (op.weight.t()[None], op.eps, None)) is None  # weight not [H]
    assert standalone.run(fam, x[0], (op.weight, op.eps, None)) is None  # 1-D x
    assert standalone.compiles == built  # nothing above reached a build


def test_guard_failures_in_context():
    """Modes, transforms, tracers and autocast around the call: no artifact call."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x, w = torch.randn(5, 16), torch.ones(16)
    fam = L.RMSNorm.cpu_tiers.standalone_family(L.rms_norm)
    built = standalone.compiles

    def run(t):
        assert standalone.run(fam, t, (w, 1e-6, None)) is None
        return t

    with Mode():
        run(x)
    with torch.device("cpu"):  # a torch-function mode
        run(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        run(x)
    torch.vmap(lambda t: run(t[None]))(x)
    make_fx(run)(x)
    with FakeTensorMode() as mode:
        run(mode.from_tensor(x))
    assert standalone.compiles == built


@pytest.mark.slow
def test_missing_standalone_compile_takes_the_dynamo_path_logged_once(monkeypatch, caplog):
    import torch._inductor

    monkeypatch.delattr(torch._inductor, "standalone_compile")
    monkeypatch.setattr(standalone, "_missing_logged", False)
    built = standalone.compiles
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger=standalone.__name__):
        for dtype in (torch.bfloat16, torch.float32):
            op = rms_norm(dtype)
            for rows in (4, 9):
                x = randn(rows, H, dtype=dtype, seed=rows)
                assert_close(op.forward_cpu(x), ref_rms_norm(x, op.weight, op.eps), dtype)
    assert standalone.compiles == built
    assert sum("standalone_compile" in r.getMessage() for r in caplog.records) == 1


def test_a_failed_build_is_logged_and_remembered(monkeypatch, caplog):
    calls = []

    def broken(*args):
        calls.append(args)
        raise RuntimeError("no")

    monkeypatch.setattr(standalone, "compile_graph", broken)
    op = rms_norm(torch.float32, hidden=16)
    op.cpu_tiers = op.cpu_tiers.compiling_from(1)
    fam = op.cpu_tiers.standalone_family(L.rms_norm)
    with caplog.at_level(logging.WARNING, logger=standalone.__name__):
        for rows in (3, 4):
            assert standalone.run(fam, torch.randn(rows, 16), (op.weight, op.eps, None)) is None
    assert len(calls) == 1 and sum("failed" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.slow
@pytest.mark.parametrize("groups", [1, 8])
def test_gated_norm_standalone(groups):
    """Mixer2RMSNormGated's compiled tier through the artifacts: bf16 and fp32, 1, 7 and 4231
    rows, against the float64 reference and bitwise the Dynamo path."""
    case, hidden = NORM_CASES[0], 1024
    for dtype in (torch.bfloat16, torch.float32):
        with use_config(Config(custom_ops=["all"])):
            op = case.build(hidden, groups, dtype, torch.Generator().manual_seed(groups))
        op.cpu_tiers = op.cpu_tiers.compiling_from(1)
        before, built = graphs(), standalone.compiles
        got = {}
        with torch.no_grad():
            for rows in (1, 7, 4231):
                x, gate = case.inputs(rows, hidden, dtype, torch.Generator().manual_seed(rows))
                got[rows] = x, gate, op.forward_cpu(x, gate)
                assert_close(got[rows][2], norm_reference(op, x, gate), dtype)
            assert graphs() == before and standalone.compiles - built == 2
            dynamo = via_dynamo(op)
            for rows, (x, gate, out) in got.items():
                assert torch.equal(out, dynamo.forward_cpu(x, gate)), rows


@pytest.mark.slow
def test_warmup_builds_the_artifacts():
    """``customop.warmup`` in the requests' grad mode builds the one-row and the dynamic artifacts;
    requests of any token count then build nothing (and trace no Dynamo graph)."""
    import customop

    with use_config(Config(custom_ops=["all"])):
        op = L.RMSNorm(4096, dtype=torch.bfloat16)  # bf16 compiles from one 4096-wide token
    op.cpu_tiers = dataclasses.replace(op.cpu_tiers, native_from=float("inf"))  # else the native kernel runs bf16
    built_before = standalone.compiles
    with torch.inference_mode():
        rows = customop.warmup(op, sizes=(1, 16), dtypes=(torch.bfloat16,))
        assert [r.outcome for r in rows] == ["ran", "ran"]
        assert standalone.compiles - built_before == 4  # with and without the residual, 1 row and more
        before, built = graphs(), standalone.compiles
        for tokens in (1, 7, 300):
            x = randn(tokens, 4096, dtype=torch.bfloat16, seed=tokens)
            assert_close(op(x), ref_rms_norm(x, op.weight, op.eps), torch.bfloat16)
            assert_close(op(x, x), ref_fused_add(x, x, op.weight, op.eps), torch.bfloat16)
        assert standalone.compiles == built and graphs() == before


def _scaled_sum(x, residual, weight):
    return (x + residual) * weight


def _pairs(x):
    return x.reshape(-1, 2, x.shape[-1]).sum(1)  # constrains the rows: an even count


def _fours(x):
    return x.reshape(-1, 4) * 2  # the rows times the width: a multiple of 4


@pytest.mark.slow
def test_width_dynamic_families():
    """``dynamic_hidden`` (the activations, QuantFP8): x, the row tensors and the ``[hidden]``
    weight share one width symbol, the rows another, also when the first call's row count equals
    its width; a guard on the rows alone refuses the graph at every width; a guard in both
    symbols is checked per width (for every row count): the width is traced as a multiple of what
    the guards need (4 here, ``quantum``), and a width that fails them gets its own artifact (here
    refused too: Dynamo's path), never the shared one."""
    fam = standalone.family(_scaled_sum, {}, dynamic_hidden=True)
    built = standalone.compiles
    for rows, width in ((16, 16), (5, 40), (3, 7), (16, 16)):
        x, r, w = (randn(rows, width, dtype=torch.float32, seed=s) for s in (1, 2, 3))
        w = w[0].contiguous()
        assert torch.equal(standalone.run(fam, x, (r, w)), (x + r) * w), (rows, width)
    assert standalone.compiles - built == 1
    (art,) = fam.artifacts.values()
    assert isinstance(art, standalone.Widths) and art.quantum == 1
    assert art.verdicts == {16: True, 40: True, 7: True}

    built = standalone.compiles
    pairs = standalone.family(_pairs, {}, dynamic_hidden=True)
    assert standalone.run(pairs, torch.randn(4, 8), ()) is None
    assert standalone.run(pairs, torch.randn(6, 12), ()) is None  # remembered: refused, not rebuilt
    assert standalone.compiles - built == 1

    fours = standalone.family(_fours, {}, dynamic_hidden=True)
    for rows, width in ((2, 8), (3, 12), (7, 16)):
        x = torch.randn(rows, width)
        assert torch.equal(standalone.run(fours, x, ()), x.reshape(-1, 4) * 2)
    assert standalone.compiles - built == 2
    assert standalone.run(fours, torch.randn(2, 6), ()) is None  # 6 x 3 rows is no multiple of 4
    assert standalone.compiles - built == 3  # its own artifact, refused for its rows (Dynamo's path)
    (art,) = [a for a in fours.artifacts.values() if isinstance(a, standalone.Widths)]
    assert art.quantum == 4 and art.verdicts == {8: True, 12: True, 16: True, 6: False}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_rotary_takes_the_token_route(dtype):
    """RotaryEmbedding's compiled tier without Dynamo (``run_tokens``): positions ``[T]``, query and
    key ``[T, heads * head_size]`` of different widths share the token symbol, the cos/sin cache is
    static. One artifact for every T of two or more, one for T == 1, no Dynamo graph, bitwise the
    Dynamo path and within tolerance of the spec; a missing key, a cache as long as T (its own
    artifact: the cache is keyed by shape) and a non-contiguous query (small: copied to the
    traced layout, the same artifact) stay right."""
    from customop.ops.rotary_embedding import RotaryEmbedding

    assert RotaryEmbedding.cpu_tiers.standalone
    with use_config(Config(custom_ops=["all"])):
        op = RotaryEmbedding(32, 32, 64, 10000.0, True, dtype)
    dynamo = via_dynamo(op)
    before, built = graphs(), standalone.compiles
    got = []
    with torch.no_grad():
        for tokens in (1, 7, 40, 2, 1):
            pos = torch.randint(0, 64, (tokens,), generator=torch.Generator().manual_seed(tokens))
            q, k = randn(tokens, 4 * 32, dtype=dtype, seed=tokens), randn(tokens, 2 * 32, dtype=dtype, seed=-tokens)
            got.append((pos, q, k, op.forward_cpu(pos, q, k)))
            want = op.forward_native(pos, q, k)
            assert_close(got[-1][3][0], want[0], dtype)
            assert_close(got[-1][3][1], want[1], dtype)
        assert standalone.compiles - built == 2 and graphs() == before
        for pos, q, k, (q_out, k_out) in got:
            q2, k2 = dynamo.forward_cpu(pos, q, k)
            assert torch.equal(q_out, q2) and torch.equal(k_out, k2), pos.shape
        pos, q, k = got[1][:3]
        q_only, none = op.forward_cpu(pos, q, None)
        assert none is None and torch.equal(q_only, got[1][3][0])
        pos = torch.arange(64) % 64  # T == the cache's length
        q, k = randn(64, 4 * 32, dtype=dtype, seed=1), randn(64, 2 * 32, dtype=dtype, seed=2)
        out = op.forward_cpu(pos, q, k)
        assert torch.equal(out[0], dynamo.forward_cpu(pos, q, k)[0])
        built = standalone.compiles
        q_strided = torch.empty(4 * 32, 64, dtype=dtype).t().copy_(q)
        assert torch.equal(op.forward_cpu(pos, q_strided, k)[0], out[0])
        assert standalone.compiles == built


@pytest.mark.slow
def test_apply_rotary_takes_the_token_route(monkeypatch):
    """ApplyRotaryEmb's compiled tier without Dynamo (``run_tokens`` with a 3-D x): x ``[S, heads,
    D]`` and cos/sin ``[S, rot/2]`` (chunked from one tensor: strided, small, copied) share the
    token symbol. One artifact for every S of two or more, one for S == 1, no Dynamo graph, bitwise
    the Dynamo path, close to the float64 spec; a 4-D x, a strided x and a transposed cos/sin above
    ``_COPY_MAX`` take Dynamo's path and stay right. bf16 only (~5 s a dtype; fp32 is the same
    route, and test_rotary_embedding.py covers its values)."""
    from customop.math.rotary import apply_rotary_emb
    from customop.ops.rotary_embedding import ApplyRotaryEmb

    assert ApplyRotaryEmb.cpu_tiers.standalone
    with use_config(Config(custom_ops=["all"])):
        op = ApplyRotaryEmb()
    op.cpu_tiers = op.cpu_tiers.compiling_from(1)
    dynamo = via_dynamo(op)
    before, built = graphs(), standalone.compiles
    got = []
    dtype = torch.bfloat16
    with torch.no_grad():
        for tokens in (1, 7, 40, 2, 1):
            x = randn(tokens, 4, 32, dtype=dtype, seed=tokens)
            cos, sin = randn(tokens, 16, dtype=dtype, seed=-tokens).chunk(2, dim=-1)  # rot 16 < D 32
            got.append((x, cos, sin, op.forward_cpu(x, cos, sin)))
            want = apply_rotary_emb(x.double(), cos.double(), sin.double(), op.is_neox_style)
            assert_close(got[-1][3], want.to(dtype), dtype)
        assert standalone.compiles - built == 2 and graphs() == before
        for x, cos, sin, out in got:
            assert torch.equal(out, dynamo.forward_cpu(x, cos, sin)), x.shape
        x, cos, sin, out = got[1]
        assert torch.equal(op.forward_cpu(x.unsqueeze(0), cos, sin)[0], out)  # 4-D: Dynamo's path
        x_strided = torch.empty(4, 7, 32, dtype=dtype).transpose(0, 1).copy_(x)
        assert torch.equal(op.forward_cpu(x_strided, cos, sin), out)
        cos_t, sin_t = (torch.empty(8, 7, dtype=dtype).t().copy_(t) for t in (cos, sin))  # not row-strided
        monkeypatch.setattr(standalone, "_COPY_MAX", 8)
        assert torch.equal(op.forward_cpu(x, cos_t, sin_t), out)
        assert graphs() > before and standalone.compiles - built == 2


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_strided_token_arguments_are_traced_as_they_are(dtype):
    """cos/sin chunked from one gather (rows contiguous at a fixed stride) are traced with their
    stride, not copied (a copy above 32K elements opens an OpenMP region of its own, and was
    refused: 2048 tokens of 64 rotary pairs took Dynamo's path): 7, 1200, 4231 and 9001 tokens
    share one artifact, no Dynamo graph, bitwise the Dynamo path and close to the float64 spec;
    contiguous cos/sin get the contiguous artifact, bitwise the same values; a small call with a
    row stride that has no artifact is copied to the contiguous one (compiles nothing); a
    transposed cos/sin (not row-strided) is copied up to ``_COPY_MAX`` elements and takes Dynamo's
    path above. RotaryEmbedding's query and key sliced from one qkv tensor take the same route."""
    from customop.math.rotary import apply_rotary_emb
    from customop.ops.rotary_embedding import ApplyRotaryEmb, RotaryEmbedding

    with use_config(Config(custom_ops=["all"])):
        op = ApplyRotaryEmb()
        rope = RotaryEmbedding(32, 32, 64, 10000.0, True, dtype)
    op.cpu_tiers = op.cpu_tiers.compiling_from(1)
    rope.cpu_tiers = rope.cpu_tiers.compiling_from(1)
    dynamo = via_dynamo(op)
    before, built = graphs(), standalone.compiles
    got = []
    with torch.no_grad():
        for tokens in (7, 1200, 4231, 9001):
            x = randn(tokens, 2, 64, dtype=dtype, seed=tokens)
            cos, sin = randn(tokens, 64, dtype=dtype, seed=-tokens).chunk(2, dim=-1)
            assert not cos.is_contiguous()
            got.append((x, cos, sin, op.forward_cpu(x, cos, sin)))
            want = apply_rotary_emb(x.double(), cos.double(), sin.double(), op.is_neox_style)
            assert_close(got[-1][3], want.to(dtype), dtype)
        assert graphs() == before and standalone.compiles - built == 1  # the strided one
        for x, cos, sin, out in got[:2]:
            assert torch.equal(op.forward_cpu(x, cos.contiguous(), sin.contiguous()), out)
        x, cos, sin, out = got[0]
        assert torch.equal(op.forward_cpu(x, cos, sin), out)  # small, its strided artifact exists
        wide = torch.empty(7, 96, dtype=dtype)
        wide[:, :32], wide[:, 32:64] = cos, sin
        assert torch.equal(op.forward_cpu(x, wide[:, :32], wide[:, 32:64]), out)  # small, row stride
        assert graphs() == before and standalone.compiles - built == 2  # 96 not built: copied
        for x, cos, sin, out in got:
            assert torch.equal(out, dynamo.forward_cpu(x, cos, sin)), x.shape
        x, cos, sin, out = got[0]  # 7 tokens: 224 elements, copied
        built, before = standalone.compiles, graphs()
        cos_t, sin_t = (torch.empty(32, 7, dtype=dtype).t().copy_(t) for t in (cos, sin))
        assert torch.equal(op.forward_cpu(x, cos_t, sin_t), out)
        assert graphs() == before and standalone.compiles == built
        x, cos, sin, out = got[1]  # 1200 tokens: 38400 elements, above _COPY_MAX
        cos_t, sin_t = (torch.empty(32, 1200, dtype=dtype).t().copy_(t) for t in (cos, sin))
        assert torch.equal(op.forward_cpu(x, cos_t, sin_t), out)
        assert graphs() - before == 1 and standalone.compiles == built  # Dynamo's path

        built, before = standalone.compiles, graphs()
        for tokens in (5, 300):
            pos = torch.randint(0, 64, (tokens,), generator=torch.Generator().manual_seed(tokens))
            qkv = randn(tokens, 4 * 32 + 2 * 2 * 32, dtype=dtype, seed=tokens)
            q, k = qkv[:, :128], qkv[:, 128:192]  # rows at qkv's stride; at 300 q is 38400 elements
            out_q, out_k = rope.forward_cpu(pos, q, k)
            want_q, want_k = rope.forward_cpu(pos, q.contiguous(), k.contiguous())
            assert torch.equal(out_q, want_q) and torch.equal(out_k, want_k)
            ref_q, ref_k = rope.forward_native(pos, q.double(), k.double())
            assert_close(out_q, ref_q.to(dtype), dtype)
            assert_close(out_k, ref_k.to(dtype), dtype)
        assert graphs() == before and standalone.compiles - built == 2  # contiguous, q and k strided
