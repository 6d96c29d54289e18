"""``TransformersMoERunner`` (``transformers_fused_moe``): a drop-in for the ``experts`` module of
a Hugging Face MoE block (transformers 5: ``MixtralExperts``, ``Qwen3MoeExperts`` and the like,
which hold ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``).

The HF block routes and calls ``experts(hidden_states, top_k_index, top_k_weights)``; the runner
takes the same call (weights cast to fp32, ids to int32, as vLLM's runner does) and runs the
experts on the op's resolved path::

    block.experts = TransformersMoERunner.from_hf(block.experts, config)

Architectures whose experts differ (gpt-oss: transposed, interleaved, with biases) raise
``NotImplementedError``; transformers itself is not imported here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from customop.custom_op import CustomOp
from customop.ops.moe.modular import RoutedExperts

#: HF ``hidden_act`` -> the experts' activation
_HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                   "gelu_new": "gelu_tanh"}


@CustomOp.register("transformers_fused_moe")
class TransformersMoERunner(RoutedExperts):
    """``RoutedExperts`` with the HF experts' call signature."""

    @classmethod
    def from_hf(cls, experts: nn.Module, config: Any = None, **kwargs: Any) -> TransformersMoERunner:
        """Builds the runner from an HF experts module, copying its weights (same device and
        dtype); ``config`` gives ``hidden_act`` and ``num_experts_per_tok``."""
        gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
        arch = " ".join(getattr(config, "architectures", None) or []).lower()
        if "gptoss" in arch or gate_up is None or down is None or gate_up.dim() != 3:
            raise NotImplementedError(f"customop transformers_fused_moe: {type(experts).__name__} does not hold "
                                      "gate_up_proj [E, 2I, H] and down_proj [E, H, I]")
        num_experts, two_i, hidden = gate_up.shape
        if down.shape != (num_experts, hidden, two_i // 2) or getattr(experts, "gate_up_proj_bias", None) is not None:
            raise NotImplementedError(f"customop transformers_fused_moe: unexpected expert shapes {tuple(gate_up.shape)}, "
                                      f"{tuple(down.shape)} (or biases) in {type(experts).__name__}")
        act = getattr(config, "hidden_act", "silu")
        if act not in _HF_ACTIVATIONS:
            raise NotImplementedError(f"customop transformers_fused_moe: hidden_act {act!r} is not supported")
        top_k = int(getattr(config, "num_experts_per_tok", kwargs.pop("top_k", 1)))
        runner = cls(num_experts, top_k, hidden, two_i // 2, params_dtype=gate_up.dtype,
                     activation=_HF_ACTIVATIONS[act], **kwargs).to(gate_up.device)
        with torch.no_grad():
            runner.w13_weight.copy_(gate_up)
            runner.w2_weight.copy_(down)
        return runner

    def _call(self, path, hidden_states, top_k_index, top_k_weights):
        return path(hidden_states, top_k_weights.float(), top_k_index.to(torch.int32))

    def forward_native(self, hidden_states, top_k_index, top_k_weights, **ignored):
        return self._call(super().forward_native, hidden_states, top_k_index, top_k_weights)

    def forward_cpu(self, hidden_states, top_k_index, top_k_weights, **ignored):
        return self._call(super().forward_cpu, hidden_states, top_k_index, top_k_weights)

    def forward_cuda(self, hidden_states, top_k_index, top_k_weights, **ignored):
        return self.forward_kernel(hidden_states, top_k_index, top_k_weights)

    forward_xpu = forward_tpu = forward_cuda

    def forward_kernel(self, hidden_states, top_k_index, top_k_weights, **ignored):
        return self._call(super().forward_kernel, hidden_states, top_k_index, top_k_weights)
