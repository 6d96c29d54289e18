"""vLLM 0.33's other MoE names, on the same math and kernels as ``FusedMoE``:

- ``RoutedExperts`` (``routed_experts``): the experts alone, routing given:
  ``forward(hidden_states, topk_weights, topk_ids)`` -> this rank's output (no reduction).
- ``GateLinear`` (``gate_linear``): the router's linear layer (a ``ReplicatedLinear`` whose logits
  can be produced in another dtype, ``out_dtype``, e.g. fp32 for bf16 weights).
- ``UnquantizedFusedMoEMethod`` (``unquantized_fused_moe``): the method object of unquantized
  weights: ``create_weights(layer, ...)`` and ``apply(layer, x, topk_weights, topk_ids)``; which
  experts kernel runs is the op's dispatch (spec, the CPU choice, or the library op).
- ``FusedMoEModularMethod`` (``modular_fused_moe``): the experts computation as three replaceable
  parts, ``prepare`` -> ``experts`` -> ``finalize`` (``MoEPrepareAndFinalize``, ``MoEExperts``),
  so a vendor replaces only the experts (``FusedMoEModularMethod(experts=MyExperts())``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from customop.custom_op import CustomOp
from customop.math import moe as _math
from customop.ops.linear import ReplicatedLinear
from customop.ops.moe import cpu as _cpu
from customop.ops.moe import weights as _weights
from customop.ops.moe.layer import FusedMoE


@CustomOp.register("routed_experts")
class RoutedExperts(FusedMoE):
    """The weight owner of a MoE layer (``FusedMoE``'s weights, loader and parallel layout)
    without the router: ``forward(hidden_states, topk_weights, topk_ids)``."""

    def forward_native(self, hidden_states, topk_weights, topk_ids):
        self._check_hidden(hidden_states)
        self.check_routing(hidden_states, topk_weights, topk_ids)
        return self._experts(hidden_states, topk_weights, topk_ids, "forward_native")

    def forward_cpu(self, hidden_states, topk_weights, topk_ids):
        self._check_hidden(hidden_states)
        self.check_routing(hidden_states, topk_weights, topk_ids)
        return self._experts(hidden_states, topk_weights, topk_ids, "forward_cpu")

    def forward_cuda(self, hidden_states, topk_weights, topk_ids):
        return self.forward_kernel(hidden_states, topk_weights, topk_ids)

    forward_xpu = forward_tpu = forward_cuda

    def forward_kernel(self, hidden_states, topk_weights, topk_ids):
        """``torch.ops.customop.fused_experts``, every accelerator."""
        self._check_hidden(hidden_states)
        self.check_routing(hidden_states, topk_weights, topk_ids)
        return self._experts(hidden_states, topk_weights, topk_ids, "forward_kernel")


@CustomOp.register("gate_linear")
class GateLinear(ReplicatedLinear):
    """The router's ``ReplicatedLinear`` (no bias by default). ``out_dtype`` casts the logits (the
    input is first cast to the weight dtype when they differ); ``force_fp32_compute`` keeps the
    weight in fp32 (vLLM does so when no fp32-output kernel applies; here there is none)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, out_dtype: torch.dtype | None = None,
                 params_dtype: torch.dtype | None = None, force_fp32_compute: bool = False, prefix: str = "",
                 **kwargs: Any) -> None:
        super().__init__(input_size, output_size, bias=bias, params_dtype=torch.float32 if force_fp32_compute
                         else params_dtype, prefix=prefix, **kwargs)
        self.out_dtype = out_dtype

    def set_out_dtype(self, out_dtype: torch.dtype) -> None:
        if self.out_dtype is not None:
            raise ValueError("GateLinear: out_dtype has already been set")
        self.out_dtype = out_dtype

    def _run(self, path, x):
        if self.out_dtype is not None and x.dtype != self.weight.dtype:
            x = x.to(self.weight.dtype)
        out = path(x)
        logits, bias = out if isinstance(out, tuple) else (out, None)
        if self.out_dtype is not None and logits.dtype != self.out_dtype:
            logits = logits.to(self.out_dtype)
        return (logits, bias) if isinstance(out, tuple) else logits

    def forward_native(self, x: torch.Tensor):
        return self._run(super().forward_native, x)

    def forward_cpu(self, x: torch.Tensor):
        return self._run(super().forward_cpu, x)


def _experts_args(layer: nn.Module) -> tuple:
    """The library op's arguments after (x, w13, w2, weights, ids), read from any layer that
    holds vLLM's attributes (``FusedMoE``'s own, or a plain module with w13/w2 weights)."""
    if hasattr(layer, "experts_args"):
        return layer.experts_args()
    act, (alpha, limit, beta) = "silu", _math.ACTIVATIONS["silu"]
    act = getattr(layer, "activation", act)
    if act in _math.ACTIVATIONS:
        alpha, limit, beta = _math.ACTIVATIONS[act]
    return (getattr(layer, "expert_map", None), getattr(layer, "w13_bias", None), getattr(layer, "w2_bias", None),
            act, alpha, limit, beta, bool(getattr(layer, "apply_router_weight_on_input", False)))


def run_experts(path: str, layer: nn.Module, x, topk_weights, topk_ids) -> torch.Tensor:
    """The experts of ``layer`` on one path: ``forward_native`` (spec), ``forward_cpu`` (the CPU
    choice) or the library op (every accelerator)."""
    args = (x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, *_experts_args(layer))
    if path == "forward_native":
        return _math.fused_experts(*args)
    if path == "forward_cpu":
        return _cpu.fused_experts(*args)
    return torch.ops.customop.fused_experts(x.contiguous(), *args[1:3], topk_weights.float().contiguous(),
                                            topk_ids.to(torch.int32).contiguous(), *args[5:])


@CustomOp.register("unquantized_fused_moe")
class UnquantizedFusedMoEMethod(CustomOp):
    """The unquantized method: ``create_weights`` registers vLLM's parameters on a layer,
    ``apply(layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None)``
    runs the experts (returning ``(shared_out, routed_out)`` when ``shared_experts`` is given)."""

    def __init__(self, moe: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.moe = moe

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra_weight_attrs: Any):
        has_bias = bool(extra_weight_attrs.pop("has_bias", False))
        if not hasattr(layer, "weight_loader"):
            layer.weight_loader = extra_weight_attrs.get("weight_loader")
        _weights.create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype, has_bias)
        for name in ("w13_weight", "w2_weight", "w13_bias", "w2_bias"):
            param = getattr(layer, name, None)
            for key, value in (extra_weight_attrs if param is not None else {}).items():
                setattr(param, key, value)

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts: nn.Module | None = None, shared_experts_input: torch.Tensor | None = None):
        routed = self(layer, x, topk_weights, topk_ids)
        if shared_experts is None:
            return routed
        return shared_experts(x if shared_experts_input is None else shared_experts_input), routed

    def forward_native(self, layer, x, topk_weights, topk_ids):
        return run_experts("forward_native", layer, x, topk_weights, topk_ids)

    def forward_cpu(self, layer, x, topk_weights, topk_ids):
        return run_experts("forward_cpu", layer, x, topk_weights, topk_ids)

    def forward_cuda(self, layer, x, topk_weights, topk_ids):
        return self.forward_kernel(layer, x, topk_weights, topk_ids)

    forward_xpu = forward_tpu = forward_cuda

    def forward_kernel(self, layer, x, topk_weights, topk_ids):
        return run_experts("forward_kernel", layer, x, topk_weights, topk_ids)


# ---- the modular method -------------------------------------------------------------------------


class MoEPrepareAndFinalize:
    """Single device or tensor parallel (no token dispatch): ``prepare`` scales the input by the
    router weight when asked (top_k 1), ``finalize`` weights and sums per-slot expert rows, or
    passes an already reduced ``[T, H]`` output through."""

    def prepare(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                apply_router_weight_on_input: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if apply_router_weight_on_input:
            if topk_ids.shape[1] != 1:
                raise ValueError("customop modular_fused_moe: apply_router_weight_on_input needs top_k=1")
            a1 = a1 * topk_weights.to(a1.dtype)
        return a1, topk_weights, topk_ids

    def finalize(self, expert_output: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 apply_router_weight_on_input: bool) -> torch.Tensor:
        if expert_output.dim() == 2:  # the experts already weighted and summed
            return expert_output
        rows = expert_output.float()  # [T, K, H], unweighted; slots that computed nothing are 0
        if not apply_router_weight_on_input:
            rows = rows * topk_weights.float()[..., None]
        return rows.sum(dim=1).to(expert_output.dtype)


class MoEExperts:
    """The experts part. ``apply`` returns either the weighted sum ``[T, H]`` (when
    ``weights_and_reduces``) or one unweighted row per slot ``[T, K, H]`` for ``finalize``."""

    weights_and_reduces = True

    def __init__(self, path: str = "forward_kernel") -> None:
        self.path = path

    def apply(self, layer: nn.Module, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        # the router weight was applied by prepare (or is applied here, on the output)
        return run_experts(self.path, _NoInputWeight(layer), hidden_states, topk_weights, topk_ids)


class _NoInputWeight:
    """``layer`` seen with ``apply_router_weight_on_input`` off: prepare has applied it."""

    def __init__(self, layer: nn.Module) -> None:
        self._layer = layer
        self.w13_weight, self.w2_weight = layer.w13_weight, layer.w2_weight

    def experts_args(self) -> tuple:
        return (*_experts_args(self._layer)[:-1], False)


@CustomOp.register("modular_fused_moe")
class FusedMoEModularMethod(CustomOp):
    """prepare -> experts -> finalize. ``experts`` defaults per path (the spec, the CPU choice,
    the library op); a replacement ``MoEExperts`` runs on every path."""

    def __init__(self, prepare_finalize: MoEPrepareAndFinalize | None = None, experts: MoEExperts | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.prepare_finalize = prepare_finalize or MoEPrepareAndFinalize()
        self.experts = experts

    def apply(self, layer, x, topk_weights, topk_ids):
        return self(layer, x, topk_weights, topk_ids)

    def _run(self, path: str, layer, x, topk_weights, topk_ids):
        on_input = bool(_experts_args(layer)[-1])
        a1, w, ids = self.prepare_finalize.prepare(x, topk_weights, topk_ids, on_input)
        experts = self.experts or MoEExperts(path)
        out = experts.apply(layer, a1, torch.ones_like(w) if on_input else w, ids)
        return self.prepare_finalize.finalize(out, w, ids, on_input)

    def forward_native(self, layer, x, topk_weights, topk_ids):
        return self._run("forward_native", layer, x, topk_weights, topk_ids)

    def forward_cpu(self, layer, x, topk_weights, topk_ids):
        return self._run("forward_cpu", layer, x, topk_weights, topk_ids)

    def forward_cuda(self, layer, x, topk_weights, topk_ids):
        return self.forward_kernel(layer, x, topk_weights, topk_ids)

    forward_xpu = forward_tpu = forward_cuda

    def forward_kernel(self, layer, x, topk_weights, topk_ids):
        return self._run("forward_kernel", layer, x, topk_weights, topk_ids)


__all__ = ["FusedMoEModularMethod", "GateLinear", "MoEExperts", "MoEPrepareAndFinalize", "RoutedExperts",
           "UnquantizedFusedMoEMethod"]
