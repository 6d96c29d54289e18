"""``customop::fused_experts`` on IPEX: ``ipex.llm.modules.GatedMLPMOE`` with the routing given.

``GatedMLPMOE(W13, W2)`` holds ``w13 [E, 2I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]``
as the op stores them; its ``forward`` routes by itself unless a ``custom_routing_function`` is
given, which here returns the op's ``topk_weights``/``topk_ids`` (the router logits it also takes
are not read then). What it computes, per (token, k) slot: ``w * w2 @ (silu(gate) * up)``, summed
over k. So IPEX serves exactly: the ``silu`` activation without a limit, no biases, the router
weight on the output (not ``apply_router_weight_on_input``). Every other argument set goes to the
chain's next provider.

Ids of -1, ids out of range and experts of other ranks (``expert_map``) contribute nothing in the
op; IPEX has no such slot, so they are given weight 0 and a local expert that the token does not
use otherwise (an exact zero for finite outputs; an inf/NaN in that expert's output for that token
would propagate, where the op skips it). A token must name each expert at most once: the CPU
kernel adds one expert's rows in parallel, and a token listed twice for one expert raced (a bf16
row came back all zero in about 3% of calls, measured on 2.8.0+cpu). So an expert repeated within
a token's slots gets the slots' weights summed on its first slot, and ``top_k`` may not exceed the
local experts (else the chain's next provider serves it).

Rounding differs from the spec within the tolerances: IPEX multiplies by the weight in the input
dtype and accumulates the k experts in it (the spec: fp32). ``use_prepack=False``: on the CPU build
(2.8.0+cpu) the prepacked (TPP) path gave a wrong bf16 result for one token (error 0.98 on O(1)
outputs; measured in the xpu tier), and it repacks the weights in place. A ``GatedMLPMOE`` is
built once per weight pair (cached on the ``w13`` tensor, rebuilt when either weight is replaced or
written in place) since building one wraps each expert in three ``nn.Linear``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

Tensor = torch.Tensor
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CALL = "ipex.llm.modules.GatedMLPMOE(w13, w2, use_prepack=False)(x, ..., custom_routing_function=(weights, ids))"

_modules: WeakIdKeyDictionary = WeakIdKeyDictionary()


def supports(hidden_states: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
             expert_map: Tensor | None, w13_bias: Tensor | None, w2_bias: Tensor | None, activation: str,
             alpha: float, limit: float, beta: float, apply_router_weight_on_input: bool) -> bool:
    return (activation == "silu" and math.isinf(limit) and limit > 0 and w13_bias is None and w2_bias is None
            and not apply_router_weight_on_input and hidden_states.dim() == 2 and hidden_states.dtype in DTYPES
            and topk_ids.dim() == 2 and topk_ids.shape[1] <= w13.shape[0]
            and w13.dtype == hidden_states.dtype and w2.dtype == hidden_states.dtype)


def local_routing(topk_weights: Tensor, topk_ids: Tensor, expert_map: Tensor | None,
                  num_local: int) -> tuple[Tensor, Tensor]:
    """(fp32 weights, int64 local ids) in which every token names each local expert at most once.

    A slot without a local expert gets weight 0 and one of the experts the token leaves unused
    (there are enough: ``top_k <= num_local``); a slot repeating an earlier slot's expert gets
    weight 0 too, its weight added to the earlier slot's. All on the device, no host sync."""
    tokens, top_k = topk_ids.shape
    ids = topk_ids.long()
    n_ids = num_local if expert_map is None else expert_map.shape[0]
    known = (ids >= 0) & (ids < n_ids)
    local = ids.clamp(0, n_ids - 1)
    if expert_map is not None:
        local = expert_map.long()[local]
    valid = known & (local >= 0) & (local < num_local)
    weights = torch.where(valid, topk_weights.float(), 0.0)
    # same[t, i, j]: slots i and j of token t name one local expert
    same = (local[:, :, None] == local[:, None, :]) & valid[:, :, None] & valid[:, None, :]
    earlier = torch.ones(top_k, top_k, dtype=torch.bool, device=ids.device).tril(-1)
    first = valid & ~(same & earlier).any(-1)
    weights = torch.where(first, (same * weights[:, None, :]).sum(-1), 0.0)
    taken = torch.zeros(tokens, num_local, dtype=torch.int32, device=ids.device)
    taken.scatter_add_(1, torch.where(first, local, 0), first.int())
    unused_experts = torch.sort(taken, dim=1, stable=True).indices  # the untaken ones first, ascending
    nth_spare_slot = (~first).long().cumsum(1) - 1
    spare = unused_experts.gather(1, nth_spare_slot.clamp(min=0))
    return weights, torch.where(first, local, spare)


def _version(t: Tensor) -> int | None:
    # inference tensors (made under torch.inference_mode) keep no version counter: an in-place write
    # to one inside inference mode goes unseen by the cache
    return None if t.is_inference() else t._version


def _module(cls: type, w13: Tensor, w2: Tensor) -> Any:
    key = (cls, w13.data_ptr(), _version(w13), tuple(w13.shape), w13.stride(), w2.data_ptr(), _version(w2),
           tuple(w2.shape), w2.stride(), w2.dtype)
    cached = _modules.get(w13)
    if cached is None or cached[0] != key:
        # detached aliases (same storage): the module must not hold the key tensor itself, or the
        # weak entry would keep it alive
        cached = (key, cls(w13.detach(), w2.detach(), use_prepack=False))
        _modules[w13] = cached
    return cached[1]


def bind(fns: Any, modules: Any = None):
    """The ``IpexKernel`` of ``fused_experts``, or None when ``ipex.llm.modules`` lacks GatedMLPMOE."""
    from customop.backends.xpu.ipex_ops import IpexKernel  # not at the top: ipex_ops imports this module

    cls = getattr(modules, "GatedMLPMOE", None)
    if cls is None:
        return None

    def run(hidden_states: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
            expert_map: Tensor | None, w13_bias: Tensor | None, w2_bias: Tensor | None, activation: str,
            alpha: float, limit: float, beta: float, apply_router_weight_on_input: bool) -> Tensor:
        tokens, top_k = topk_ids.shape
        if tokens == 0:
            return hidden_states.new_zeros((0, w2.shape[1]))
        weights, ids = local_routing(topk_weights, topk_ids, expert_map, w13.shape[0])

        def given(**_: Any) -> tuple[Tensor, Tensor]:
            return weights, ids

        logits = hidden_states.new_zeros((tokens, w13.shape[0]))  # not read with a custom routing function
        return _module(cls, w13, w2)(hidden_states.contiguous(), False, top_k, logits, False,
                                     custom_routing_function=given)

    return IpexKernel(CALL, run, supports)
