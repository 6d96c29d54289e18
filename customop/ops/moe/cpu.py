"""The experts on the CPU: which formulation runs, by the measurement in
benchmarks/results/cpu_moe.md (``python -m benchmarks.cpu.moe``).

Candidates, all the spec's math (``customop/math/moe.py``):

- ``spec``: the loop over experts with fp32 GEMMs (every call converts each used expert's
  weights to fp32: a full extra pass over them);
- ``per_expert``: the same loop with the GEMMs in the weights' own dtype (oneDNN's bf16/fp16
  GEMMs accumulate in fp32 and round once, which is the spec's rounding of the gate/up result;
  the down projection is rounded to the input dtype before the router weight multiplies it);
- ``grouped``: ``torch._grouped_mm`` over the slots sorted by expert (no data-dependent
  shapes: what runs inside a caller's ``torch.compile``);
- ``compiled``: Inductor's compilation of ``grouped``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from customop.math import moe as _math

#: the formulation forward_cpu runs, per input dtype (measured: benchmarks/results/cpu_moe.md)
CHOICE: dict[torch.dtype, str] = {torch.bfloat16: "per_expert", torch.float16: "per_expert",
                                  torch.float32: "per_expert"}


def per_expert(x, w13, w2, topk_weights, topk_ids, expert_map=None, w13_bias=None, w2_bias=None,
               activation="silu", alpha=1.0, limit=float("inf"), beta=0.0, apply_router_weight_on_input=False):
    """The spec's loop with the GEMMs in the weights' dtype (see the module docstring)."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    ids = _math.local_ids(topk_ids, expert_map)
    flat = ids.flatten()
    # one sort instead of one scan of the ids per expert: the slots of expert e are a run
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat[flat >= 0], minlength=w13.shape[0]).tolist()
    start = int((flat < 0).sum())
    k = topk_ids.shape[1]
    weights = topk_weights.float().flatten()
    for e, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[start:start + n]
        start += n
        token, weight = slots // k, weights[slots]
        xe = x[token]
        if apply_router_weight_on_input:
            xe = xe * weight.to(x.dtype)[:, None]
        h = F.linear(xe, w13[e], None if w13_bias is None else w13_bias[e])
        a = _math.act_and_mul(h.float(), activation, alpha, limit, beta).to(x.dtype)
        y = F.linear(a, w2[e]).float()
        if w2_bias is not None:
            y = y + w2_bias[e].float()
        if not apply_router_weight_on_input:
            y = y * weight[:, None]
        out.index_add_(0, token, y)
    return out.to(x.dtype)


_compiled = None


def compiled(*args):
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_math.fused_experts_grouped, dynamic=True)
    return _compiled(*args)


FORMULATIONS = {"spec": _math.fused_experts, "per_expert": per_expert, "grouped": _math.fused_experts_grouped,
                "compiled": compiled}


def fused_experts(x, *args):
    """``forward_cpu``'s experts: inside a caller's ``torch.compile`` the grouped form (static
    shapes), else the measured choice for x's dtype."""
    if torch.compiler.is_compiling():
        return _math.fused_experts_grouped(x, *args)
    return FORMULATIONS[CHOICE.get(x.dtype, "spec")](x, *args)
