"""MoE routing: ``FusedTopK`` (``fused_topk``: softmax or sigmoid top-k, optionally biased) and
``GroupedTopk`` (``grouped_topk``: DeepSeek-V2/V3), plus vLLM's function forms ``fused_topk``,
``fused_topk_bias`` and ``grouped_topk``. Every path returns fp32 weights and int32 ids
``[T, top_k]``; the math is ``customop/math/moe.py`` (scores in fp32, ties to the lower id).

Paths: ``forward_native`` and ``forward_cpu`` run the spec (routing is a few small kernels: a
compiled call's ~20 us floor is more than the eager op at every size measured,
benchmarks/results/cpu_moe.md); the accelerators call ``torch.ops.customop.fused_topk`` /
``grouped_topk`` (one Triton kernel each on CUDA, ROCm and XPU tensors).
"""

from __future__ import annotations

from typing import Any

import torch

from customop.custom_op import CustomOp
from customop.math import moe as _math


def check_logits(op: str, gating_output: Any, topk: int, hidden_states: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> int:
    """``gating_output`` is a float ``[T, E]`` tensor, ``1 <= topk <= E``, the bias a float ``[E]``
    on its device; returns E. Every path calls this, so a bad input fails the same way."""
    if not isinstance(gating_output, torch.Tensor) or not gating_output.is_floating_point():
        what = gating_output.dtype if isinstance(gating_output, torch.Tensor) else type(gating_output).__name__
        raise TypeError(f"customop {op}: gating_output must be a floating-point tensor, got {what}")
    if gating_output.dim() != 2 or gating_output.shape[1] == 0:
        raise ValueError(f"customop {op}: gating_output must be [num_tokens, num_experts], "
                         f"got shape {tuple(gating_output.shape)}")
    num_experts = gating_output.shape[1]
    if not 1 <= topk <= num_experts:
        raise ValueError(f"customop {op}: top_k={topk} must be in [1, num_experts={num_experts}]")
    if hidden_states is not None and hidden_states.shape[0] != gating_output.shape[0]:
        raise ValueError(f"customop {op}: hidden_states has {hidden_states.shape[0]} tokens, "
                         f"gating_output {gating_output.shape[0]}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point() or bias.shape != (num_experts,):
            shape = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise ValueError(f"customop {op}: e_score_correction_bias must be a float [{num_experts}] tensor, "
                             f"got {shape}")
        if bias.device != gating_output.device:
            raise ValueError(f"customop {op}: e_score_correction_bias is on {bias.device}, "
                             f"gating_output on {gating_output.device}")
    return num_experts


def check_scoring(op: str, scoring_func: str) -> str:
    if scoring_func not in _math.SCORING_FUNCS:
        raise ValueError(f"customop {op}: scoring_func must be one of {_math.SCORING_FUNCS}, got {scoring_func!r}")
    return scoring_func


def check_groups(op: str, num_experts: int, topk: int, num_expert_group: int, topk_group: int) -> None:
    if num_expert_group < 1 or num_experts % num_expert_group:
        raise ValueError(f"customop {op}: num_expert_group={num_expert_group} must divide the number of "
                         f"experts ({num_experts}) into equal groups")
    if not 1 <= topk_group <= num_expert_group:
        raise ValueError(f"customop {op}: topk_group={topk_group} must be in [1, num_expert_group={num_expert_group}]")
    eligible = topk_group * (num_experts // num_expert_group)
    if topk > eligible:
        raise ValueError(f"customop {op}: top_k={topk} exceeds the {eligible} experts of the "
                         f"topk_group={topk_group} groups kept")


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.is_contiguous() else t.contiguous()


@CustomOp.register("fused_topk")
class FusedTopK(CustomOp):
    """Top-k routing over softmax (over all experts) or sigmoid (per expert) scores.

    ``forward(hidden_states, gating_output, e_score_correction_bias=None)`` returns
    ``(topk_weights fp32, topk_ids int32)``. With a bias, ``score + bias`` chooses the experts and
    the weights are the unbiased scores (vLLM's ``fused_topk_bias``). ``renormalize`` divides the
    chosen weights by their sum; ``routed_scaling_factor`` multiplies them last (vLLM's plain
    top-k router ignores the factor: the ``FusedMoE`` layer passes 1.0 there, as vLLM does)."""

    def __init__(self, topk: int, renormalize: bool, scoring_func: str = "softmax",
                 routed_scaling_factor: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.topk = int(topk)
        self.renormalize = bool(renormalize)
        self.scoring_func = check_scoring(self.name, scoring_func)
        self.routed_scaling_factor = float(routed_scaling_factor)

    def _args(self, bias):
        return (self.topk, self.renormalize, self.scoring_func, bias, self.routed_scaling_factor)

    def forward_native(self, hidden_states, gating_output, e_score_correction_bias=None):
        check_logits(self.name, gating_output, self.topk, hidden_states, e_score_correction_bias)
        return _math.fused_topk(gating_output, *self._args(e_score_correction_bias))

    forward_cpu = forward_native

    def forward_cuda(self, hidden_states, gating_output, e_score_correction_bias=None):
        return self.forward_kernel(hidden_states, gating_output, e_score_correction_bias)

    forward_xpu = forward_tpu = forward_cuda

    def forward_kernel(self, hidden_states, gating_output, e_score_correction_bias=None):
        """The ``torch.ops.customop.fused_topk`` call every accelerator shares."""
        check_logits(self.name, gating_output, self.topk, hidden_states, e_score_correction_bias)
        return torch.ops.customop.fused_topk(_contiguous(gating_output), *self._args(e_score_correction_bias))

    def extra_repr(self) -> str:
        return (f"topk={self.topk}, renormalize={self.renormalize}, scoring_func={self.scoring_func!r}, "
                f"routed_scaling_factor={self.routed_scaling_factor}")


@CustomOp.register("grouped_topk")
class GroupedTopk(CustomOp):
    """DeepSeek-V2/V3 grouped routing (vLLM's constructor and forward signatures).

    The experts form ``num_expert_group`` equal, contiguous groups; a group's score is its best
    expert's score (with ``e_score_correction_bias``: the sum of its two best biased scores); the
    ``topk_group`` best groups stay eligible and top-k runs over their experts. Weights are the
    unbiased scores, renormalised if asked, times ``routed_scaling_factor``. A group count that
    does not divide the experts raises ``ValueError`` (vLLM's router would silently route without
    groups instead)."""

    def __init__(self, topk: int, renormalize: bool, num_expert_group: int = 0, topk_group: int = 0,
                 scoring_func: str = "softmax", routed_scaling_factor: float = 1.0,
                 num_fused_shared_experts: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if num_expert_group < 1 or topk_group < 1:
            raise ValueError(f"customop grouped_topk: num_expert_group={num_expert_group} and "
                             f"topk_group={topk_group} must both be >= 1")
        if num_fused_shared_experts:
            raise NotImplementedError("customop grouped_topk: num_fused_shared_experts (ROCm AITER's shared-expert "
                                      "fusion) is not supported")
        self.topk = int(topk)
        self.renormalize = bool(renormalize)
        self.num_expert_group = int(num_expert_group)
        self.topk_group = int(topk_group)
        self.scoring_func = check_scoring(self.name, scoring_func)
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.num_fused_shared_experts = 0

    def _check(self, hidden_states, gating_output, bias) -> None:
        num_experts = check_logits(self.name, gating_output, self.topk, hidden_states, bias)
        check_groups(self.name, num_experts, self.topk, self.num_expert_group, self.topk_group)

    def _args(self):
        return (self.topk, self.renormalize, self.num_expert_group, self.topk_group, self.scoring_func,
                self.routed_scaling_factor)

    def forward_native(self, hidden_states, gating_output, e_score_correction_bias=None):
        self._check(hidden_states, gating_output, e_score_correction_bias)
        return _math.grouped_topk(gating_output, *self._args(), e_score_correction_bias)

    forward_cpu = forward_native

    def forward_cuda(self, hidden_states, gating_output, e_score_correction_bias=None):
        return self.forward_kernel(hidden_states, gating_output, e_score_correction_bias)

    forward_xpu = forward_tpu = forward_cuda

    def forward_kernel(self, hidden_states, gating_output, e_score_correction_bias=None):
        """The ``torch.ops.customop.grouped_topk`` call every accelerator shares."""
        self._check(hidden_states, gating_output, e_score_correction_bias)
        return torch.ops.customop.grouped_topk(_contiguous(gating_output), *self._args(), e_score_correction_bias)

    def extra_repr(self) -> str:
        return (f"topk={self.topk}, renormalize={self.renormalize}, num_expert_group={self.num_expert_group}, "
                f"topk_group={self.topk_group}, scoring_func={self.scoring_func!r}, "
                f"routed_scaling_factor={self.routed_scaling_factor}")


# ---- vLLM's function forms (the spec; no dispatch) ---------------------------------------------


def fused_topk(hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int, renormalize: bool,
               indices_type: torch.dtype | None = None,
               scoring_func: str = "softmax") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's ``fused_topk``: ``(topk_weights, topk_ids, token_expert_indices)``, the last being
    the source row ``k * T + t`` of each slot (a by-product some permute kernels use)."""
    check_logits("fused_topk", gating_output, topk, hidden_states)
    weights, ids = _math.fused_topk(gating_output, topk, renormalize, check_scoring("fused_topk", scoring_func))
    t = gating_output.shape[0]
    rows = (torch.arange(topk, device=ids.device, dtype=torch.int32)[None, :] * t
            + torch.arange(t, device=ids.device, dtype=torch.int32)[:, None])
    return weights, ids if indices_type is None else ids.to(indices_type), rows


def fused_topk_bias(hidden_states: torch.Tensor, gating_output: torch.Tensor, e_score_correction_bias: torch.Tensor,
                    topk: int, renormalize: bool, scoring_func: str = "softmax",
                    routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``fused_topk_bias``: the bias chooses, the unbiased scores weigh."""
    check_logits("fused_topk_bias", gating_output, topk, hidden_states, e_score_correction_bias)
    return _math.fused_topk(gating_output, topk, renormalize, check_scoring("fused_topk_bias", scoring_func),
                            e_score_correction_bias, routed_scaling_factor)


def grouped_topk(hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int, renormalize: bool,
                 num_expert_group: int = 0, topk_group: int = 0, scoring_func: str = "softmax",
                 routed_scaling_factor: float = 1.0,
                 e_score_correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``grouped_topk`` function (same arguments, same results as ``GroupedTopk``)."""
    num_experts = check_logits("grouped_topk", gating_output, topk, hidden_states, e_score_correction_bias)
    check_groups("grouped_topk", num_experts, topk, num_expert_group, topk_group)
    return _math.grouped_topk(gating_output, topk, renormalize, num_expert_group, topk_group,
                              check_scoring("grouped_topk", scoring_func), routed_scaling_factor,
                              e_score_correction_bias)
