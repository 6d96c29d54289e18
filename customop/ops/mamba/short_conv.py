"""``ShortConv`` (``short_conv``): LFM2's gated short convolution."""

from __future__ import annotations

import torch

from customop.backends.cpu import run_tiered
from customop.custom_op import CustomOp
from customop.math.mamba import MambaMetadata
from customop.ops.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from customop.ops.mamba._common import (
    CPU, MIXER_CPU_TIERS, NATIVE, Steps, _kernel_steps, check_cache, check_hidden, check_metadata, conv_step,
    padded_output, project,
)


@CustomOp.register("short_conv")
class ShortConv(CustomOp):
    """``[B | C | x] = in_proj(h)``; ``y = C * conv(B * x)`` with a causal depthwise conv (bias,
    no activation) that continues from and updates the conv state; ``out_proj(y)``.

    ``forward(hidden_states (T, dim), conv_state, metadata) -> (T, dim)``: ``conv_state`` is
    ``(slots, >= K-1, dim/tp)`` (vLLM's layout), updated in place; rows past the batch's tokens are
    zero. vLLM's constructor: ``config`` needs ``conv_L_cache`` (K) and ``conv_bias`` (the bias
    of the conv and both projections). ``params_dtype`` (keyword) is the weights' dtype.
    """

    cpu_tiers = MIXER_CPU_TIERS

    def __init__(self, config: object, dim: int, layer_idx: int, model_config: object = None,
                 cache_config: object = None, prefix: str = "", *, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config, self.layer_idx, self.prefix, self.conv_dim = config, layer_idx, prefix, dim
        self.L_cache, self.bias = int(config.conv_L_cache), bool(config.conv_bias)
        if self.L_cache < 2:
            raise ValueError(f"customop.{self.name}: config.conv_L_cache={self.L_cache} must be at least 2")
        dtype = params_dtype or torch.get_default_dtype()
        self.conv = ColumnParallelLinear(self.L_cache, dim, bias=self.bias, params_dtype=dtype,
                                         prefix=f"{prefix}.conv1d")
        self.conv.weight.data = self.conv.weight.data.unsqueeze(1)  # the checkpoint's (dim, 1, K)
        self.in_proj = MergedColumnParallelLinear(dim, [dim] * 3, bias=self.bias, params_dtype=dtype,
                                                  prefix=f"{prefix}.in_proj")
        self.out_proj = RowParallelLinear(dim, dim, bias=self.bias, params_dtype=dtype, prefix=f"{prefix}.out_proj")
        self.local_dim = self.in_proj.output_partition_sizes[0]
        self.requires_grad_(False)  # an inference layer: its steps write the cache in place

    def get_state_shape(self) -> tuple[tuple[int, ...]]:
        """Per-slot shape of ``(conv_state,)``."""
        return ((self.L_cache - 1, self.local_dim),)

    def _check(self, h: torch.Tensor, conv_state: torch.Tensor, metadata: MambaMetadata) -> None:
        check_hidden(self.name, h, self.conv_dim)
        check_metadata(self.name, metadata, h.shape[0], h.device)
        (shape,) = self.get_state_shape()
        check_cache(self.name, "conv_state", conv_state, shape, h.device, min_width=shape[0])

    def _forward(self, h: torch.Tensor, conv_state: torch.Tensor, meta: MambaMetadata, steps: Steps,
                 path: str) -> torch.Tensor:
        n = meta.num_actual_tokens
        if n == 0:
            return h.new_zeros(h.shape)
        B, C, x = project(self.in_proj, h[:n], path).chunk(3, dim=-1)
        weight = self.conv.weight.view(self.local_dim, self.L_cache)
        y = C * conv_step(steps, B * x, conv_state, weight, self.conv.bias, meta, silu=False)
        return padded_output(h, project(self.out_proj, y, path))

    def forward_native(self, hidden_states: torch.Tensor, conv_state: torch.Tensor,
                       metadata: MambaMetadata) -> torch.Tensor:
        self._check(hidden_states, conv_state, metadata)
        return self._forward(hidden_states, conv_state, metadata, NATIVE, "native")

    def _cpu(self, *args) -> torch.Tensor:
        return self._forward(*args, CPU, "cpu")

    def forward_cpu(self, hidden_states: torch.Tensor, conv_state: torch.Tensor,
                    metadata: MambaMetadata) -> torch.Tensor:
        self._check(hidden_states, conv_state, metadata)
        return run_tiered(self.cpu_tiers, self.forward_native, hidden_states, conv_state, metadata, eager=self._cpu)

    def forward_cuda(self, hidden_states: torch.Tensor, conv_state: torch.Tensor,
                     metadata: MambaMetadata) -> torch.Tensor:
        return self.forward_kernel(hidden_states, conv_state, metadata)

    forward_xpu = forward_tpu = forward_cuda

    def forward_kernel(self, hidden_states: torch.Tensor, conv_state: torch.Tensor,
                       metadata: MambaMetadata) -> torch.Tensor:
        """The ``torch.ops.customop`` route every accelerator shares (the spec while autograd
        records: the cache-writing conv ops have no backward)."""
        self._check(hidden_states, conv_state, metadata)
        if hidden_states.requires_grad and torch.is_grad_enabled():
            return self._forward(hidden_states, conv_state, metadata, NATIVE, "native")
        return self._forward(hidden_states, conv_state, metadata, _kernel_steps(), "kernel")

    def extra_repr(self) -> str:
        return f"dim={self.conv_dim}, L_cache={self.L_cache}, bias={self.bias}, layer_idx={self.layer_idx}"
