"""Kernel entry points of the MoE family: ``torch.ops.customop.{fused_topk, grouped_topk,
moe_align_block_size, fused_experts}``.

The schemas are the contract with the backends (the Triton kernels register ``cuda``/``xpu``
kernels for them); the bodies are the spec (``customop/math/moe.py``) and run on any device; the
fakes give shapes only. All four return new tensors and mutate nothing. Inputs as the op classes
pass them (``customop/ops/moe/``): ``gating_output [T, E]`` float; ``topk_ids [T, K]`` int32
(global expert ids; -1 means "no expert"); ``topk_weights [T, K]`` fp32; ``hidden_states [T, H]``
contiguous; ``w13 [E_local, 2I, H]`` and ``w2 [E_local, H, I]`` with unit last stride;
``expert_map [E]`` int32 (-1: remote) or None; biases ``[E_local, 2I]`` / ``[E_local, H]``.
The op classes validate; kernels may assume valid inputs.
"""

from __future__ import annotations

import torch

from customop.math import moe as _math

Tensor = torch.Tensor

#: Written out (not inferred) so the contract reads exactly as the backends see it.
SCHEMAS = {
    # -> (topk_weights fp32 [T, K], topk_ids int32 [T, K])
    "fused_topk": "(Tensor gating_output, int topk, bool renormalize, str scoring_func, "
                  "Tensor? e_score_correction_bias, float routed_scaling_factor) -> (Tensor, Tensor)",
    "grouped_topk": "(Tensor gating_output, int topk, bool renormalize, int num_expert_group, int topk_group, "
                    "str scoring_func, float routed_scaling_factor, Tensor? e_score_correction_bias) "
                    "-> (Tensor, Tensor)",
    # -> (sorted_token_ids int32 [capacity], expert_ids int32 [capacity / block_size],
    #     num_tokens_post_padded int32 [1]); capacity = T*K + num_experts*(block_size-1)
    "moe_align_block_size": "(Tensor topk_ids, int block_size, int num_experts, Tensor? expert_map) "
                            "-> (Tensor, Tensor, Tensor)",
    # -> [T, H] in hidden_states' dtype
    "fused_experts": "(Tensor hidden_states, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, "
                     "Tensor? expert_map, Tensor? w13_bias, Tensor? w2_bias, str activation, float alpha, "
                     "float limit, float beta, bool apply_router_weight_on_input) -> Tensor",
}


def _routing_fake(gating_output: Tensor, topk: int) -> tuple[Tensor, Tensor]:
    t = gating_output.shape[0]
    return (gating_output.new_empty((t, topk), dtype=torch.float32),
            gating_output.new_empty((t, topk), dtype=torch.int32))


@torch.library.custom_op("customop::fused_topk", mutates_args=(), schema=SCHEMAS["fused_topk"])
def fused_topk(gating_output: Tensor, topk: int, renormalize: bool, scoring_func: str,
               e_score_correction_bias: Tensor | None, routed_scaling_factor: float) -> tuple[Tensor, Tensor]:
    """Top-k of the fp32 scores (of ``scores + bias`` when a bias is given), weights from the
    unbiased scores, optionally renormalised, then scaled."""
    return _math.fused_topk(gating_output, topk, renormalize, scoring_func, e_score_correction_bias,
                            routed_scaling_factor)


@fused_topk.register_fake
def _(gating_output, topk, renormalize, scoring_func, e_score_correction_bias, routed_scaling_factor):
    return _routing_fake(gating_output, topk)


@torch.library.custom_op("customop::grouped_topk", mutates_args=(), schema=SCHEMAS["grouped_topk"])
def grouped_topk(gating_output: Tensor, topk: int, renormalize: bool, num_expert_group: int, topk_group: int,
                 scoring_func: str, routed_scaling_factor: float,
                 e_score_correction_bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """DeepSeek-V2/V3 grouped top-k (``customop.math.moe.grouped_topk``)."""
    return _math.grouped_topk(gating_output, topk, renormalize, num_expert_group, topk_group, scoring_func,
                              routed_scaling_factor, e_score_correction_bias)


@grouped_topk.register_fake
def _(gating_output, topk, renormalize, num_expert_group, topk_group, scoring_func, routed_scaling_factor,
      e_score_correction_bias):
    return _routing_fake(gating_output, topk)


@torch.library.custom_op("customop::moe_align_block_size", mutates_args=(), schema=SCHEMAS["moe_align_block_size"])
def moe_align_block_size(topk_ids: Tensor, block_size: int, num_experts: int,
                         expert_map: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Slots grouped by (local) expert and padded per expert to ``block_size``; see the math."""
    return _math.moe_align_block_size(topk_ids, block_size, num_experts, expert_map)


@moe_align_block_size.register_fake
def _(topk_ids, block_size, num_experts, expert_map):
    capacity = _math.align_capacity(topk_ids.numel(), num_experts, block_size)
    return (topk_ids.new_empty((capacity,), dtype=torch.int32),
            topk_ids.new_empty(((capacity + block_size - 1) // block_size,), dtype=torch.int32),
            topk_ids.new_empty((1,), dtype=torch.int32))


@torch.library.custom_op("customop::fused_experts", mutates_args=(), schema=SCHEMAS["fused_experts"])
def fused_experts(hidden_states: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                  expert_map: Tensor | None, w13_bias: Tensor | None, w2_bias: Tensor | None, activation: str,
                  alpha: float, limit: float, beta: float, apply_router_weight_on_input: bool) -> Tensor:
    """The routed experts' weighted sum (``customop.math.moe.fused_experts``)."""
    return _math.fused_experts(hidden_states, w13, w2, topk_weights, topk_ids, expert_map, w13_bias, w2_bias,
                               activation, alpha, limit, beta, apply_router_weight_on_input)


@fused_experts.register_fake
def _(hidden_states, w13, w2, topk_weights, topk_ids, expert_map, w13_bias, w2_bias, activation, alpha, limit,
      beta, apply_router_weight_on_input):
    return hidden_states.new_empty((hidden_states.shape[0], w2.shape[1]))
