"""The MoE family's case table: what every tier runs, and ``customop check`` too.

- ``ROUTING``: router variants (``fused_topk``, ``grouped_topk``) with constructor arguments, the
  number of experts, whether a correction bias is passed and whether the logits hold ties.
- ``LAYERS``: ``FusedMoE`` variants: experts, top_k, hidden and intermediate sizes (non-multiples
  of 16 among them) and constructor arguments (activation, bias, expert map, routing).
- ``TOKENS``: token counts per tier: ``"check"`` (``customop check``, ``assert_conforms``),
  ``"small"`` (the paths emulated on a CPU, including 0 tokens), ``"real"`` (the GPU tier); a
  layer case may replace a tier's counts (``LayerCase.tokens``, read through ``tier_tokens``).
- ``REAL_LAYERS``: Mixtral-8x7B and Qwen3-30B-A3B, for the GPU tier.

Inputs are fresh random values with margins: routing logits are a random permutation of a grid
plus noise below its step, so that the top-k differs from the next candidate by far
more than fp32 rounding and every path must pick the same experts; the tie cases put whole
runs of equal logits instead. Weights are scaled so outputs stay O(1).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from customop.custom_op import CustomOp
from customop.ops import moe as _ops  # noqa: F401  (registers the op classes)
from customop.testing import FLOAT_DTYPES, Sample, assert_close, randn, register_samples, tolerance

DTYPES = FLOAT_DTYPES


def routing_logits(tokens: int, num_experts: int, dtype: torch.dtype, device: Any = "cpu",
                   generator: torch.Generator | None = None, ties: bool = False) -> torch.Tensor:
    """``[tokens, E]`` logits in about [-1, 1], distinct by at least ``1.2 / E`` (a permuted grid
    plus noise), or with ties: a coarse grid of 3 values, so most rows repeat their best value."""
    if ties:
        return (torch.randint(0, 3, (tokens, num_experts), generator=generator).float() - 1.0).to(device, dtype)
    grid = torch.argsort(torch.rand(tokens, num_experts, generator=generator), dim=-1).float()
    noise = torch.rand(tokens, num_experts, generator=generator) * 0.4
    # spans about [-1, 1]; in bf16 some neighbours round to one value: exact ties, which every
    # path breaks the same way (to the lower id); fp32 scores of distinct bf16 logits stay far apart
    return ((grid + noise - num_experts / 2) * (2.0 / num_experts)).to(device, dtype)


def correction_bias(num_experts: int, groups: int = 1, device: Any = "cpu",
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """A bias that reorders experts without near-ties: scores lie in (0, 1), so two candidates
    differ by a multiple of the bias step plus a score difference. One group: a grid of 4 per
    expert. Several: 16 x a permutation of the groups plus 2 x {0, 1} per expert, so group scores
    (sums of two) stay at least 10 apart; that the group score is a sum of two, not the best one,
    is tested with hand-made logits (tests/ops/test_moe_routing.py)."""
    if groups == 1:
        return (torch.randint(0, 3, (num_experts,), generator=generator).float() * 4.0).to(device)
    group_of = torch.arange(num_experts) // (num_experts // groups)
    rank = torch.argsort(torch.rand(groups, generator=generator)).float()
    return (16.0 * rank[group_of] + 2.0 * torch.randint(0, 2, (num_experts,), generator=generator)).to(device)


@dataclasses.dataclass(frozen=True)
class RoutingCase:
    label: str
    op: str
    init: dict[str, Any]
    num_experts: int
    bias: bool = False
    ties: bool = False

    @property
    def op_class(self) -> type[CustomOp]:
        return CustomOp.op_registry[self.op]

    def build(self, **kwargs: Any) -> CustomOp:
        return self.op_class(**self.init, **kwargs)

    def inputs(self, tokens: int, dtype: torch.dtype, device: Any = "cpu",
               generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(hidden_states [T, 8], gating_output [T, E], bias [E] or None)."""
        hidden = randn(tokens, 8, dtype=dtype, device=device, generator=generator)
        logits = routing_logits(tokens, self.num_experts, dtype, device, generator, self.ties)
        groups = self.init.get("num_expert_group", 1)
        return hidden, logits, correction_bias(self.num_experts, groups, device, generator) if self.bias else None


def _grouped(topk, renorm, groups, topk_group, scoring="sigmoid", scale=1.0) -> dict[str, Any]:
    return dict(topk=topk, renormalize=renorm, num_expert_group=groups, topk_group=topk_group, scoring_func=scoring,
                routed_scaling_factor=scale)


ROUTING = (
    RoutingCase("topk softmax renorm E8 k2", "fused_topk", dict(topk=2, renormalize=True), 8),
    RoutingCase("topk softmax E64 k6", "fused_topk", dict(topk=6, renormalize=False), 64),
    RoutingCase("topk sigmoid renorm E16 k4", "fused_topk", dict(topk=4, renormalize=True, scoring_func="sigmoid"), 16),
    RoutingCase("topk sigmoid E60 k4", "fused_topk", dict(topk=4, renormalize=False, scoring_func="sigmoid"), 60),
    RoutingCase("topk biased sigmoid E32 k4 x2.5", "fused_topk",
                dict(topk=4, renormalize=True, scoring_func="sigmoid", routed_scaling_factor=2.5), 32, bias=True),
    RoutingCase("topk biased softmax E16 k2", "fused_topk", dict(topk=2, renormalize=False), 16, bias=True),
    RoutingCase("topk k=E E6", "fused_topk", dict(topk=6, renormalize=True), 6),
    RoutingCase("topk E1", "fused_topk", dict(topk=1, renormalize=False), 1),
    RoutingCase("topk ties softmax E16 k4", "fused_topk", dict(topk=4, renormalize=True), 16, ties=True),
    RoutingCase("topk ties sigmoid E8 k3", "fused_topk", dict(topk=3, renormalize=False, scoring_func="sigmoid"), 8,
                ties=True),
    RoutingCase("grouped V3 E256 g8 tg4 k8", "grouped_topk", _grouped(8, True, 8, 4, scale=2.5), 256, bias=True),
    RoutingCase("grouped V2 softmax E64 g8 tg3 k6", "grouped_topk", _grouped(6, False, 8, 3, "softmax", 16.0), 64),
    RoutingCase("grouped all groups E16 g4 tg4 k3", "grouped_topk", _grouped(3, True, 4, 4, "softmax"), 16, bias=True),
    RoutingCase("grouped tg1 E12 g3 k2", "grouped_topk", _grouped(2, True, 3, 1), 12),
    RoutingCase("grouped ties E32 g4 tg2 k4", "grouped_topk", _grouped(4, True, 4, 2, "softmax"), 32, ties=True),
)
ROUTING_BY_LABEL = {c.label: c for c in ROUTING}


@dataclasses.dataclass(frozen=True)
class LayerCase:
    label: str
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    init: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: this case's token counts per tier where they differ from ``TOKENS`` (``tier_tokens``)
    tokens: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    def tier_tokens(self, tier: str) -> tuple[int, ...]:
        return self.tokens.get(tier, TOKENS[tier])

    def build(self, dtype: torch.dtype, **kwargs: Any) -> CustomOp:
        """The layer with uninitialised weights (``weights`` gives values)."""
        return CustomOp.op_registry["fused_moe"](
            num_experts=self.num_experts, top_k=self.top_k, hidden_size=self.hidden,
            intermediate_size=self.intermediate, params_dtype=dtype, **self.init, **kwargs)

    def weights(self, layer, device: Any = "cpu", generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """Random weights for ``layer`` (its local shapes), scaled so each GEMM keeps O(1) values."""
        dtype = layer.w13_weight.dtype
        state = {"w13_weight": randn(*layer.w13_weight.shape, dtype=dtype, device=device, generator=generator,
                                     scale=self.hidden ** -0.5),
                 "w2_weight": randn(*layer.w2_weight.shape, dtype=dtype, device=device, generator=generator,
                                    scale=layer.intermediate_size_per_partition ** -0.5)}
        if layer.has_bias:
            state["w13_bias"] = randn(*layer.w13_bias.shape, dtype=dtype, device=device, generator=generator, scale=0.5)
            state["w2_bias"] = randn(*layer.w2_bias.shape, dtype=dtype, device=device, generator=generator, scale=0.5)
        return state

    def inputs(self, tokens: int, dtype: torch.dtype, device: Any = "cpu",
               generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden_states [T, H], router_logits [T, E] in fp32)."""
        x = randn(tokens, self.hidden, dtype=dtype, device=device, generator=generator)
        return x, routing_logits(tokens, self.num_experts, torch.float32, device, generator)


def _bias(n: int, groups: int = 1) -> torch.Tensor:
    return correction_bias(n, groups, generator=torch.Generator().manual_seed(n))


LAYERS = (
    LayerCase("silu E8 k2 H96 I64", 8, 2, 96, 64),
    LayerCase("silu E6 k3 H40 I24", 6, 3, 40, 24),
    LayerCase("gelu E4 k1 H36 I20 sigmoid", 4, 1, 36, 20, dict(activation="gelu", scoring_func="sigmoid",
                                                                renormalize=False)),
    LayerCase("gelu_tanh E5 k2 H48 I33", 5, 2, 48, 33, dict(activation="gelu_tanh")),
    LayerCase("swigluoai E4 k2 H64 I48 bias", 4, 2, 64, 48, dict(activation="swigluoai", has_bias=True)),
    LayerCase("swigluoai_uninterleave E4 k2 H48 I40", 4, 2, 48, 40,
              dict(activation="swigluoai_uninterleave", swiglu_limit=7.0, swiglu_alpha=1.702, swiglu_beta=1.0)),
    LayerCase("silu limit E4 k2 H32 I32", 4, 2, 32, 32, dict(swiglu_limit=1.0)),
    LayerCase("on-input E5 k1 H64 I32", 5, 1, 64, 32, dict(apply_router_weight_on_input=True, renormalize=False,
                                                           scoring_func="sigmoid")),
    LayerCase("grouped E8 k2 g4 tg2 bias x2.5", 8, 2, 48, 32,
              dict(use_grouped_topk=True, num_expert_group=4, topk_group=2, scoring_func="sigmoid",
                   routed_scaling_factor=2.5, e_score_correction_bias=_bias(8, 4))),
    LayerCase("scale to output E8 k2 x2", 8, 2, 48, 32,
              dict(routed_scaling_factor=2.0, apply_routed_scale_to_output=True, e_score_correction_bias=_bias(8))),
    LayerCase("ep2 rank1 E8 k2", 8, 2, 64, 48, dict(ep_size=2, ep_rank=1)),
    LayerCase("ep3 rank0 round_robin E7 k3", 7, 3, 40, 24, dict(ep_size=3, ep_rank=0, expert_placement="round_robin")),
    LayerCase("k=E E4 k4", 4, 4, 32, 40),
    # many experts, k8 (Qwen3-MoE's routing on small sizes): 64 and 300 tokens leave some experts
    # empty and give others many rows; the interpreter tier runs it at 33 tokens only
    LayerCase("silu E64 k8 H40 I24", 64, 8, 40, 24, tokens={"small": (0, 1, 7, 64, 300)}),
)
LAYERS_BY_LABEL = {c.label: c for c in LAYERS}

#: the GPU tier's model shapes (bf16), and their token counts
REAL_LAYERS = (
    LayerCase("mixtral-8x7b", 8, 2, 4096, 14336),
    LayerCase("qwen3-30b-a3b", 128, 8, 2048, 768),
)
TOKENS = {"check": (1, 5), "small": (0, 1, 7, 33), "real": (1, 16, 256, 4096)}


# ---- customop check / assert_conforms -----------------------------------------------------------


def moe_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) between two paths of the layer (or a path and float64): each rounds the
    gate/up result and the activation to the dtype at different points (fused or not, before or
    after the router weight), a few ulps of O(1) values; fp32 GEMM orders differ by ~1e-6."""
    atol, rtol = tolerance(dtype)
    return (4 * atol, 2 * rtol) if dtype != torch.float32 else (2e-5, 2e-5)


def compare_layer(got: Any, want: Any, dtype: torch.dtype) -> None:
    atol, rtol = moe_tolerance(dtype)
    assert_close(got, want, dtype, atol=atol, rtol=rtol, what="fused_moe")


def _routing_builder(op: str):
    def build(dtype: torch.dtype, device: str, gen: torch.Generator) -> list[Sample]:
        out = []
        for case in (c for c in ROUTING if c.op == op):
            for tokens in TOKENS["check"]:
                hidden, logits, bias = case.inputs(tokens, dtype, device, gen)
                out.append(Sample(dict(case.init), (hidden, logits), {"e_score_correction_bias": bias} if case.bias else {},
                                  label=f"{case.label} T{tokens}"))
        return out

    return build


for _op in ("fused_topk", "grouped_topk"):
    register_samples(_op, DTYPES)(_routing_builder(_op))


@register_samples("fused_moe", DTYPES)
def _layers(dtype: torch.dtype, device: str, gen: torch.Generator) -> list[Sample]:
    out = []
    for case in LAYERS:
        layer = case.build(dtype)  # for the local weight shapes only
        state = case.weights(layer, device, gen)
        init = dict(num_experts=case.num_experts, top_k=case.top_k, hidden_size=case.hidden,
                    intermediate_size=case.intermediate, params_dtype=dtype, **case.init)
        for tokens in TOKENS["check"]:
            out.append(Sample(init, case.inputs(tokens, dtype, device, gen), state=state, compare=compare_layer,
                              label=f"{case.label} T{tokens}"))
    return out


# ---- vLLM 0.33's other names: the experts with the routing given, the gate, the methods -----------

#: the cases the routing-given ops run (a gated bias case, an expert map, the input weight)
GIVEN = ("silu E6 k3 H40 I24", "swigluoai E4 k2 H64 I48 bias", "ep2 rank1 E8 k2", "on-input E5 k1 H64 I32")


def routed_inputs(layer, case: LayerCase, tokens: int, dtype: torch.dtype, device: Any = "cpu",
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden_states, fp32 topk_weights, int32 topk_ids) routed by the layer's own router."""
    x, logits = case.inputs(tokens, dtype, device, generator)
    w, ids = layer.select_experts(x, logits)
    return x, w, ids


def _given_samples(op: str):
    def build(dtype: torch.dtype, device: str, gen: torch.Generator) -> list[Sample]:
        out = []
        for label in GIVEN:
            case = LAYERS_BY_LABEL[label]
            layer = case.build(dtype).to(device)
            state = case.weights(layer, device, gen)
            with torch.no_grad():
                for name, value in state.items():
                    getattr(layer, name).copy_(value)
            x, w, ids = routed_inputs(layer, case, 5, dtype, device, gen)
            if op in ("routed_experts", "transformers_fused_moe"):
                init = dict(num_experts=case.num_experts, top_k=case.top_k, hidden_size=case.hidden,
                            intermediate_size=case.intermediate, params_dtype=dtype, **case.init)
                if op == "transformers_fused_moe" and (case.init or label.startswith("swiglu")):
                    continue  # HF experts: plain gated silu without bias or expert map
                args = (x, w, ids) if op == "routed_experts" else (x, ids, w)
                out.append(Sample(init, args, state=state, compare=compare_layer, label=f"{label} T5"))
            else:  # the methods take the layer
                out.append(Sample({}, (layer, x, w, ids), compare=compare_layer, label=f"{label} T5"))
        return out

    return build


for _op in ("routed_experts", "transformers_fused_moe", "unquantized_fused_moe", "modular_fused_moe"):
    register_samples(_op, DTYPES)(_given_samples(_op))


@register_samples("gate_linear", DTYPES)
def _gate(dtype: torch.dtype, device: str, gen: torch.Generator) -> list[Sample]:
    out = []
    for hidden, experts, out_dtype in ((64, 8, None), (96, 16, torch.float32)):
        state = {"weight": randn(experts, hidden, dtype=dtype, device=device, generator=gen, scale=hidden ** -0.5)}
        x = randn(5, hidden, dtype=dtype, device=device, generator=gen)
        out.append(Sample({"input_size": hidden, "output_size": experts, "params_dtype": dtype, "out_dtype": out_dtype},
                          (x,), state=state, label=f"gate_linear {hidden}->{experts} out_dtype={out_dtype}"))
    return out
