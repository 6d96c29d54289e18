"""``FusedMoE`` (``fused_moe``): router + routed experts + the tensor-parallel reduction, built
from the keyword arguments of vLLM 0.33's ``FusedMoEFactory`` (also exported under that name).

``forward(hidden_states [T, H], router_logits [T, E]) -> [T, H]``:

1. routing (``select_experts``): grouped top-k (``use_grouped_topk``), a
   ``custom_routing_function``, biased top-k (``e_score_correction_bias``) or plain top-k, in
   vLLM's order; fp32 weights, int32 ids;
2. the experts (``apply_experts``), see ``customop/math/moe.py``;
3. ``routed_scaling_factor`` on the output when ``apply_routed_scale_to_output``; plus the
   ``shared_experts`` output when given;
4. one all-reduce over the tensor-parallel group (``customop.distributed``) when the layer is
   split over ranks (tensor or expert parallel) and ``reduce_results``.

Paths: ``forward_native`` is the spec (a loop over experts, fp32 accumulation);
``forward_cpu`` chooses the measured CPU route (``customop/ops/moe/cpu.py``); every accelerator
calls ``forward_kernel``: ``torch.ops.customop.{fused_topk|grouped_topk, fused_experts}``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from customop.custom_op import CustomOp
from customop.distributed import get_tp_group
from customop.math import moe as _math
from customop.ops.moe import cpu as _cpu
from customop.ops.moe import weights as _weights
from customop.ops.moe.routing import check_groups, check_logits, check_scoring

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: FusedMoEFactory arguments this layer accepts only at their default (value the default);
#: anything else raises NotImplementedError naming the argument
_UNSUPPORTED = {
    "quant_config": None, "dp_size": None, "pcp_size": None, "is_sequence_parallel": False,
    "enable_eplb": False, "num_redundant_experts": 0, "hash_indices_table": None, "zero_expert_type": None,
    "routed_input_transform": None, "routed_output_transform": None, "gate": None,
    "shared_expert_gate": None, "router": None, "n_shared_experts": None, "fuse_shared_experts": False,
    "activation_situ_beta": None, "activation_situ_linear_beta": None,
}


def _activation_params(activation: str, alpha: float | None, limit: float | None,
                       beta: float | None) -> tuple[str, tuple[float, float, float]]:
    act = _math.ACTIVATION_ALIASES.get(activation, activation)
    if act not in _math.ACTIVATIONS:
        raise ValueError(f"customop fused_moe: activation must be one of {sorted(_math.ACTIVATIONS)} (gated; "
                         f"non-gated '*_no_mul' activations are not supported), got {activation!r}")
    d_alpha, d_limit, d_beta = _math.ACTIVATIONS[act]
    if act == "swigluoai":  # vLLM 0.33 does not forward the layer's swiglu_* values on this path
        return act, (d_alpha, d_limit, d_beta)
    if act == "swigluoai_uninterleave" and limit is None:
        raise ValueError("customop fused_moe: activation 'swigluoai_uninterleave' needs swiglu_limit")
    if act in ("gelu", "gelu_tanh") and limit is not None:
        raise ValueError(f"customop fused_moe: swiglu_limit applies to silu and swiglu activations, not {act!r}")
    return act, (d_alpha if alpha is None else float(alpha), math.inf if limit is None else float(limit),
                 d_beta if beta is None else float(beta))


@CustomOp.register("fused_moe")
class FusedMoE(CustomOp):
    """A mixture-of-experts layer with vLLM's weights, routing and parallel semantics.

    Customop's additions: ``enable_expert_parallel`` (vLLM reads it from the parallel config:
    the tensor-parallel group's ranks each hold ``E / tp_size`` whole experts instead of a slice
    of every expert), ``expert_placement`` (``linear`` or ``round_robin``), and ``ep_size`` /
    ``ep_rank`` to hold one rank's experts without a process group (its output is then that
    rank's partial sum). ``tp_size`` must match the current group when given."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 params_dtype: torch.dtype | None = None, reduce_results: bool = True, renormalize: bool = True,
                 use_grouped_topk: bool = False, num_expert_group: int | None = None, topk_group: int | None = None,
                 tp_size: int | None = None, ep_size: int | None = None, prefix: str = "",
                 custom_routing_function: Callable | None = None, scoring_func: str = "softmax",
                 routed_scaling_factor: float = 1.0, e_score_correction_bias: torch.Tensor | None = None,
                 apply_router_weight_on_input: bool = False, activation: str = "silu", has_bias: bool = False,
                 swiglu_limit: float | None = None, swiglu_alpha: float | None = None,
                 swiglu_beta: float | None = None, apply_routed_scale_to_output: bool = False,
                 shared_experts: nn.Module | None = None, router_logits_dtype: torch.dtype | None = None,
                 ckpt_names: tuple[str | None, ...] = ("gate_proj", "down_proj", "up_proj"),
                 enable_expert_parallel: bool = False, expert_placement: str = "linear",
                 ep_rank: int | None = None, *, enforce_enable: bool = False, **factory_kwargs: Any) -> None:
        super().__init__(enforce_enable=enforce_enable)
        for key, value in factory_kwargs.items():
            if key not in _UNSUPPORTED:
                raise TypeError(f"customop fused_moe: unexpected keyword argument {key!r}")
            if value not in (_UNSUPPORTED[key], None) and not (key in ("dp_size", "pcp_size") and value == 1):
                raise NotImplementedError(f"customop fused_moe: {key}={value!r} is not supported")
        if not (num_experts >= 1 and 1 <= top_k <= num_experts):
            raise ValueError(f"customop fused_moe: top_k={top_k} must be in [1, num_experts={num_experts}]")
        if hidden_size < 1 or intermediate_size < 1:
            raise ValueError(f"customop fused_moe: hidden_size={hidden_size} and intermediate_size="
                             f"{intermediate_size} must be positive")
        if apply_router_weight_on_input and top_k != 1:
            raise ValueError("customop fused_moe: apply_router_weight_on_input needs top_k=1 "
                             f"(the weight scales the input once), got top_k={top_k}")
        if ckpt_names[2] is None:
            raise ValueError("customop fused_moe: ckpt_names needs an up_proj name for a gated activation")
        self.global_num_experts, self.top_k = int(num_experts), int(top_k)
        self.hidden_size, self.intermediate_size = int(hidden_size), int(intermediate_size)
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.prefix, self.ckpt_names = prefix, tuple(ckpt_names)
        self.reduce_results = reduce_results
        self.activation, (self.alpha, self.limit, self.beta) = _activation_params(
            activation, swiglu_alpha, swiglu_limit, swiglu_beta)
        self.interleaved = self.activation == "swigluoai"
        self.apply_router_weight_on_input = apply_router_weight_on_input
        self._init_parallel(tp_size, ep_size, ep_rank, enable_expert_parallel, expert_placement)
        self._init_routing(renormalize, use_grouped_topk, num_expert_group, topk_group, custom_routing_function,
                           scoring_func, routed_scaling_factor, e_score_correction_bias, apply_routed_scale_to_output)
        self.router_logits_dtype = router_logits_dtype
        self.shared_experts = shared_experts
        self.has_bias = has_bias
        _weights.create_weights(self, self.local_num_experts, self.hidden_size, self.intermediate_size_per_partition,
                                self.params_dtype, has_bias)

    # ---- construction helpers -------------------------------------------------------------------

    def _init_parallel(self, tp_size, ep_size, ep_rank, enable_ep, placement) -> None:
        self.tp = get_tp_group()
        if tp_size is not None and tp_size != self.tp.tp_size:
            raise ValueError(f"customop fused_moe: tp_size={tp_size} but the current tensor-parallel group has "
                             f"{self.tp.tp_size} ranks (customop.distributed.init_tp_group)")
        if enable_ep and self.tp.tp_size > 1:
            if ep_size is not None or ep_rank is not None:
                raise ValueError("customop fused_moe: give enable_expert_parallel or ep_size/ep_rank, not both")
            ep_size, ep_rank = self.tp.tp_size, self.tp.tp_rank
        ep_size, ep_rank = ep_size or 1, ep_rank or 0
        if not 0 <= ep_rank < ep_size or ep_size > self.global_num_experts:
            raise ValueError(f"customop fused_moe: ep_rank={ep_rank}, ep_size={ep_size} with "
                             f"{self.global_num_experts} experts")
        self.ep_size, self.ep_rank = ep_size, ep_rank
        # with experts distributed, each rank holds its experts whole (vLLM: the MoE tp size becomes 1)
        self.tp_size, self.tp_rank = (1, 0) if ep_size > 1 else (self.tp.tp_size, self.tp.tp_rank)
        if self.intermediate_size % self.tp_size:
            raise ValueError(f"customop fused_moe: intermediate_size={self.intermediate_size} is not divisible by "
                             f"tp_size={self.tp_size}")
        self.intermediate_size_per_partition = self.intermediate_size // self.tp_size
        emap = _math.expert_map(self.global_num_experts, ep_size, ep_rank, placement)
        self.register_buffer("expert_map", emap, persistent=False)
        self.local_num_experts = self.global_num_experts if emap is None else int((emap >= 0).sum())

    def _init_routing(self, renormalize, use_grouped, num_expert_group, topk_group, custom_fn, scoring_func,
                      scale, bias, scale_output) -> None:
        self.renormalize = renormalize
        self.scoring_func = check_scoring(self.name, scoring_func)
        self.routed_scaling_factor = float(scale)
        self.apply_routed_scale_to_output = apply = scale_output and scale != 1.0
        if bias is not None:
            if not isinstance(bias, torch.Tensor) or bias.shape != (self.global_num_experts,):
                raise ValueError(f"customop fused_moe: e_score_correction_bias must be [{self.global_num_experts}]")
            if not isinstance(bias, nn.Parameter):
                self.register_buffer("e_score_correction_bias", bias, persistent=False)
        self.e_score_correction_bias = bias
        self.custom_routing_function = custom_fn
        self.num_expert_group, self.topk_group = num_expert_group, topk_group
        if use_grouped:
            if num_expert_group is None or topk_group is None:
                raise ValueError("customop fused_moe: use_grouped_topk needs num_expert_group and topk_group")
            if custom_fn is not None:
                raise ValueError("customop fused_moe: use_grouped_topk does not take a custom_routing_function")
            use_grouped = not (num_expert_group <= 1 and topk_group <= 1)  # one group: plain (biased) top-k
            if use_grouped:
                check_groups(self.name, self.global_num_experts, self.top_k, num_expert_group, topk_group)
        self.use_grouped_topk = use_grouped
        # vLLM's routers: grouped and biased top-k apply the scale; plain top-k ignores it
        scaled = use_grouped or (custom_fn is None and bias is not None)
        self._router_scale = self.routed_scaling_factor if scaled and not apply else 1.0

    # ---- input checks ---------------------------------------------------------------------------

    def _check_hidden(self, x: Any) -> None:
        if not isinstance(x, torch.Tensor) or x.dtype not in _DTYPES:
            what = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"customop {self.name}: hidden_states must be a float32/float16/bfloat16 tensor, got {what}")
        if x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"customop {self.name}: hidden_states has shape {tuple(x.shape)}, expected "
                             f"[num_tokens, {self.hidden_size}]")
        if x.dtype != self.w13_weight.dtype or x.device != self.w13_weight.device:
            raise TypeError(f"customop {self.name}: hidden_states is {x.dtype} on {x.device}, the weights "
                            f"{self.w13_weight.dtype} on {self.w13_weight.device}")

    def check_routing(self, x: torch.Tensor, topk_weights: Any, topk_ids: Any) -> None:
        """Routing given to ``apply_experts``: float ``[T, K]`` weights, integer ``[T, K]`` ids in
        ``[-1, E)`` (checked on CPU tensors; on a device it would cost a host sync per call)."""
        shape = (x.shape[0], self.top_k)
        for name, t, ok in (("topk_weights", topk_weights, lambda t: t.is_floating_point()),
                            ("topk_ids", topk_ids, lambda t: t.dtype in (torch.int32, torch.int64))):
            if not isinstance(t, torch.Tensor) or not ok(t):
                what = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
                raise TypeError(f"customop {self.name}: {name} has the wrong type ({what})")
            if tuple(t.shape) != shape:
                raise ValueError(f"customop {self.name}: {name} has shape {tuple(t.shape)}, expected {shape}")
        if topk_ids.device.type == "cpu" and topk_ids.numel() and not torch.compiler.is_compiling():
            lo, hi = int(topk_ids.min()), int(topk_ids.max())
            if lo < -1 or hi >= self.global_num_experts:
                raise ValueError(f"customop {self.name}: topk_ids holds {lo if lo < -1 else hi}, outside "
                                 f"[-1, {self.global_num_experts})")

    def _check(self, x: torch.Tensor, router_logits: torch.Tensor) -> None:
        self._check_hidden(x)
        check_logits(self.name, router_logits, self.top_k, x)
        if router_logits.shape[1] != self.global_num_experts:
            raise ValueError(f"customop {self.name}: router_logits has {router_logits.shape[1]} experts, "
                             f"expected {self.global_num_experts}")

    # ---- the steps ------------------------------------------------------------------------------

    def select_experts(self, x: torch.Tensor, router_logits: torch.Tensor,
                       kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 weights, int32 ids) ``[T, top_k]``; ``kernel`` uses the ``torch.ops.customop`` ops."""
        logits = router_logits if self.router_logits_dtype is None else router_logits.to(self.router_logits_dtype)
        bias = self.e_score_correction_bias
        if self.custom_routing_function is not None:
            w, ids = self.custom_routing_function(hidden_states=x, gating_output=logits, topk=self.top_k,
                                                  renormalize=self.renormalize)
            return w.float(), ids.to(torch.int32)
        if self.use_grouped_topk:
            args = (self.top_k, self.renormalize, self.num_expert_group, self.topk_group, self.scoring_func,
                    self._router_scale)
            if kernel:
                return torch.ops.customop.grouped_topk(logits.contiguous(), *args, bias)
            return _math.grouped_topk(logits, *args, bias)
        args = (self.top_k, self.renormalize, self.scoring_func, bias, self._router_scale)
        return torch.ops.customop.fused_topk(logits.contiguous(), *args) if kernel else _math.fused_topk(logits, *args)

    def experts_args(self) -> tuple:
        """The library op's arguments after (x, w13, w2, topk_weights, topk_ids)."""
        tp_rank0 = self.tp_rank == 0
        # w2_bias is whole on every rank: only rank 0 adds it, so the all-reduce counts it once
        return (self.expert_map, self.w13_bias, self.w2_bias if tp_rank0 else None, self.activation,
                self.alpha, self.limit, self.beta, self.apply_router_weight_on_input)

    def apply_experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The experts with the routing given (what vLLM's quant method ``apply`` receives), on
        this op's resolved path; returns this rank's output before any reduction."""
        self._check_hidden(x)
        self.check_routing(x, topk_weights, topk_ids)
        return self._experts(x, topk_weights, topk_ids, self.forward_method_name)

    def _experts(self, x, topk_weights, topk_ids, method: str) -> torch.Tensor:
        args = (x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, *self.experts_args())
        if method == "forward_native":
            return _math.fused_experts(*args)
        if method == "forward_cpu":
            return _cpu.fused_experts(*args)
        return torch.ops.customop.fused_experts(x.contiguous(), *args[1:3], topk_weights.float().contiguous(),
                                                topk_ids.to(torch.int32).contiguous(), *args[5:])

    def _finish(self, x: torch.Tensor, routed: torch.Tensor, shared_input: torch.Tensor | None) -> torch.Tensor:
        if self.apply_routed_scale_to_output:
            routed = routed * self.routed_scaling_factor
        if self.shared_experts is not None:
            shared = self.shared_experts(x if shared_input is None else shared_input)
            routed = routed + (shared[0] if isinstance(shared, tuple) else shared)
        if self.reduce_results and (self.tp.tp_size > 1 or self.ep_size > 1):
            routed = self.tp.all_reduce(routed)
        return routed

    def _forward(self, method: str, x, router_logits, shared_experts_input):
        self._check(x, router_logits)
        w, ids = self.select_experts(x, router_logits, kernel=method == "forward_kernel")
        return self._finish(x, self._experts(x, w, ids, method), shared_experts_input)

    # ---- the paths ------------------------------------------------------------------------------

    def forward_native(self, hidden_states, router_logits, shared_experts_input=None):
        return self._forward("forward_native", hidden_states, router_logits, shared_experts_input)

    def forward_cpu(self, hidden_states, router_logits, shared_experts_input=None):
        return self._forward("forward_cpu", hidden_states, router_logits, shared_experts_input)

    def forward_cuda(self, hidden_states, router_logits, shared_experts_input=None):
        return self.forward_kernel(hidden_states, router_logits, shared_experts_input)

    forward_xpu = forward_tpu = forward_cuda

    def forward_kernel(self, hidden_states, router_logits, shared_experts_input=None):
        """The ``torch.ops.customop`` calls every accelerator shares."""
        return self._forward("forward_kernel", hidden_states, router_logits, shared_experts_input)

    # ---- weights --------------------------------------------------------------------------------

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, weight_name: str = "",
                      shard_id: str = "w13", expert_id: int | None = None, return_success: bool = False) -> bool | None:
        """vLLM's per-expert loader (``customop/ops/moe/weights.py``); ``expert_id=None`` loads a
        tensor holding every expert (leading dim ``num_experts``)."""
        if expert_id is None:
            if loaded_weight.shape[0] != self.global_num_experts:
                raise ValueError(f"customop fused_moe.weight_loader: without expert_id the tensor needs a leading "
                                 f"[{self.global_num_experts}] dim, got {tuple(loaded_weight.shape)}")
            ok = [_weights.load_expert(self, param, w, shard_id, e) for e, w in enumerate(loaded_weight)]
            return any(ok) if return_success else None
        ok = _weights.load_expert(self, param, loaded_weight, shard_id, int(expert_id))
        return ok if return_success else None

    def make_expert_params_mapping(self) -> list[tuple[str, str, int, str]]:
        """vLLM's ``(param_name, checkpoint_weight_name, expert_id, shard_id)`` rows for
        ``experts.{e}.{gate,down,up}_proj.`` checkpoints."""
        gate, down, up = self.ckpt_names
        return [("experts.w13_" if shard in ("w1", "w3") else "experts.w2_", f"experts.{e}.{name}.", e, shard)
                for e in range(self.global_num_experts)
                for shard, name in (("w1", gate), ("w2", down), ("w3", up))]

    def extra_repr(self) -> str:
        return (f"global_num_experts={self.global_num_experts}, local_num_experts={self.local_num_experts}, "
                f"top_k={self.top_k}, hidden_size={self.hidden_size}, intermediate_size_per_partition="
                f"{self.intermediate_size_per_partition}, tp_size={self.tp_size}, ep_size={self.ep_size}, "
                f"activation={self.activation!r}, scoring_func={self.scoring_func!r}, "
                f"use_grouped_topk={self.use_grouped_topk}")


def FusedMoEFactory(**kwargs: Any) -> FusedMoE:  # noqa: N802  (vLLM 0.33's name)
    """vLLM 0.33 builds the MoE layer through this factory; here it builds ``FusedMoE``."""
    return FusedMoE(**kwargs)
