"""The mixture-of-experts math: routing (top-k, biased top-k, DeepSeek's grouped top-k) and the
experts (gate/up GEMM, gated activation, down GEMM, weighted sum over the chosen experts).

Conventions (vLLM's): ``T`` tokens, ``H`` hidden size, ``I`` intermediate size of this rank,
``E`` experts, ``K`` = top_k. ``w13 [E, 2I, H]`` holds the gate rows ``[0, I)`` and the up rows
``[I, 2I)`` (interleaved, gate on even rows, for ``swigluoai``); ``w2 [E, H, I]``. Routers return
``topk_weights`` fp32 ``[T, K]`` and ``topk_ids`` int32 ``[T, K]``.

Precision, chosen once for every path: routing scores are computed in fp32 from the logits
(vLLM's CUDA routing kernels and its CPU router do the same; its torch fallback stays in the logits
dtype). Ties go to the lower expert id (and the lower group id), so every path picks the same
experts. The experts accumulate each GEMM in fp32; the gate/up result and the activation are
rounded to the input dtype as vLLM's kernels store them; the router weight multiplies the fp32
down-projection; the sum over the K experts is fp32, rounded once.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

SCORING_FUNCS = ("softmax", "sigmoid")
#: gated activations of the experts: name -> (alpha, limit, beta) defaults (see ``act_and_mul``)
ACTIVATIONS = {
    "silu": (1.0, math.inf, 0.0),
    "gelu": (1.0, math.inf, 0.0),
    "gelu_tanh": (1.0, math.inf, 0.0),
    "swigluoai": (1.702, 7.0, 1.0),            # gpt-oss: gate/up interleaved by row
    "swigluoai_uninterleave": (1.0, math.inf, 0.0),  # the same formula on [gate | up] halves
}
ACTIVATION_ALIASES = {"gelu_pytorch_tanh": "gelu_tanh"}


# ---- routing ----------------------------------------------------------------------------------


def routing_scores(gating_output: torch.Tensor, scoring_func: str) -> torch.Tensor:
    """fp32 scores ``[T, E]``: softmax over the experts, or a sigmoid per expert."""
    logits = gating_output.float()
    if scoring_func == "softmax":
        return torch.softmax(logits, dim=-1)
    if scoring_func == "sigmoid":
        return torch.sigmoid(logits)
    raise ValueError(f"customop moe: scoring_func must be one of {SCORING_FUNCS}, got {scoring_func!r}")


def _topk_indices(values: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the k largest values per row, ties to the lower index (a stable sort;
    ``torch.topk`` leaves the order of equal values unspecified)."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def _finish(scores: torch.Tensor, ids: torch.Tensor, renormalize: bool,
            routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights = the chosen experts' (unbiased) scores, renormalised to sum to 1, then scaled."""
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights.float(), ids.to(torch.int32)


def fused_topk(gating_output: torch.Tensor, topk: int, renormalize: bool, scoring_func: str = "softmax",
               e_score_correction_bias: torch.Tensor | None = None,
               routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing. Without a bias (vLLM's ``fused_topk``) the k best scores win; with one
    (``fused_topk_bias``) ``score + bias`` chooses the experts and the weights are the unbiased
    scores. Returns (fp32 weights ``[T, K]``, int32 ids ``[T, K]``)."""
    scores = routing_scores(gating_output, scoring_func)
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    return _finish(scores, _topk_indices(choice, topk), renormalize, routed_scaling_factor)


def grouped_topk(gating_output: torch.Tensor, topk: int, renormalize: bool, num_expert_group: int,
                 topk_group: int, scoring_func: str = "softmax", routed_scaling_factor: float = 1.0,
                 e_score_correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2/V3 routing: the E experts form ``num_expert_group`` contiguous groups; a group
    scores its best expert (with a bias: the sum of its two best ``score + bias``); only the
    ``topk_group`` best groups stay eligible; top-k over those, weights from the unbiased scores."""
    scores = routing_scores(gating_output, scoring_func)
    t, e = scores.shape
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    grouped = choice.view(t, num_expert_group, e // num_expert_group)
    if e_score_correction_bias is None:
        group_scores = grouped.max(dim=-1).values
    else:
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, _topk_indices(group_scores, topk_group), True)
    masked = grouped.masked_fill(~keep.unsqueeze(-1), -math.inf).view(t, e)
    return _finish(scores, _topk_indices(masked, topk), renormalize, routed_scaling_factor)


# ---- expert parallelism -----------------------------------------------------------------------


def expert_map(num_experts: int, ep_size: int, ep_rank: int, placement: str = "linear") -> torch.Tensor | None:
    """int32 ``[E]``: the local slot of each global expert on rank ``ep_rank``, -1 where another
    rank holds it; None without expert parallelism. ``linear``: contiguous ranges (the first
    ``E % ep_size`` ranks take one more); ``round_robin``: experts r, r + ep, r + 2 ep, ..."""
    if ep_size == 1:
        return None
    owner = torch.empty(num_experts, dtype=torch.long)
    if placement == "linear":
        base, extra = divmod(num_experts, ep_size)
        sizes = [base + (r < extra) for r in range(ep_size)]
        owner = torch.repeat_interleave(torch.arange(ep_size), torch.tensor(sizes))
    elif placement == "round_robin":
        owner = torch.arange(num_experts) % ep_size
    else:
        raise ValueError(f"customop moe: expert placement must be 'linear' or 'round_robin', got {placement!r}")
    local = owner == ep_rank
    emap = torch.full((num_experts,), -1, dtype=torch.int32)
    emap[local] = torch.arange(int(local.sum()), dtype=torch.int32)
    return emap


def local_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """Global ids -> this rank's expert slots (int64), -1 for a remote expert or an id of -1."""
    ids = topk_ids.long()
    if expert_map is None:
        return ids
    return torch.where(ids >= 0, expert_map.long()[ids.clamp(min=0)], -1)


# ---- the experts ------------------------------------------------------------------------------


def act_and_mul(h: torch.Tensor, activation: str, alpha: float, limit: float, beta: float) -> torch.Tensor:
    """The gated activation ``[..., 2I] -> [..., I]``, in h's dtype (the callers pass fp32).

    - ``silu``: ``silu(min(g, limit)) * clamp(u, -limit, limit)`` (limit inf: plain SwiGLU);
    - ``gelu`` / ``gelu_tanh``: ``gelu(g) * u`` (erf / tanh form);
    - ``swigluoai`` (gate/up interleaved) and ``swigluoai_uninterleave`` (halves):
      ``g = min(g, limit)``, ``u = clamp(u, -limit, limit)``, ``g * sigmoid(alpha * g) * (u + beta)``.
    """
    if activation == "swigluoai":
        g, u = h[..., 0::2], h[..., 1::2]
    else:
        g, u = h.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(g.clamp(max=limit)) * u.clamp(-limit, limit)
    if activation in ("gelu", "gelu_tanh"):
        return F.gelu(g, approximate="tanh" if activation == "gelu_tanh" else "none") * u
    if activation in ("swigluoai", "swigluoai_uninterleave"):
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        return g * torch.sigmoid(alpha * g) * (u + beta)
    raise ValueError(f"customop moe: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, expert_map: torch.Tensor | None = None,
                  w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                  activation: str = "silu", alpha: float = 1.0, limit: float = math.inf, beta: float = 0.0,
                  apply_router_weight_on_input: bool = False) -> torch.Tensor:
    """``out[t] = sum_k w[t, k] * down_e(act(gate_up_e(x[t])))`` with ``e = ids[t, k]``, one expert
    at a time. Slots whose expert is not on this rank (``expert_map`` -1) or whose id is -1 add
    nothing. ``apply_router_weight_on_input`` scales ``x`` (in its dtype) instead of the output."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    ids = local_ids(topk_ids, expert_map)
    for e in range(w13.shape[0]):
        token, slot = (ids == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        weight = topk_weights[token, slot].float()
        xe = x[token]
        if apply_router_weight_on_input:
            xe = xe * weight.to(x.dtype)[:, None]
        b13 = None if w13_bias is None else w13_bias[e].float()
        h = F.linear(xe.float(), w13[e].float(), b13).to(x.dtype)
        a = act_and_mul(h.float(), activation, alpha, limit, beta).to(x.dtype)
        y = F.linear(a.float(), w2[e].float(), None if w2_bias is None else w2_bias[e].float())
        if not apply_router_weight_on_input:
            y = y * weight[:, None]
        out.index_add_(0, token, y)
    return out.to(x.dtype)


def fused_experts_grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                          topk_ids: torch.Tensor, expert_map: torch.Tensor | None = None,
                          w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                          activation: str = "silu", alpha: float = 1.0, limit: float = math.inf, beta: float = 0.0,
                          apply_router_weight_on_input: bool = False) -> torch.Tensor:
    """``fused_experts`` as one grouped GEMM per weight (``torch._grouped_mm``): the (token, k)
    slots sorted by expert, both GEMMs over the experts' row ranges, the weighted sum. No host
    sync and static shapes (CUDA graphs, ``torch.compile(fullgraph=True)``). Rounds like the loop
    except that the down projection is rounded to x's dtype before the router weight multiplies
    it (``_grouped_mm`` returns x's dtype)."""
    t, k = topk_ids.shape
    n_local = w13.shape[0]
    ids = local_ids(topk_ids, expert_map).flatten()
    key = torch.where(ids >= 0, ids, n_local)  # remote slots sort last, past every group
    order = torch.sort(key, stable=True).indices
    counts = torch.zeros(n_local + 1, dtype=torch.int32, device=x.device).scatter_add_(
        0, key, torch.ones_like(key, dtype=torch.int32))
    offs = torch.cumsum(counts[:n_local], 0, dtype=torch.int32)
    weights = topk_weights.float().flatten()[order]
    xs = x[order // k]
    if apply_router_weight_on_input:
        xs = xs * weights.to(x.dtype)[:, None]
    h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
    sorted_key = key[order]
    local = sorted_key.clamp(max=n_local - 1)
    if w13_bias is not None:
        h = (h.float() + w13_bias.float()[local]).to(x.dtype)
    a = act_and_mul(h.float(), activation, alpha, limit, beta).to(x.dtype)
    y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs).float()
    if w2_bias is not None:
        y = y + w2_bias.float()[local]
    if not apply_router_weight_on_input:
        y = y * weights[:, None]
    # rows past the last group are not written by _grouped_mm: zero them (remote slots)
    y = torch.where((sorted_key < n_local)[:, None], y, 0.0)
    out = torch.zeros(t * k, y.shape[1], dtype=torch.float32, device=x.device).index_copy_(0, order, y)
    return out.view(t, k, w2.shape[1]).sum(dim=1).to(x.dtype)


# ---- token alignment (the Triton kernels' layout) ---------------------------------------------


def align_capacity(num_slots: int, num_experts: int, block_size: int) -> int:
    """Length of ``sorted_token_ids``: every slot plus each expert's padding to a block."""
    return num_slots + num_experts * (block_size - 1)


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int,
                         expert_map: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups the flat slots ``t * K + k`` by (local) expert, each expert's run padded to a multiple
    of ``block_size`` with the sentinel ``T * K``. Returns int32 ``sorted_token_ids
    [align_capacity]``, ``expert_ids [capacity / block_size]`` (the expert of each block, -1 past
    the used blocks) and ``num_tokens_post_padded [1]``. Remote and -1 slots are left out. Within
    an expert the slots here are in ascending order; kernels may order them otherwise."""
    num_slots = topk_ids.numel()
    capacity = align_capacity(num_slots, num_experts, block_size)
    dev = topk_ids.device
    key = local_ids(topk_ids, expert_map).flatten()
    key = torch.where(key >= 0, key, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev).scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_experts]
    padded = (counts + block_size - 1) // block_size * block_size
    starts = torch.cumsum(padded, 0) - padded
    first = torch.cumsum(counts, 0) - counts  # where each expert's run starts in sorted order
    order = torch.sort(key, stable=True).indices
    sorted_key = key[order]
    rank = torch.arange(num_slots, device=dev) - first.gather(0, sorted_key.clamp(max=num_experts - 1))
    dest = torch.where(sorted_key < num_experts, starts.gather(0, sorted_key.clamp(max=num_experts - 1)) + rank,
                       capacity)
    sorted_ids = torch.full((capacity + 1,), num_slots, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    n_blocks = -(-capacity // block_size)
    block_start = torch.arange(n_blocks, device=dev) * block_size
    total = padded.sum()
    expert_ids = torch.searchsorted(torch.cumsum(padded, 0), block_start, right=True)
    expert_ids = torch.where(block_start < total, expert_ids, -1).to(torch.int32)
    return sorted_ids[:capacity], expert_ids, total.reshape(1).to(torch.int32)
