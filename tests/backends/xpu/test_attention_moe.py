"""The varlen-attention and gated-MoE wrappers (backends/xpu/attention.py, moe.py): the native
references against independent per-sequence / per-token computations (both tiers), the IPEX
mappings against the references (the stand-in for the XPU build's argument order in both tiers;
the real CPU build in the xpu tier), and the measured limits of IPEX that send calls native."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from customop.backends.xpu import attention, moe
from customop.testing import assert_close
from tests.backends.xpu import fake_ipex


def _packed(lengths_q, lengths_k, heads=4, kv_heads=2, head_dim=16, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(int(cu_k[-1]), kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(int(cu_k[-1]), kv_heads, head_dim, generator=gen).to(dtype)
    return q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k)


def _sdpa_per_sequence(q, k, v, cu_q, cu_k, causal, window=(-1, -1)):
    """Independent oracle: F.scaled_dot_product_attention per sequence in float64, with a boolean
    mask aligned bottom right (flash-attention's convention)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(len(cu_q) - 1):
        qs, ks, vs = (t[int(c[b]):int(c[b + 1])].double().transpose(0, 1)
                      for t, c in ((q, cu_q), (k, cu_k), (v, cu_k)))
        lq, lk = qs.shape[1], ks.shape[1]
        shift = torch.arange(lq)[:, None] + lk - lq
        j = torch.arange(lk)[None, :]
        mask = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            mask &= j <= shift
        if window[0] >= 0:
            mask &= j >= shift - window[0]
        if window[1] >= 0:
            mask &= j <= shift + window[1]
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
        out[int(cu_q[b]):int(cu_q[b + 1])] = o.transpose(0, 1).nan_to_num(0.0) * mask.any(-1)[None, :, None].transpose(0, 1)
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", [([5, 9, 1], [5, 9, 1]), ([3, 4], [7, 9])], ids=["self", "prefix"])
def test_varlen_native_matches_sdpa(causal, lengths):
    q, k, v, cu_q, cu_k, _, _ = _packed(*lengths)
    got = attention.varlen_attention_native(q, k, v, cu_q, cu_k, causal=causal)
    assert_close(got, _sdpa_per_sequence(q, k, v, cu_q, cu_k, causal).float())


def test_varlen_native_window_and_softcap():
    q, k, v, cu_q, cu_k, _, _ = _packed([6, 3], [6, 3], kv_heads=4)
    assert_close(attention.varlen_attention_native(q, k, v, cu_q, cu_k, window_size=(2, 1)),
                 _sdpa_per_sequence(q, k, v, cu_q, cu_k, False, (2, 1)).float())
    capped = attention.varlen_attention_native(q, k, v, cu_q, cu_k, softcap=0.5)
    s = torch.einsum("qhd,khd->hqk", q[:6].double(), k[:6].double()) / math.sqrt(16)
    expected = torch.einsum("hqk,khd->qhd", (0.5 * torch.tanh(s / 0.5)).softmax(-1), v[:6].double())
    assert_close(capped[:6], expected.float())


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_ipex_mapping_by_name_xpu_build_order(causal):
    """The stand-in has the XPU build's parameter order (no alibi/window): the mapping by name
    must still land every argument."""
    fns = fake_ipex.xpu_build().llm.functional
    q, k, v, cu_q, cu_k, max_q, max_k = _packed([5, 9, 2], [5, 9, 2])
    assert attention.ipex_takes(fns, q, cu_q, cu_k, max_q, max_k, causal, (-1, -1), 0.0)
    got = attention.varlen_attention_ipex(fns, q, k, v, cu_q, cu_k, max_q, max_k, None, causal)
    assert fns.calls == ["varlen_attention"]
    assert_close(got, attention.varlen_attention_native(q, k, v, cu_q, cu_k, causal=causal))


def test_varlen_ipex_not_taken_where_it_differs_from_the_spec():
    fns = fake_ipex.xpu_build().llm.functional
    q, k, v, cu_q, cu_k, max_q, max_k = _packed([3, 4], [7, 9])
    assert not attention.ipex_takes(fns, q, cu_q, cu_k, max_q, max_k, True, (-1, -1), 0.0)  # top-left causal
    assert attention.ipex_takes(fns, q, cu_q, cu_k, max_q, max_k, False, (-1, -1), 0.0)
    q, k, v, cu_q, cu_k, max_q, max_k = _packed([4, 4], [4, 4])
    assert not attention.ipex_takes(fns, q, cu_q, cu_k, max_q, max_k, False, (2, 0), 0.0)
    assert not attention.ipex_takes(fns, q, cu_q, cu_k, max_q, max_k, False, (-1, -1), 30.0)
    # CPU tensors never take IPEX through the entry point (it serves XPU tensors only).
    assert_close(attention.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, causal=True),
                 attention.varlen_attention_native(q, k, v, cu_q, cu_k, causal=True))


@pytest.mark.ipex
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_varlen_real_ipex(ipex, dtype, causal, kv_heads):
    fns = ipex.llm.functional
    q, k, v, cu_q, cu_k, max_q, max_k = _packed([5, 17, 1], [5, 17, 1], kv_heads=kv_heads, dtype=dtype)
    assert attention.ipex_takes(fns, q, cu_q, cu_k, max_q, max_k, causal, (-1, -1), 0.0)
    got = attention.varlen_attention_ipex(fns, q, k, v, cu_q, cu_k, max_q, max_k, None, causal)
    assert_close(got, attention.varlen_attention_native(q, k, v, cu_q, cu_k, causal=causal))


@pytest.mark.ipex
def test_real_ipex_causal_is_top_left(ipex):
    """Why ipex_takes refuses causal calls with Lq != Lk: IPEX masks j <= i, not j <= i + Lk - Lq."""
    q, k, v, cu_q, cu_k, max_q, max_k = _packed([3, 4], [7, 9], kv_heads=4)
    got = attention.varlen_attention_ipex(ipex.llm.functional, q, k, v, cu_q, cu_k, max_q, max_k, None, True)
    spec = attention.varlen_attention_native(q, k, v, cu_q, cu_k, causal=True)
    assert (got - spec).abs().max() > 0.1
    top_left = torch.cat([_sdpa_per_sequence(q[a:b], k[c:c + b - a], v[c:c + b - a],
                                             torch.tensor([0, b - a]), torch.tensor([0, b - a]), True)
                          for a, b, c in ((0, 3, 0), (3, 7, 7))])
    assert_close(got, top_left.float())


# ---- MoE -----------------------------------------------------------------------------------------

E, H, I, T = 8, 32, 48, 11


def _moe_case(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=gen) / 6).to(dtype)
    w2 = (torch.randn(E, H, I, generator=gen) / 6).to(dtype)
    return x, w13, w2, torch.randn(T, E, generator=gen)


def _moe_per_token(x, w13, w2, weights, ids):
    """Independent oracle: token by token, expert by expert, float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            out[t] += w * (w2[e].double() @ (F.silu(gate) * up))
    return out


def test_route_matches_a_direct_computation():
    logits = torch.randn(T, E)
    weights, ids = moe.route(logits, 2, renormalize=True)
    probs = logits.softmax(-1)
    top = probs.topk(2, dim=-1)
    assert torch.equal(ids, top.indices)
    assert_close(weights, top.values / top.values.sum(-1, keepdim=True))
    # Grouped (D.5, no bias): 4 groups of 2, keep the 2 groups with the best max, then top 2.
    weights, ids = moe.route(logits, 2, renormalize=False, num_expert_group=4, topk_group=2)
    for t in range(T):
        best_groups = probs[t].view(4, 2).amax(-1).topk(2).indices.tolist()
        allowed = [e for e in range(E) if e // 2 in best_groups]
        expected = sorted(allowed, key=lambda e: -probs[t, e].item())[:2]
        assert ids[t].tolist() == expected
    with pytest.raises(ValueError, match="scoring_func"):
        moe.route(logits, 2, True, scoring_func="relu")


@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid"])
def test_gated_moe_native(scoring_func):
    x, w13, w2, logits = _moe_case()
    weights, ids = moe.route(logits, 2, True, scoring_func)
    got = moe.GatedMLPMoE(w13, w2)(x, logits, 2, scoring_func=scoring_func)
    assert_close(got, _moe_per_token(x, w13, w2, weights, ids).float())
    with pytest.raises(ValueError, match="w13 must be"):
        moe.GatedMLPMoE(w13[:, :I], w2)


@pytest.mark.ipex
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("routing", [dict(renormalize=True), dict(renormalize=False),
                                     dict(renormalize=True, num_expert_group=4, topk_group=2)],
                         ids=["renorm", "no-renorm", "grouped"])
def test_gated_moe_real_ipex(ipex, dtype, routing):
    x, w13, w2, logits = _moe_case(dtype)
    w13_before, w2_before = w13.clone(), w2.clone()
    layer = moe.GatedMLPMoE(w13, w2, ipex=ipex)
    assert torch.equal(w13, w13_before) and torch.equal(w2, w2_before)  # prepacking left ours alone
    got = layer(x, logits, 2, **routing)
    weights, ids = moe.route(logits, 2, routing["renormalize"], "softmax", routing.get("num_expert_group"),
                             routing.get("topk_group"))
    assert_close(got, _moe_per_token(x, w13, w2, weights, ids).to(dtype))


@pytest.mark.ipex
def test_gated_moe_real_ipex_hands_on_what_it_gets_wrong(ipex):
    """Sigmoid scoring (IPEX raises) and a score-correction bias (IPEX differs from D.5) run native."""
    x, w13, w2, logits = _moe_case()
    layer, native = moe.GatedMLPMoE(w13, w2, ipex=ipex), moe.GatedMLPMoE(w13, w2)
    bias = torch.rand(E)
    for kwargs in (dict(scoring_func="sigmoid"),
                   dict(num_expert_group=4, topk_group=2, e_score_correction_bias=bias)):
        assert torch.equal(layer(x, logits, 2, **kwargs), native(x, logits, 2, **kwargs))
    with pytest.raises(AssertionError):
        layer._ipex_moe(x, False, 2, logits, True, scoring_func="sigmoid")
