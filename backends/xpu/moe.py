"""Gated-MLP mixture of experts for the MoE ops' ``forward_xpu``: IPEX's ``GatedMLPMOE`` where it
computes the spec, else a plain-torch reference.

The spec: route each token (``route``: softmax or sigmoid scores of ``router_logits [T, E]``, the
top ``top_k`` experts, optionally DeepSeek's grouped selection, research/op-semantics.md D.5), then
``out[t] = sum_j w[t, j] * W2[e] @ (silu(W13[e, :I] @ x[t]) * (W13[e, I:] @ x[t]))`` with
``e = ids[t, j]``. ``w13`` is ``[E, 2I, H]`` with the *gate* rows first, ``w2`` is ``[E, H, I]``
(the layout of IPEX's ``GatedMLPMOE(W13, W2)`` and of vLLM's fused MoE weights).

What IPEX 2.8's CPU build was measured to do (tests/backends/xpu/test_attention_moe.py, xpu tier):
softmax routing, with or without renormalisation, plain or grouped (no bias), matches the spec
(gate rows first confirmed: the other order is off by the output's own size); sigmoid scoring
without groups raises an AssertionError; an ``e_score_correction_bias`` gives results that differ
from D.5. Those cases run the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def route(router_logits: Tensor, top_k: int, renormalize: bool, scoring_func: str = "softmax",
          num_expert_group: int | None = None, topk_group: int | None = None,
          e_score_correction_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(weights fp32 [T, top_k], ids int64 [T, top_k])`` per D.5: scores ``s``; selection scores
    ``s + bias`` (or ``s``); with groups keep the best ``topk_group`` of ``num_expert_group`` groups
    (group score: the sum of its top two with a bias, else its max); weights are the unbiased ``s``
    at the chosen ids, renormalised to sum 1 if asked."""
    if scoring_func not in ("softmax", "sigmoid"):
        raise ValueError(f"customop xpu moe: scoring_func must be 'softmax' or 'sigmoid', got {scoring_func!r}")
    scores = torch.softmax(router_logits.float(), dim=-1) if scoring_func == "softmax" else router_logits.float().sigmoid()
    select = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    if num_expert_group:
        tokens, experts = select.shape
        groups = select.view(tokens, num_expert_group, experts // num_expert_group)
        group_score = groups.amax(-1) if e_score_correction_bias is None else groups.topk(2, dim=-1).values.sum(-1)
        kept = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, group_score.topk(topk_group, dim=-1).indices, True)
        select = select.masked_fill(~kept.repeat_interleave(experts // num_expert_group, dim=1), float("-inf"))
    ids = select.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def gated_moe_native(hidden_states: Tensor, w13: Tensor, w2: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
    """The expert MLPs for routed tokens, one expert at a time, in fp32; returns hidden's dtype."""
    inter = w13.shape[1] // 2
    x = hidden_states.float()
    out = torch.zeros_like(x)
    for expert in ids.unique().tolist():
        token, slot = (ids == expert).nonzero(as_tuple=True)
        gate_up = x[token] @ w13[expert].float().t()
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, token, (act @ w2[expert].float().t()) * weights[token, slot, None])
    return out.to(hidden_states.dtype)


class GatedMLPMoE:
    """The experts' weights, prepared once (IPEX prepacks them), then called per batch.

    ``GatedMLPMoE(w13, w2)(hidden_states [T, H], router_logits [T, E], top_k, renormalize=...)``.
    IPEX is used when the XPU backend chose IPEX and the tensors are on the XPU; ``ipex`` may be
    passed to force a given module (the xpu tier passes the CPU build, on CPU tensors)."""

    def __init__(self, w13: Tensor, w2: Tensor, *, ipex: object | None = None) -> None:
        if w13.dim() != 3 or w2.dim() != 3 or w13.shape[1] != 2 * w2.shape[2] or w13.shape[::2] != w2.shape[:2]:
            raise ValueError(f"customop xpu moe: w13 must be [E, 2I, H] and w2 [E, H, I], got "
                             f"{tuple(w13.shape)} and {tuple(w2.shape)}")
        self.w13, self.w2 = w13, w2
        if ipex is None and w13.device.type == "xpu":
            from customop.backends.xpu import chain

            ipex = chain.ipex_module()
        # IPEX prepacks (and may copy) the weights at construction: build it once, here.
        self._ipex_moe = None if ipex is None else ipex.llm.modules.GatedMLPMOE(w13, w2, use_prepack=True)

    @staticmethod
    def ipex_takes(scoring_func: str, e_score_correction_bias: Tensor | None) -> bool:
        return scoring_func == "softmax" and e_score_correction_bias is None

    def __call__(self, hidden_states: Tensor, router_logits: Tensor, top_k: int, *, renormalize: bool = True,
                 scoring_func: str = "softmax", num_expert_group: int | None = None, topk_group: int | None = None,
                 e_score_correction_bias: Tensor | None = None) -> Tensor:
        if self._ipex_moe is not None and self.ipex_takes(scoring_func, e_score_correction_bias):
            grouped = bool(num_expert_group)
            return self._ipex_moe(hidden_states, grouped, top_k, router_logits, renormalize,
                                  topk_group if grouped else None, num_expert_group if grouped else None)
        weights, ids = route(router_logits, top_k, renormalize, scoring_func, num_expert_group, topk_group,
                             e_score_correction_bias)
        return gated_moe_native(hidden_states, self.w13, self.w2, weights, ids)
