"""The ``xla`` kernel of ``torch.ops.customop.fused_experts`` (``moe.py`` has the JAX side:
the grouped-matmul Pallas kernel for both expert GEMMs; ``xla_kernels.py`` the bridge reused here).

| op | on XLA tensors |
|---|---|
| ``fused_experts`` | two grouped-matmul Pallas calls; sorting, activation, weighting and the top-k sum in XLA |
| ``fused_topk``, ``grouped_topk`` | no ``xla`` kernel: the reference body (fp32 scores, stable sort) on XLA |
| ``moe_align_block_size`` | no ``xla`` kernel (the Triton route's layout; the TPU path does not use it) |

Float inputs in a dtype the kernel does not take (fp64) run the op's spec (``customop/math/moe.py``).
``topk_ids`` and ``expert_map`` go to JAX as int32. Run only in emulation: the XLA CPU device,
Pallas in interpret mode (docs/tpu.md).
"""

from __future__ import annotations

import torch

from customop.backends.tpu import moe
from customop.backends.tpu import xla_kernels as xk
from customop.math import moe as spec

Tensor = torch.Tensor


def fused_experts(hidden_states: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                  expert_map: Tensor | None, w13_bias: Tensor | None, w2_bias: Tensor | None, activation: str,
                  alpha: float, limit: float, beta: float, apply_router_weight_on_input: bool) -> Tensor:
    dtypes = {t.dtype for t in (hidden_states, w13, w2, w13_bias, w2_bias) if t is not None}
    if not xk._takes(hidden_states, w13, w2, w13_bias, w2_bias) or len(dtypes) != 1:
        return spec.fused_experts(hidden_states, w13, w2, topk_weights, topk_ids, expert_map, w13_bias, w2_bias,
                                  activation, alpha, limit, beta, apply_router_weight_on_input)
    if hidden_states.shape[0] == 0:
        return hidden_states.new_zeros((0, w2.shape[1]))
    return xk._pallas(moe.fused_experts, hidden_states, w13, w2, topk_weights.float(), topk_ids.to(torch.int32),
                      None if expert_map is None else expert_map.to(torch.int32), w13_bias, w2_bias,
                      activation=activation, alpha=float(alpha), limit=float(limit), beta=float(beta),
                      apply_router_weight_on_input=bool(apply_router_weight_on_input))


KERNELS = {"fused_experts": fused_experts}


def register() -> None:
    """Registers the kernels above for XLA tensors (once; ``xla_kernels.register_table``)."""
    xk.register_table(__name__, KERNELS)
