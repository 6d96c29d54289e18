"""``MambaMixer`` (``mamba_mixer``): the Mamba-1 selective-scan mixer (Mamba, FalconMamba, Jamba)."""

from __future__ import annotations

import torch
from torch import nn

from customop.backends.cpu import run_tiered
from customop.custom_op import CustomOp
from customop.math.mamba import NULL_BLOCK_ID, MambaMetadata
from customop.ops.layernorm import RMSNorm
from customop.ops.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from customop.ops.mamba._common import (
    CPU, MIXER_CPU_TIERS, NATIVE, Steps, _kernel_steps, check_activation, check_hidden, check_state_caches,
    check_metadata, conv_step, padded_output, project, sub_op,
)


def sharded_loader(transform=None):
    """A ``weight_loader`` taking the full checkpoint tensor and keeping this rank's rows (dim 0),
    optionally transformed first (``A = -exp(A_log)``)."""

    def load(param: nn.Parameter, loaded: torch.Tensor) -> None:
        tp = param.tp_group
        if loaded.shape[0] != param.shape[0] * tp.tp_size or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"weight_loader: expected the full tensor of shape "
                             f"{(param.shape[0] * tp.tp_size, *param.shape[1:])}, got {tuple(loaded.shape)}")
        part = loaded.chunk(tp.tp_size, dim=0)[tp.tp_rank]
        param.data.copy_(transform(part) if transform else part)

    return load


def ssm_parameter(tp, shape, dtype, transform=None) -> nn.Parameter:
    param = nn.Parameter(torch.ones(*shape, dtype=dtype), requires_grad=False)
    param.tp_group, param.weight_loader = tp, sharded_loader(transform)
    return param


def negative_exp(a_log: torch.Tensor) -> torch.Tensor:
    return -torch.exp(a_log.float())


@CustomOp.register("mamba_mixer")
class MambaMixer(CustomOp):
    """Mamba-1: ``[x | z] = in_proj(h)``; causal conv + SiLU on x with the conv state; ``dt, B, C``
    from ``x_proj`` (optionally RMS-normed), ``dt = dt_proj(dt)`` without its bias; the selective
    scan (``customop/math/mamba.py``) with the SSM state, gated by ``silu(z)``; ``out_proj``.

    ``forward(hidden_states (T, hidden), conv_state, ssm_state, metadata) -> (T, hidden)``:
    ``conv_state`` is ``(slots, >= K-1, D/tp)`` (vLLM's layout), ``ssm_state`` ``(slots, D/tp, N)``;
    both are updated in place for every request of ``metadata`` (a ``MambaMetadata``); rows past
    the batch's tokens are zero. vLLM's constructor; ``params_dtype`` (keyword, default: torch's
    default dtype) is the weights' dtype, ``A`` stays fp32.
    """

    cpu_tiers = MIXER_CPU_TIERS

    def __init__(self, hidden_size: int, ssm_state_size: int, conv_kernel_size: int, intermediate_size: int,
                 time_step_rank: int, use_conv_bias: bool, use_bias: bool, use_rms_norm: bool,
                 rms_norm_has_weight: bool = True, rms_norm_eps: float = 1e-5, activation: str = "silu",
                 is_lora_enabled: bool = False, model_config: object = None, cache_config: object = None,
                 prefix: str = "", *, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        check_activation(self.name, activation)
        if conv_kernel_size < 2:
            raise ValueError(f"customop.{self.name}: conv_kernel_size={conv_kernel_size} must be at least 2")
        dtype = params_dtype or torch.get_default_dtype()
        self.hidden_size, self.ssm_state_size, self.conv_kernel_size = hidden_size, ssm_state_size, conv_kernel_size
        self.intermediate_size, self.time_step_rank, self.use_rms_norm = intermediate_size, time_step_rank, use_rms_norm
        self.activation, self.is_lora_enabled, self.prefix = activation, is_lora_enabled, prefix
        self.conv1d = ColumnParallelLinear(conv_kernel_size, intermediate_size, bias=use_conv_bias,
                                           params_dtype=dtype, prefix=f"{prefix}.conv1d")
        self.conv1d.weight.data = self.conv1d.weight.data.unsqueeze(1)  # the checkpoint's (D, 1, K)
        self.in_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=use_bias,
                                                  params_dtype=dtype, prefix=f"{prefix}.in_proj")
        self.x_proj = RowParallelLinear(intermediate_size, time_step_rank + 2 * ssm_state_size, bias=False,
                                        params_dtype=dtype, prefix=f"{prefix}.x_proj")
        # dt_proj's bias is added inside the scan, in fp32
        self.dt_proj = ColumnParallelLinear(time_step_rank, intermediate_size, bias=True, skip_bias_add=True,
                                            params_dtype=dtype, prefix=f"{prefix}.dt_proj")
        tp = self.in_proj.tp
        self.local_size = self.in_proj.output_partition_sizes[0]
        self.A = ssm_parameter(tp, (self.local_size, ssm_state_size), torch.float32, negative_exp)
        self.D = ssm_parameter(tp, (self.local_size,), dtype)
        self.out_proj = RowParallelLinear(intermediate_size, hidden_size, bias=use_bias, input_is_parallel=True,
                                          params_dtype=dtype, prefix=f"{prefix}.out_proj")
        norm = dict(eps=rms_norm_eps, has_weight=rms_norm_has_weight, dtype=dtype)
        self.dt_layernorm = RMSNorm(time_step_rank, **norm) if use_rms_norm else None
        self.b_layernorm = RMSNorm(ssm_state_size, **norm) if use_rms_norm else None
        self.c_layernorm = RMSNorm(ssm_state_size, **norm) if use_rms_norm else None
        self.requires_grad_(False)  # an inference layer: its steps write the caches in place

    def get_state_shape(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-slot shapes of ``(conv_state, ssm_state)``."""
        return (self.conv_kernel_size - 1, self.local_size), (self.local_size, self.ssm_state_size)

    def _check(self, h: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
               metadata: MambaMetadata) -> None:
        check_hidden(self.name, h, self.hidden_size)
        check_metadata(self.name, metadata, h.shape[0], h.device)
        check_state_caches(self.name, conv_state, ssm_state, self.get_state_shape(), h.device)

    def _forward(self, h: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor, meta: MambaMetadata,
                 steps: Steps, path: str) -> torch.Tensor:
        n, nd, N = meta.num_actual_tokens, meta.num_decodes, self.ssm_state_size
        if n == 0:
            return h.new_zeros(h.shape)
        x, z = project(self.in_proj, h[:n], path).chunk(2, dim=-1)
        weight = self.conv1d.weight.view(self.local_size, self.conv_kernel_size)
        x = conv_step(steps, x, conv_state, weight, self.conv1d.bias, meta, silu=True)
        dt, B, C = project(self.x_proj, x, path).split([self.time_step_rank, N, N], dim=-1)
        if self.use_rms_norm:
            dt = sub_op(self.dt_layernorm, path)(dt.contiguous())
            B = sub_op(self.b_layernorm, path)(B.contiguous())
            C = sub_op(self.c_layernorm, path)(C.contiguous())
        dt = project(self.dt_proj, dt, path)
        # Mamba-1 in the scans' head form: one head of D channels, one group
        x, z, dt, B, C = (t[:, None] for t in (x, z, dt, B, C))
        A, D, dt_bias, states = self.A[None], self.D[None], self.dt_proj.bias.float()[None], ssm_state[:, None]
        ys = []
        if nd:
            ys.append(steps.state_update(states, x[:nd], dt[:nd], A, B[:nd], C[:nd], D, z[:nd], dt_bias,
                                         meta.decode_slots, True, NULL_BLOCK_ID))
        if meta.num_prefills:
            ys.append(steps.selective_scan(x[nd:], dt[nd:], A, B[nd:], C[nd:], D, z[nd:], dt_bias, states,
                                           meta.query_start_loc_p, meta.state_indices_tensor_p,
                                           meta.has_initial_states_p, True, NULL_BLOCK_ID))
        y = (torch.cat(ys) if len(ys) > 1 else ys[0])[:, 0]
        return padded_output(h, project(self.out_proj, y, path))

    def forward_native(self, hidden_states: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                       metadata: MambaMetadata) -> torch.Tensor:
        self._check(hidden_states, conv_state, ssm_state, metadata)
        return self._forward(hidden_states, conv_state, ssm_state, metadata, NATIVE, "native")

    def _cpu(self, *args) -> torch.Tensor:
        return self._forward(*args, CPU, "cpu")

    def forward_cpu(self, hidden_states: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                    metadata: MambaMetadata) -> torch.Tensor:
        self._check(hidden_states, conv_state, ssm_state, metadata)
        return run_tiered(self.cpu_tiers, self.forward_native, hidden_states, conv_state, ssm_state, metadata,
                          eager=self._cpu)

    def forward_cuda(self, hidden_states: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                     metadata: MambaMetadata) -> torch.Tensor:
        return self.forward_kernel(hidden_states, conv_state, ssm_state, metadata)

    forward_xpu = forward_tpu = forward_cuda

    def forward_kernel(self, hidden_states: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                       metadata: MambaMetadata) -> torch.Tensor:
        """The ``torch.ops.customop`` route every accelerator shares (the spec while autograd
        records for ``hidden_states``: the cache-writing ops have no backward)."""
        self._check(hidden_states, conv_state, ssm_state, metadata)
        if hidden_states.requires_grad and torch.is_grad_enabled():
            return self._forward(hidden_states, conv_state, ssm_state, metadata, NATIVE, "native")
        return self._forward(hidden_states, conv_state, ssm_state, metadata, _kernel_steps(), "kernel")

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"ssm_state_size={self.ssm_state_size}, conv_kernel_size={self.conv_kernel_size}, "
                f"time_step_rank={self.time_step_rank}, use_rms_norm={self.use_rms_norm}")
