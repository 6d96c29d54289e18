"""Float64 references of the MoE table (``customop/samples/moe.py``), written from the formulas,
not from ``customop.math``: routing one token at a time with Python sorts (ties to the lower id),
the experts one (token, k) slot at a time from gathered weights.

``routing(logits, ...)`` -> (float64 weights, int64 ids); ``experts(layer, x, weights, ids)`` and
``layer_output(layer, x, logits)`` -> float64 ``[T, H]``. Callers pass inputs in any dtype; the
references read them in float64.
"""

from __future__ import annotations

import math

import torch

from customop.samples.moe import moe_tolerance
from customop.testing import assert_close


def _scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    v = logits.double()
    if scoring_func == "softmax":
        e = torch.exp(v - v.max(dim=-1, keepdim=True).values)
        return e / e.sum(dim=-1, keepdim=True)
    return 1.0 / (1.0 + torch.exp(-v))


def _best(values: list[float], candidates, n: int) -> list[int]:
    """The n candidates with the largest values, ties to the lower index."""
    return sorted(candidates, key=lambda i: (-values[i], i))[:n]


def routing(logits: torch.Tensor, topk: int, renormalize: bool, scoring_func: str = "softmax",
            bias: torch.Tensor | None = None, scale: float = 1.0, num_expert_group: int = 1,
            topk_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    scores = _scores(logits, scoring_func)
    t, e = scores.shape
    weights = torch.zeros(t, topk, dtype=torch.float64)
    ids = torch.zeros(t, topk, dtype=torch.long)
    size = e // num_expert_group
    for row in range(t):
        s = scores[row].tolist()
        c = s if bias is None else [a + float(b) for a, b in zip(s, bias.double().tolist())]
        eligible = list(range(e))
        if num_expert_group > 1:
            members = [list(range(g * size, (g + 1) * size)) for g in range(num_expert_group)]
            if bias is None:
                group_score = [max(c[i] for i in m) for m in members]
            else:  # the sum of the group's two best
                group_score = [sum(sorted((c[i] for i in m), reverse=True)[:2]) for m in members]
            kept = _best(group_score, range(num_expert_group), topk_group)
            eligible = [i for g in sorted(kept) for i in members[g]]
        chosen = _best(c, eligible, topk)
        w = [s[i] for i in chosen]
        if renormalize:
            total = sum(w)
            w = [v / total for v in w]
        weights[row] = torch.tensor([v * scale for v in w], dtype=torch.float64)
        ids[row] = torch.tensor(chosen)
    return weights, ids


def op_routing(op, logits: torch.Tensor, bias: torch.Tensor | None):
    """The reference of a routing op (``FusedTopK`` or ``GroupedTopk``), read from its attributes."""
    return routing(logits, op.topk, op.renormalize, op.scoring_func, bias, op.routed_scaling_factor,
                   getattr(op, "num_expert_group", 1), getattr(op, "topk_group", 1))


def assert_routing(op_label: str, got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    """fp32 weights against the float64 ones (fp32 tolerance: the scores are fp32 on every path),
    int32 ids exactly."""
    w, ids = got
    assert w.dtype == torch.float32 and ids.dtype == torch.int32, f"{op_label}: dtypes {w.dtype}, {ids.dtype}"
    assert torch.equal(ids.long().cpu(), want[1]), f"{op_label}: ids\n{ids}\nexpected\n{want[1]}"
    assert_close(w.cpu(), want[0], torch.float32, atol=2e-6, rtol=2e-6, what=f"{op_label} weights")


# ---- the experts --------------------------------------------------------------------------------


def _act(h: torch.Tensor, activation: str, alpha: float, limit: float, beta: float) -> torch.Tensor:
    if activation == "swigluoai":
        g, u = h[..., 0::2], h[..., 1::2]
    else:
        half = h.shape[-1] // 2
        g, u = h[..., :half], h[..., half:]
    if activation == "silu":
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        return g / (1.0 + torch.exp(-g)) * u
    if activation == "gelu":
        return 0.5 * g * (1.0 + torch.erf(g / math.sqrt(2.0))) * u
    if activation == "gelu_tanh":
        return 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3))) * u
    g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return g / (1.0 + torch.exp(-alpha * g)) * (u + beta)


def experts(layer, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w2_bias: bool = True) -> torch.Tensor:
    """This rank's float64 output: sum over the slots whose expert is local of
    ``w * (w2 act(w13 x + b13) + b2)`` (``w`` on x instead with ``apply_router_weight_on_input``)."""
    x64 = x.double().cpu()
    out = torch.zeros(x.shape[0], layer.hidden_size, dtype=torch.float64)
    emap = None if layer.expert_map is None else layer.expert_map.cpu().tolist()
    w13, w2 = layer.w13_weight.detach().double().cpu(), layer.w2_weight.detach().double().cpu()
    b13 = None if layer.w13_bias is None else layer.w13_bias.detach().double().cpu()
    b2 = None if layer.w2_bias is None or not w2_bias else layer.w2_bias.detach().double().cpu()
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            local = e if emap is None or e < 0 else emap[e]
            if e < 0 or local < 0:
                continue
            w = float(weights[t, k])
            xin = x64[t] * w if layer.apply_router_weight_on_input else x64[t]
            h = w13[local] @ xin + (0.0 if b13 is None else b13[local])
            y = w2[local] @ _act(h, layer.activation, layer.alpha, layer.limit, layer.beta)
            y = y + (0.0 if b2 is None else b2[local])
            out[t] += y if layer.apply_router_weight_on_input else w * y
    return out


def layer_routing(layer, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's router choice: grouped or biased top-k apply the scaling factor (unless it goes to
    the output); plain top-k ignores it."""
    grouped = layer.use_grouped_topk
    bias = layer.e_score_correction_bias
    scale = layer.routed_scaling_factor
    if not (grouped or bias is not None) or layer.apply_routed_scale_to_output:
        scale = 1.0
    groups = (layer.num_expert_group, layer.topk_group) if grouped else (1, 1)
    return routing(logits, layer.top_k, layer.renormalize, layer.scoring_func,
                   None if bias is None else bias.detach().cpu(), scale, *groups)


def layer_output(layer, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    weights, ids = layer_routing(layer, logits)
    out = experts(layer, x, weights, ids)
    if layer.apply_routed_scale_to_output:
        out = out * layer.routed_scaling_factor
    return out


def assert_layer(label: str, out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype, f"{label}: output dtype {out.dtype}, expected {dtype}"
    atol, rtol = moe_tolerance(dtype)
    assert_close(out.cpu(), expected, dtype, atol=atol, rtol=rtol, what=label)
