"""MoE routing (``fused_topk``, ``grouped_topk``): each case of the table
(``customop/samples/moe.py``) on forward_native and forward_cpu against the float64 reference
(``tests/cases/moe.py``), hand-made inputs for the rules random inputs cannot pin down (ties, the
group score, bias vs weights), the library ops (opcheck, compile), vLLM's function forms and
bad inputs."""

from __future__ import annotations

import zlib

import pytest
import torch

from customop import Config, use_config
from customop.ops import moe
from customop.samples.moe import DTYPES, ROUTING, ROUTING_BY_LABEL, TOKENS
from customop.testing import assert_conforms, assert_same_error
from tests.cases.moe import assert_routing, op_routing

PARAMS = [pytest.param(c, t, id=f"{c.label}-T{t}") for c in ROUTING for t in TOKENS["small"]]


def build(case):
    with use_config(Config(custom_ops=["all"])):
        return case.build()


def gen(*key) -> torch.Generator:
    """A generator seeded from the test's parameters: fresh values per case, reproducible."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case,tokens", PARAMS)
def test_native_and_cpu_match_reference(case, tokens, dtype):
    op = build(case)
    hidden, logits, bias = case.inputs(tokens, dtype, generator=gen(case.label, tokens, str(dtype)))
    want = op_routing(op, logits, bias)
    assert op._forward_method == op.forward_cpu
    for path in (op.forward_native, op):
        got = path(hidden, logits, bias)
        assert_routing(case.label, got, want)
        assert got[0].shape == (tokens, op.topk)


@pytest.mark.parametrize("case", ROUTING, ids=lambda c: c.label)
def test_library_op_reference_matches(case):
    """torch.ops.customop.* on CPU tensors runs the reference body: the path forward_kernel takes
    on a device without a kernel."""
    op = build(case)
    hidden, logits, bias = case.inputs(7, torch.bfloat16, generator=gen(case.label))
    assert_routing(case.label, op.forward_kernel(hidden, logits, bias), op_routing(op, logits, bias))


@pytest.mark.parametrize("label", ["topk biased sigmoid E32 k4 x2.5", "grouped V3 E256 g8 tg4 k8",
                                   "grouped V2 softmax E64 g8 tg3 k6"])
def test_library_ops_pass_opcheck(label):
    case = ROUTING_BY_LABEL[label]
    op = build(case)
    hidden, logits, bias = case.inputs(5, torch.float32, generator=gen(label))
    args = (logits, *op._args(bias)) if case.op == "fused_topk" else (logits, *op._args(), bias)
    torch.library.opcheck(getattr(torch.ops.customop, case.op).default, args)


@pytest.mark.slow
def test_kernel_path_compiles_fullgraph():
    case = ROUTING_BY_LABEL["grouped V3 E256 g8 tg4 k8"]
    op = build(case)
    hidden, logits, bias = case.inputs(5, torch.bfloat16, generator=gen("compile"))
    torch.compiler.reset()
    got = torch.compile(op.forward_kernel, fullgraph=True)(hidden, logits, bias)
    assert_routing(case.label, got, op_routing(op, logits, bias))


# ---- the rules, on hand-made inputs -------------------------------------------------------------


def test_ties_go_to_the_lower_expert_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0]])
    with use_config(Config(custom_ops=["all"])):
        op = moe.FusedTopK(topk=2, renormalize=False)
    _, ids = op(logits[:, :1].clone(), logits)
    assert ids.tolist() == [[1, 2]]
    # and the weights of tied experts are equal
    w, _ = op(logits, logits)
    assert w[0, 0] == w[0, 1]


def test_group_score_is_the_sum_of_two_with_a_bias_and_the_best_without():
    """Group 0 has the single best expert, group 1 the better pair: without a bias group 0 wins,
    with a (zero) bias the sum of the two best decides and group 1 wins."""
    logits = torch.tensor([[3.0, -3.0, 2.0, 2.0]])  # sigmoid scores; groups {0, 1} and {2, 3}
    with use_config(Config(custom_ops=["all"])):
        op = moe.GroupedTopk(topk=1, renormalize=False, num_expert_group=2, topk_group=1, scoring_func="sigmoid")
    for path in (op.forward_native, op.forward_kernel):
        assert path(logits, logits)[1].tolist() == [[0]]
        assert path(logits, logits, torch.zeros(4))[1].tolist() == [[2]]


def test_bias_chooses_the_experts_but_the_weights_are_unbiased():
    logits = torch.tensor([[2.0, 0.0, -1.0, 1.0]])
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0])
    with use_config(Config(custom_ops=["all"])):
        op = moe.FusedTopK(topk=2, renormalize=False, scoring_func="sigmoid")
    w, ids = op(logits, logits, bias)
    assert ids.tolist() == [[2, 0]]
    torch.testing.assert_close(w, torch.sigmoid(logits[:, [2, 0]]))


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_renormalize_and_scale(scoring):
    logits = torch.randn(6, 16, generator=gen(scoring))
    with use_config(Config(custom_ops=["all"])):
        plain = moe.FusedTopK(topk=3, renormalize=False, scoring_func=scoring)
        renorm = moe.FusedTopK(topk=3, renormalize=True, scoring_func=scoring, routed_scaling_factor=2.5)
    w_plain, ids = plain(logits, logits)
    w_renorm, ids_renorm = renorm(logits, logits)
    assert torch.equal(ids, ids_renorm)
    torch.testing.assert_close(w_renorm.sum(-1), torch.full((6,), 2.5))
    torch.testing.assert_close(w_renorm, 2.5 * w_plain / w_plain.sum(-1, keepdim=True))
    scores = torch.softmax(logits, -1) if scoring == "softmax" else torch.sigmoid(logits)
    torch.testing.assert_close(w_plain, scores.gather(1, ids.long()))


def test_softmax_and_sigmoid_weights_differ_on_the_same_logits():
    logits = torch.tensor([[0.5, 2.0, -1.0]])
    with use_config(Config(custom_ops=["all"])):
        soft = moe.FusedTopK(topk=1, renormalize=False)
        sig = moe.FusedTopK(topk=1, renormalize=False, scoring_func="sigmoid")
    assert soft(logits, logits)[1].tolist() == sig(logits, logits)[1].tolist() == [[1]]
    assert soft(logits, logits)[0].item() == pytest.approx(torch.softmax(logits, -1)[0, 1].item())
    assert sig(logits, logits)[0].item() == pytest.approx(torch.sigmoid(torch.tensor(2.0)).item())


def test_vllm_function_forms():
    hidden, logits = torch.randn(4, 8), torch.randn(4, 6, generator=gen("fn"))
    w, ids, rows = moe.fused_topk(hidden, logits, 2, True, indices_type=torch.int64)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    assert rows.tolist() == [[t, t + 4] for t in range(4)]  # k * T + t
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 8.0])
    w, ids = moe.fused_topk_bias(hidden, logits, bias, 2, False, routed_scaling_factor=2.0)
    assert (ids[:, 0] == 5).all()
    torch.testing.assert_close(w, 2.0 * torch.softmax(logits, -1).gather(1, ids.long()))
    w, ids = moe.grouped_topk(hidden, logits, 2, True, num_expert_group=3, topk_group=1)
    assert ((ids // 2)[:, 0] == (ids // 2)[:, 1]).all(), "both experts from the one kept group"


@pytest.mark.parametrize("op", ["fused_topk", "grouped_topk"])
def test_conforms(op):
    from customop.custom_op import CustomOp

    assert_conforms(CustomOp.op_registry[op])


# ---- bad inputs ---------------------------------------------------------------------------------


def _op(cls, **kw):
    with use_config(Config(custom_ops=["all"])):
        return cls(**kw)


@pytest.mark.parametrize("groups", [3, 5, 32])
def test_groups_that_do_not_divide_the_experts_raise(groups):
    logits = torch.randn(2, 16)
    op = _op(moe.GroupedTopk, topk=2, renormalize=True, num_expert_group=groups, topk_group=1)
    assert_same_error(op, (logits, logits), ValueError, f"num_expert_group={groups} must divide")
    with pytest.raises(ValueError, match=">= 1"):
        _op(moe.GroupedTopk, topk=2, renormalize=True, num_expert_group=0, topk_group=1)


def test_bad_routing_inputs_raise_on_every_path():
    logits = torch.randn(3, 8)
    topk = _op(moe.FusedTopK, topk=9, renormalize=True)
    assert_same_error(topk, (logits, logits), ValueError, r"top_k=9 must be in \[1, num_experts=8\]")
    ok = _op(moe.FusedTopK, topk=2, renormalize=True)
    assert_same_error(ok, (logits, logits.to(torch.int32)), TypeError, "floating-point")
    assert_same_error(ok, (logits, logits[0]), ValueError, "num_tokens, num_experts")
    assert_same_error(ok, (logits[:2], logits), ValueError, "tokens")
    assert_same_error(ok, (logits, logits, torch.zeros(7)), ValueError, r"float \[8\]")
    grouped = _op(moe.GroupedTopk, topk=5, renormalize=True, num_expert_group=4, topk_group=2)
    assert_same_error(grouped, (logits, logits), ValueError, "exceeds the 4 experts")
    with pytest.raises(ValueError, match="scoring_func"):
        _op(moe.FusedTopK, topk=2, renormalize=True, scoring_func="sqrtsoftplus")
