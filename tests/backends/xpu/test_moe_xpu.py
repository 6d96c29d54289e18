"""``customop::fused_experts`` on XPU tensors through IPEX's ``GatedMLPMOE``
(``backends/xpu/ipex_moe.py``): the mapping against the float64 reference of the MoE table on CPU
tensors, with a plain-torch stand-in (main tier) and the real CPU build of IPEX 2.8.0 (xpu tier,
marker ``ipex``); what it hands on; the module cache; the chain's choice; ``FusedMoE.forward_xpu``
end to end with the op's XPU kernel (CPU tensors redispatched to the XPU key). Never run on an
Intel GPU."""

from __future__ import annotations

import gc
import weakref
import zlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import customop
from customop.backends.xpu import chain, ipex_moe
from customop.ops.moe import cpu as moe_cpu
from customop.samples.moe import LAYERS_BY_LABEL, routed_inputs
from customop.testing import forced_platform
from tests.backends.xpu import fake_ipex
from tests.backends.xpu.conftest import env, real_ipex, xpu_kernel
from tests.cases import moe as ref


def gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


class FakeGatedMLPMOE(torch.nn.Module):
    """``ipex.llm.modules.GatedMLPMOE`` as documented and as its CPU build computes: silu(gate) * up
    per expert, the routing weight cast to the input dtype, the experts summed in that dtype."""

    built = 0

    def __init__(self, W13, W2, W3=None, use_prepack=True):  # noqa: N803  (IPEX's names)
        super().__init__()
        type(self).built += 1
        assert W3 is None and not use_prepack
        self.W13, self.W2 = W13, W2

    def forward(self, hidden_states, use_grouped_topk, top_k, router_logits, renormalize, topk_group=None,
                num_expert_group=None, custom_routing_function=None, scoring_func="softmax",
                e_score_correction_bias=None):
        assert custom_routing_function is not None and not use_grouped_topk
        weights, ids = custom_routing_function(hidden_states=hidden_states, gating_output=router_logits, topk=top_k,
                                               renormalize=renormalize)
        weights = weights.to(hidden_states.dtype)
        out = torch.zeros_like(hidden_states, dtype=hidden_states.dtype)
        inter = self.W2.shape[2]
        for t in range(hidden_states.shape[0]):
            for k in range(top_k):
                e = int(ids[t, k])
                h = self.W13[e].float() @ hidden_states[t].float()
                y = self.W2[e].float() @ (F.silu(h[:inter]) * h[inter:]).to(hidden_states.dtype).float()
                out[t] += (weights[t, k].float() * y).to(out.dtype)
        return out


@pytest.fixture(params=[pytest.param("fake", id="stand-in"), pytest.param("real", id="real-cpu-build",
                                                                          marks=pytest.mark.ipex)])
def modules(request):
    if request.param == "real":
        return real_ipex()[0].llm.modules
    return SimpleNamespace(GatedMLPMOE=FakeGatedMLPMOE)


def build(label: str, dtype: torch.dtype):
    case = LAYERS_BY_LABEL[label]
    with customop.use_config(customop.Config(custom_ops=["all"])):
        layer = case.build(dtype)
    with torch.no_grad():
        for name, value in case.weights(layer, generator=gen(label, str(dtype))).items():
            getattr(layer, name).copy_(value)
    return case, layer


def op_args(layer, x, w, ids):
    extra = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in layer.experts_args())
    return (x, layer.w13_weight.detach(), layer.w2_weight.detach(), w.float(), ids.to(torch.int32), *extra)


# ---- the mapping vs float64 ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("label,tokens", [("silu E8 k2 H96 I64", 7), ("silu E6 k3 H40 I24", 33),
                                          ("ep2 rank1 E8 k2", 7), ("ep3 rank0 round_robin E7 k3", 5),
                                          ("k=E E4 k4", 1)])
def test_gated_mlp_moe_vs_float64(modules, label, tokens, dtype):
    case, layer = build(label, dtype)
    x, w, ids = routed_inputs(layer, case, tokens, dtype, generator=gen(label, tokens))
    if tokens > 1:
        ids[1, 0] = -1  # "no expert": adds nothing
    kernel = ipex_moe.bind(None, modules)
    args = op_args(layer, x, w, ids)
    assert kernel.supports(*args)
    out = kernel.run(*args)
    assert out.dtype == dtype and out.shape == x.shape
    ref.assert_layer(label, out, ref.experts(layer, x, w, ids), dtype)


@pytest.mark.parametrize("num_local,n_ids,top_k", [(4, 8, 2), (3, 7, 3), (4, 4, 4), (6, 6, 1), (5, 12, 4)])
def test_local_routing_names_each_expert_once_per_token(num_local, n_ids, top_k):
    """IPEX's CPU kernel races on a token listed twice for one expert (a bf16 row came back zero),
    so the routing it gets names each local expert at most once per token and keeps, per expert, the
    op's total weight: random ids with repeats, -1, out-of-range ids and other ranks' experts."""
    g = gen("local routing", num_local, n_ids, top_k)
    tokens = 200
    ids = torch.randint(-1, n_ids + 2, (tokens, top_k), generator=g, dtype=torch.int32)
    ids[::3, -1] = ids[::3, 0]  # repeats within a token
    weights = torch.rand(tokens, top_k, generator=g)
    expert_map = torch.full((n_ids,), -1, dtype=torch.int32)
    expert_map[torch.randperm(n_ids, generator=g)[:num_local]] = torch.arange(num_local, dtype=torch.int32)
    for mapping in (expert_map, None if n_ids == num_local else expert_map):
        got_w, got_ids = ipex_moe.local_routing(weights, ids, mapping, num_local)
        assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32
        assert ((got_ids >= 0) & (got_ids < num_local)).all()
        assert (got_ids.sort(1).values.diff(dim=1) > 0).all(), "a token names one expert twice"
        local = ids.long() if mapping is None else mapping.long()[ids.long().clamp(0, n_ids - 1)]
        local = torch.where((ids >= 0) & (ids < n_ids), local, -1)
        want = torch.zeros(tokens, num_local + 1).scatter_add_(1, torch.where(local >= 0, local, num_local),
                                                               weights)[:, :num_local]
        got = torch.zeros(tokens, num_local).scatter_add_(1, got_ids, got_w)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_repeated_experts_in_a_token(modules):
    """An expert named twice by one token counts twice, as in the op (the weights summed)."""
    label = "silu E6 k3 H40 I24"
    case, layer = build(label, torch.bfloat16)
    x, w, ids = routed_inputs(layer, case, 9, torch.bfloat16, generator=gen(label, "repeats"))
    ids[:, 2] = ids[:, 0]
    ids[4, 1] = ids[4, 0]
    out = ipex_moe.bind(None, modules).run(*op_args(layer, x, w, ids))
    ref.assert_layer("repeated experts", out, ref.experts(layer, x, w, ids), torch.bfloat16)


def test_more_slots_than_local_experts_is_handed_on():
    """A token's slots must fit in distinct local experts: top_k 3 over 2 local experts cannot."""
    case, layer = build("silu E6 k3 H40 I24", torch.float32)
    x, w, ids = routed_inputs(layer, case, 3, torch.float32, generator=gen("k over local"))
    args = list(op_args(layer, x, w, ids))
    args[1], args[2] = args[1][:2], args[2][:2]
    args[5] = torch.tensor([0, 1, -1, -1, -1, -1], dtype=torch.int32)  # expert_map: 2 of 6 local
    assert not ipex_moe.supports(*args)


def test_no_tokens(modules):
    _, layer = build("silu E6 k3 H40 I24", torch.float32)
    out = ipex_moe.bind(None, modules).run(*op_args(layer, torch.zeros(0, 40), torch.zeros(0, 3),
                                                    torch.zeros(0, 3, dtype=torch.int32)))
    assert out.shape == (0, 40)


@pytest.mark.parametrize("label", ["gelu E4 k1 H36 I20 sigmoid", "swigluoai E4 k2 H64 I48 bias",
                                   "swigluoai_uninterleave E4 k2 H48 I40", "silu limit E4 k2 H32 I32",
                                   "on-input E5 k1 H64 I32"])
def test_hands_on_what_it_cannot_compute(label):
    """GatedMLPMOE computes silu(gate) * up without a limit, biases or the weight on the input."""
    case, layer = build(label, torch.float32)
    x, w, ids = routed_inputs(layer, case, 3, torch.float32, generator=gen(label))
    assert not ipex_moe.supports(*op_args(layer, x, w, ids))


def test_weights_made_under_inference_mode(modules):
    """Inference tensors keep no version counter; the module cache takes them all the same."""
    with torch.inference_mode():
        case, layer = build("silu E6 k3 H40 I24", torch.bfloat16)
        x, w, ids = routed_inputs(layer, case, 7, torch.bfloat16, generator=gen("inference"))
        out = ipex_moe.bind(None, modules).run(*op_args(layer, x, w, ids))
    ref.assert_layer("inference mode", out, ref.experts(layer, x, w, ids), torch.bfloat16)


def test_builds_without_gated_mlp_moe_bind_nothing():
    assert ipex_moe.bind(None, None) is None and ipex_moe.bind(None, SimpleNamespace()) is None


def test_module_is_built_once_per_weight_pair():
    """Built once per (w13, w2); rebuilt when a weight is written in place; dropped with the weights."""
    kernel = ipex_moe.bind(None, SimpleNamespace(GatedMLPMOE=FakeGatedMLPMOE))
    case, layer = build("silu E6 k3 H40 I24", torch.float32)
    x, w, ids = routed_inputs(layer, case, 3, torch.float32, generator=gen("cache"))
    before = FakeGatedMLPMOE.built
    args = op_args(layer, x, w, ids)
    kernel.run(*args)
    kernel.run(*args)
    assert FakeGatedMLPMOE.built == before + 1
    with torch.no_grad():
        layer.w2_weight.mul_(2.0)  # in place: the version changes
    out = kernel.run(*op_args(layer, x, w, ids))
    assert FakeGatedMLPMOE.built == before + 2
    ref.assert_layer("after an in-place update", out, ref.experts(layer, x, w, ids), torch.float32)
    w13 = weakref.ref(layer.w13_weight)
    del layer, args
    gc.collect()
    assert w13() is None, "the cache kept the weights alive"


# ---- the chain and forward_xpu -------------------------------------------------------------------


@pytest.fixture
def xpu_build_with_moe(monkeypatch, restore_chain):
    build_ = fake_ipex.xpu_build()
    build_.llm.modules = SimpleNamespace(GatedMLPMOE=FakeGatedMLPMOE)
    monkeypatch.setattr(chain, "import_ipex", lambda: build_)
    return build_


class RunOnXpu(TorchDispatchMode):
    """Sends the named ``customop::`` ops on CPU tensors to their XPU kernel, as XPU tensors would."""

    def __init__(self, *names: str) -> None:
        super().__init__()
        self.names = names

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "customop" and func.__name__.split(".")[0] in self.names:
            return func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.XPU), *args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def test_chain_chooses_ipex(xpu_build_with_moe, monkeypatch):
    resolution = chain.install(env())
    choice = resolution.choices["customop::fused_experts"]
    assert (choice.provider, choice.fallback) == ("ipex", "eager")
    assert "ipex.llm.modules.GatedMLPMOE" in chain.describe()
    seen = []
    monkeypatch.setattr(FakeGatedMLPMOE, "forward", lambda self, *a, _f=FakeGatedMLPMOE.forward, **k:
                        seen.append("GatedMLPMOE") or _f(self, *a, **k))
    for label in ("silu E8 k2 H96 I64", "swigluoai E4 k2 H64 I48 bias"):  # IPEX; the next provider
        case, layer = build(label, torch.bfloat16)
        x, w, ids = routed_inputs(layer, case, 5, torch.bfloat16, generator=gen(label, "chain"))
        ref.assert_layer(label, xpu_kernel("fused_experts", *op_args(layer, x, w, ids)),
                         ref.experts(layer, x, w, ids), torch.bfloat16)
    assert seen == ["GatedMLPMOE"]


@pytest.mark.parametrize("label", ["silu E8 k2 H96 I64", "grouped E8 k2 g4 tg2 bias x2.5"])
def test_fused_moe_forward_xpu_end_to_end(xpu_build_with_moe, label):
    """FusedMoE built on the XPU platform: routing by the routing ops (their reference here), the
    experts by IPEX's GatedMLPMOE (the stand-in) through the op's XPU kernel."""
    chain.install(env())
    with forced_platform("xpu"):
        case, layer = build(label, torch.float16)
    assert layer.forward_method_name == "forward_xpu"
    x, logits = case.inputs(7, torch.float16, generator=gen(label, "e2e"))
    before = FakeGatedMLPMOE.built
    with RunOnXpu("fused_experts"), torch.no_grad():
        out = layer(x, logits)
    assert FakeGatedMLPMOE.built == before + 1
    ref.assert_layer(label, out, ref.layer_output(layer, x, logits), torch.float16)


def test_triton_takes_what_ipex_cannot(xpu_build_with_moe, monkeypatch):
    """With Triton on XPU, calls GatedMLPMOE cannot compute go to the shared Triton launcher
    (recording stand-ins here: the real launchers run in the main tier's Triton tests)."""
    seen: list[str] = []
    bodies = chain.library_bodies()

    def launcher(op):
        return lambda *args: seen.append(op) or bodies[op](*args)

    monkeypatch.setattr(chain, "triton_kernels", lambda: {op: launcher(op) for op in bodies})
    choice = chain.install(env(triton_xpu=True, triton_reason="test")).choices["customop::fused_experts"]
    assert (choice.provider, choice.fallback) == ("ipex", "triton")
    for label in ("silu E6 k3 H40 I24", "gelu E4 k1 H36 I20 sigmoid"):
        case, layer = build(label, torch.float32)
        x, w, ids = routed_inputs(layer, case, 3, torch.float32, generator=gen(label, "triton"))
        ref.assert_layer(label, xpu_kernel("fused_experts", *op_args(layer, x, w, ids)),
                         ref.experts(layer, x, w, ids), torch.float32)
    assert seen == ["customop::fused_experts"]  # the gelu layer only


# ---- forward_cpu's experts under this tier's torch ------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("label", ["silu E8 k2 H96 I64", "ep2 rank1 E8 k2", "k=E E4 k4", "silu E64 k8 H40 I24"])
def test_cpu_experts_on_this_torch(label, dtype):
    """forward_cpu's experts run on every torch customop takes: torch 2.8 (this tier's) has no CPU
    ``_grouped_mm``, so the grouped forms give way to the per-expert loop there."""
    case, layer = build(label, dtype)
    for tokens in (1, 7, 64):
        x, w, ids = routed_inputs(layer, case, tokens, dtype, generator=gen(label, tokens, "cpu"))
        if not moe_cpu.GROUPED_MM_ON_CPU:  # (AVX2 CPUs: the spec from SPEC_FROM_SLOTS_PER_EXPERT)
            spec_from = moe_cpu.SPEC_FROM_SLOTS_PER_EXPERT.get(dtype)
            spec = spec_from is not None and tokens * case.top_k >= spec_from * layer.w2_weight.shape[0]
            assert moe_cpu.choice(x, layer.w2_weight, case.top_k) == ("spec" if spec else "per_expert")
        ref.assert_layer(f"{label} T={tokens}", moe_cpu.fused_experts(*op_args(layer, x, w, ids)),
                         ref.experts(layer, x, w, ids), dtype)
