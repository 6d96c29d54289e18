"""vLLM 0.33's other MoE names (``customop/ops/moe/modular.py``, ``transformers.py``):
``RoutedExperts``, ``UnquantizedFusedMoEMethod`` and ``FusedMoEModularMethod`` on every path
against the float64 reference (``tests/cases/moe.py``), a vendor's experts swapped into the
modular method, ``GateLinear``, and ``TransformersMoERunner`` against Hugging Face's own Mixtral
and Qwen3-MoE blocks (when transformers is installed)."""

from __future__ import annotations

import zlib

import pytest
import torch

from customop import Config, use_config
from customop.ops import moe
from customop.samples.moe import DTYPES, GIVEN, LAYERS_BY_LABEL, routed_inputs
from customop.testing import assert_conforms
from tests.cases import moe as ref

PATHS = ("forward_native", "forward_cpu", "forward_kernel")


def gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def build(cls, case, dtype, g, **kwargs):
    with use_config(Config(custom_ops=["all"])):
        layer = cls(num_experts=case.num_experts, top_k=case.top_k, hidden_size=case.hidden,
                    intermediate_size=case.intermediate, params_dtype=dtype, **case.init, **kwargs)
    with torch.no_grad():
        for name, value in case.weights(layer, generator=g).items():
            getattr(layer, name).copy_(value)
    return layer


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("label", GIVEN)
def test_routed_experts_and_the_methods_match_reference(label, dtype, poison_empty):
    case = LAYERS_BY_LABEL[label]
    g = gen(label, str(dtype))
    layer = build(moe.RoutedExperts, case, dtype, g)
    x, w, ids = routed_inputs(layer, case, 7, dtype, generator=g)
    expected = ref.experts(layer, x, w, ids)
    with use_config(Config(custom_ops=["all"])):
        methods = (moe.UnquantizedFusedMoEMethod(), moe.FusedMoEModularMethod())
    with torch.no_grad():
        for path in PATHS:
            ref.assert_layer(f"routed_experts {path}", getattr(layer, path)(x, w, ids), expected, dtype)
            for method in methods:
                ref.assert_layer(f"{method.name} {path}", getattr(method, path)(layer, x, w, ids), expected, dtype)


class PerSlotExperts(moe.MoEExperts):
    """A vendor's experts that leave the weighting and the sum to finalize: one unweighted row
    per slot, in float64 (so a result that matches proves finalize weighted and summed)."""

    weights_and_reduces = False

    def __init__(self):
        super().__init__()
        self.calls = 0

    def apply(self, layer, hidden_states, topk_weights, topk_ids):
        self.calls += 1
        t, k = topk_ids.shape
        rows = torch.stack([ref.experts(layer, hidden_states, torch.ones(t, 1), topk_ids[:, j:j + 1]) for j in range(k)], 1)
        return rows.to(hidden_states.dtype)


@pytest.mark.parametrize("label", ["silu E6 k3 H40 I24", "on-input E5 k1 H64 I32"])
def test_modular_method_runs_a_replaced_experts_part_on_every_path(label):
    case = LAYERS_BY_LABEL[label]
    g = gen("vendor", label)
    layer = build(moe.FusedMoE, case, torch.float32, g)
    x, w, ids = routed_inputs(layer, case, 5, torch.float32, generator=g)
    vendor = PerSlotExperts()
    with use_config(Config(custom_ops=["all"])):
        method = moe.FusedMoEModularMethod(experts=vendor)
    for path in PATHS:
        ref.assert_layer(path, getattr(method, path)(layer, x, w, ids), ref.experts(layer, x, w, ids), torch.float32)
    assert vendor.calls == len(PATHS)


def test_unquantized_method_creates_weights_and_returns_shared_output():
    layer = torch.nn.Module()
    with use_config(Config(custom_ops=["all"])):
        method = moe.UnquantizedFusedMoEMethod()
    method.create_weights(layer, 4, 32, 16, torch.float32, weight_loader=print, has_bias=True)
    assert layer.w13_weight.shape == (4, 32, 32) and layer.w2_weight.shape == (4, 32, 16)
    assert layer.w13_bias.shape == (4, 32) and layer.w2_weight.weight_loader is print
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.2)
    x = torch.randn(3, 32)
    w, ids = torch.rand(3, 2), torch.randint(0, 4, (3, 2), dtype=torch.int32)
    shared = torch.nn.Linear(32, 32)
    shared_out, routed = method.apply(layer, x, w, ids, shared_experts=shared)
    torch.testing.assert_close(shared_out, shared(x))
    # what the reference reads (the method itself took the defaults: silu, no map, weight on output)
    layer.activation, layer.expert_map, layer.apply_router_weight_on_input = "silu", None, False
    layer.hidden_size, layer.alpha, layer.limit, layer.beta = 32, 1.0, float("inf"), 0.0
    ref.assert_layer("unquantized", routed, ref.experts(layer, x, w, ids), torch.float32)


def test_gate_linear_out_dtype():
    with use_config(Config(custom_ops=["all"])):
        gate = moe.GateLinear(64, 8, params_dtype=torch.bfloat16, out_dtype=torch.float32)
        fp32 = moe.GateLinear(64, 8, params_dtype=torch.bfloat16, force_fp32_compute=True)
    with torch.no_grad():
        gate.weight.normal_()
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    for path in ("forward_native", "forward_cpu"):
        logits, bias = getattr(gate, path)(x)
        assert logits.dtype == torch.float32 and bias is None
        torch.testing.assert_close(logits, (x @ gate.weight.t()).float())
    assert fp32.weight.dtype == torch.float32 and gate.bias is None
    with pytest.raises(ValueError, match="already"):
        gate.set_out_dtype(torch.float32)


# (the two methods' paths are all checked above; customop check runs their samples too)
@pytest.mark.parametrize("op", ["routed_experts", "gate_linear", "transformers_fused_moe"])
def test_conforms(op):
    from customop.custom_op import CustomOp

    assert_conforms(CustomOp.op_registry[op])


# ---- Hugging Face blocks ------------------------------------------------------------------------


def _hf_block(arch: str, dtype: torch.dtype):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install customop[hf])")
    torch.manual_seed(0)
    if arch == "mixtral":
        config = transformers.MixtralConfig(hidden_size=48, intermediate_size=40, num_local_experts=6,
                                            num_experts_per_tok=2)
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
    else:
        config = transformers.Qwen3MoeConfig(hidden_size=48, moe_intermediate_size=24, num_experts=8,
                                             num_experts_per_tok=3, norm_topk_prob=True)
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
    block = Block(config).to(dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.15)
    return block, config


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_transformers_runner_matches_the_hf_block(arch, dtype):
    block, config = _hf_block(arch, dtype)
    x = torch.randn(2, 7, config.hidden_size, generator=gen(arch)).to(dtype)
    with torch.no_grad():
        want = block(x)
        want = want[0] if isinstance(want, tuple) else want
        hf_experts = block.experts
        for path in PATHS:
            with use_config(Config(custom_ops=["all"])):
                runner = moe.TransformersMoERunner.from_hf(hf_experts, config)
            runner._forward_method = getattr(runner, path)
            block.experts = runner
            got = block(x)
            got = got[0] if isinstance(got, tuple) else got
            ref.assert_layer(f"{arch} {path}", got.reshape(-1, config.hidden_size), want.reshape(-1, config.hidden_size).double(), dtype)
        block.experts = hf_experts


def test_transformers_runner_refuses_other_experts():
    with pytest.raises(NotImplementedError, match="gate_up_proj"):
        moe.TransformersMoERunner.from_hf(torch.nn.Linear(4, 4))
