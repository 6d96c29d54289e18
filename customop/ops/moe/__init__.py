"""Mixture of experts: routing (``FusedTopK``, ``GroupedTopk``) and the experts layer
(``FusedMoE``, also built by ``FusedMoEFactory``), with vLLM's class and registered names.

One module per role: ``routing`` (the routers), ``layer`` (the layer), ``weights`` (weight
layout and ``weight_loader``), ``cpu`` (the CPU path's measured choice), ``modular`` (vLLM 0.33's
``RoutedExperts``, ``GateLinear``, ``UnquantizedFusedMoEMethod``, ``FusedMoEModularMethod``),
``transformers`` (``TransformersMoERunner`` for Hugging Face MoE blocks). The math is
``customop/math/moe.py``; docs/moe.md is the user's page.
"""

from customop.math.moe import act_and_mul, expert_map, fused_experts, moe_align_block_size
from customop.ops.moe.routing import FusedTopK, GroupedTopk, fused_topk, fused_topk_bias, grouped_topk
from customop.ops.moe.layer import FusedMoE, FusedMoEFactory
from customop.ops.moe.modular import (FusedMoEModularMethod, GateLinear, MoEExperts, MoEPrepareAndFinalize,
                                      RoutedExperts, UnquantizedFusedMoEMethod)
from customop.ops.moe.transformers import TransformersMoERunner

__all__ = [
    "FusedMoE",
    "FusedMoEFactory",
    "FusedMoEModularMethod",
    "FusedTopK",
    "GateLinear",
    "GroupedTopk",
    "MoEExperts",
    "MoEPrepareAndFinalize",
    "RoutedExperts",
    "TransformersMoERunner",
    "UnquantizedFusedMoEMethod",
    "act_and_mul",
    "expert_map",
    "fused_experts",
    "fused_topk",
    "fused_topk_bias",
    "grouped_topk",
    "moe_align_block_size",
]
