"""``MambaMixer2`` (``mamba_mixer2``, the Mamba-2 SSD mixer: Mamba-2, Nemotron-H, Falcon-H1,
Granite-4) and its grouped gated norm ``Mixer2RMSNormGated`` (``mixer2_gated_rms_norm``)."""

from __future__ import annotations

import functools

import torch
from torch import nn

from customop.backends.cpu import CpuTiers, run_tiered
from customop.custom_op import CustomOp
from customop.distributed import get_tp_group
from customop.math.mamba import NULL_BLOCK_ID, MambaMetadata, mixer2_gated_rms_norm, ssd_head_form
from customop.ops.linear import MergedColumnParallelLinear, RowParallelLinear
from customop.ops.mamba._common import (
    CPU, MIXER_CPU_TIERS, NATIVE, Steps, _kernel_steps, check_activation, check_hidden, check_state_caches,
    check_metadata, conv_step, padded_output, project, sub_op,
)
from customop.ops.mamba.mixer import negative_exp, sharded_loader, ssm_parameter

#: Measured on the 2-core CI box (benchmarks/results/cpu_mamba.md, one thread): compiled code wins
#: from one 4096-wide row in bf16/fp16 (35 vs 39 us; eager pays separate cast kernels), and in fp32
#: too since the compiled code is called without Dynamo while our guards hold (``standalone``,
#: backends/cpu/standalone.py; through Dynamo fp32 won only from 8 x 4096): 24 vs 37 us at one row,
#: 36 vs 52 at four (one thread's CPU time; two threads 28 vs 40 and 39 vs 61; issue 18 in
#: benchmarks/results/cpu_layernorm.md). Eager's casts are kept: the spec rounds to x's dtype
#: before the weight, which Inductor would otherwise fuse away (one ulp in ~25% of bf16 outputs);
#: for bf16 x and weight the tier compiles backends/cpu/exact_rounding.py's form (that rounding in
#: fp32 arithmetic, bitwise the emulated graph, faster), fp16/fp32 the spec with
#: emulate_precision_casts.
NORM_CPU_TIERS = CpuTiers(min_numel=4096, dynamic_hidden=False, emulate_casts=True, standalone=True)


@CustomOp.register("mixer2_gated_rms_norm")
class Mixer2RMSNormGated(CustomOp):
    """``g = x * silu(gate)`` in fp32, RMS-normalised per group of ``full_hidden_size /
    full_n_groups`` lanes, cast to x's dtype, then times the weight (``customop/math/mamba.py``).
    ``use_rms_norm=False``: the gated product only, no weight. Never in place.

    Under tensor parallelism each rank holds ``full_hidden_size / tp`` lanes: one group is reduced
    with an all-reduce of the sums of squares; groups that split evenly over the ranks are local;
    otherwise the rows are all-gathered and normalised redundantly (vLLM's three cases).
    ``params_dtype`` (keyword, default torch's default dtype) is the weight's dtype.
    """

    cpu_tiers = NORM_CPU_TIERS

    def __init__(self, full_hidden_size: int, full_n_groups: int, use_rms_norm: bool = True, eps: float = 1e-6,
                 *, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp = get_tp_group()
        if full_n_groups < 1 or full_hidden_size % full_n_groups:
            raise ValueError(f"customop.{self.name}: full_n_groups={full_n_groups} must divide "
                             f"full_hidden_size={full_hidden_size}")
        self.per_rank_hidden_size = self.tp.shard_size(full_hidden_size, f"customop.{self.name} full_hidden_size")
        self.full_hidden_size, self.n_groups = full_hidden_size, full_n_groups
        self.group_size = full_hidden_size // full_n_groups
        self.variance_epsilon, self.use_rms_norm = eps, use_rms_norm
        weight = None
        if use_rms_norm:
            weight = nn.Parameter(torch.ones(self.per_rank_hidden_size, dtype=params_dtype), requires_grad=False)
            weight.tp_group, weight.weight_loader = self.tp, sharded_loader()
        self.register_parameter("weight", weight)

    @property
    def local_groups(self) -> bool:
        """Whether each rank's lanes hold whole groups (no collective needed)."""
        return not self.use_rms_norm or self.n_groups % self.tp.tp_size == 0

    def _check(self, x: torch.Tensor, gate: torch.Tensor) -> None:
        for name, t in (("x", x), ("gate", gate)):
            if not t.is_floating_point():
                raise TypeError(f"customop.{self.name}: {name} must be a floating-point tensor, got {t.dtype}")
        if x.dim() == 0 or x.shape[-1] != self.per_rank_hidden_size:
            raise ValueError(f"customop.{self.name}: x has shape {tuple(x.shape)}, expected "
                             f"[..., {self.per_rank_hidden_size}]")
        if gate.shape != x.shape or gate.device != x.device:
            raise ValueError(f"customop.{self.name}: gate ({tuple(gate.shape)} on {gate.device}) must match x "
                             f"({tuple(x.shape)} on {x.device})")

    def _group_size(self) -> int:
        return self.group_size if self.n_groups > 1 else self.per_rank_hidden_size

    def _collective(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The two cases that need the other ranks' lanes (the spec with its collective)."""
        g = x * torch.nn.functional.silu(gate.float())
        if self.n_groups == 1:
            total = self.tp.all_reduce(g.pow(2).sum(dim=-1, keepdim=True))
            g = g * torch.rsqrt(total / (self.tp.tp_size * g.shape[-1]) + self.variance_epsilon)
            return self.weight * g.to(x.dtype)
        full = self.tp.all_gather(g, dim=-1)
        groups = full.unflatten(-1, (-1, self.group_size))
        full = (groups * torch.rsqrt(groups.pow(2).mean(dim=-1, keepdim=True) + self.variance_epsilon)).flatten(-2)
        start = self.per_rank_hidden_size * self.tp.tp_rank
        return self.weight * full[..., start:start + self.per_rank_hidden_size].to(x.dtype)

    def forward_native(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        self._check(x, gate)
        if not self.local_groups:
            return self._collective(x, gate)
        return mixer2_gated_rms_norm(x, gate, self.weight, self.variance_epsilon, self._group_size())

    def _inputs_pass(self, x: torch.Tensor, gate: torch.Tensor) -> bool:
        """True when ``_check`` would pass: its conditions without building a message (the hot
        path runs the full check, and its errors, only when this says no)."""
        shape = x.shape
        return (bool(shape) and shape[-1] == self.per_rank_hidden_size and x.is_floating_point()
                and gate.is_floating_point() and gate.shape == shape
                and ((x.is_cpu and gate.is_cpu) or gate.device == x.device))

    def forward_cpu(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # per-call cost matters at decode sizes (issue 18: ~50-100 us calls against torch.compile's
        # own): the check's conditions in one pass, the weight without nn.Module's __getattr__
        if not self._inputs_pass(x, gate):
            self._check(x, gate)
        if not self.local_groups:
            return self._collective(x, gate)
        weight, eps, group_size = self._parameters["weight"], self.variance_epsilon, self._group_size()
        return run_tiered(self.cpu_tiers, mixer2_gated_rms_norm, x, gate, weight, eps, group_size,
                          static=(weight is None, eps, group_size))

    def forward_cuda(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.forward_kernel(x, gate)

    forward_xpu = forward_tpu = forward_cuda

    def forward_kernel(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The ``torch.ops.customop`` call every accelerator shares; the collective cases run the
        spec (their reduction spans ranks)."""
        self._check(x, gate)
        if not self.local_groups:
            return self._collective(x, gate)
        x, gate = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, gate))
        return torch.ops.customop.mixer2_gated_rms_norm(x, gate, self.weight, self.variance_epsilon,
                                                        self._group_size())

    def extra_repr(self) -> str:
        return (f"full_hidden_size={self.full_hidden_size}, n_groups={self.n_groups}, "
                f"use_rms_norm={self.use_rms_norm}, eps={self.variance_epsilon}, tp_size={self.tp.tp_size}")


def _group_loader(layer: MergedColumnParallelLinear, sizes: list[int], group_shards: tuple[int, ...], copies: int,
                  param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
    """The merged layer's loader for a checkpoint whose B/C groups are not yet replicated: with
    one group and ``tp > 1`` every rank gets the whole group (``copies`` = tp); a fused tensor is
    split by the checkpoint's sizes first."""
    if shard_id is None:
        if loaded.shape[0] != sum(sizes):
            raise ValueError(f"{type(layer).__name__}.weight_loader: the fused tensor has {loaded.shape[0]} rows, "
                             f"expected {sum(sizes)} = {' + '.join(map(str, sizes))}")
        for i, part in enumerate(loaded.split(sizes, dim=0)):
            _group_loader(layer, sizes, group_shards, copies, param, part, i)
        return
    if shard_id in group_shards and copies > 1:
        loaded = loaded.repeat(copies, *[1] * (loaded.dim() - 1))
    MergedColumnParallelLinear.weight_loader(layer, param, loaded, shard_id)


@CustomOp.register("mamba_mixer2")
class MambaMixer2(CustomOp):
    """Mamba-2: ``[z | xBC | dt] = in_proj(h)`` (times ``mup_vector`` when given); causal conv +
    SiLU on ``xBC = [x | B | C]`` with the conv state; the SSD scan with ``n_groups`` B/C groups
    and the SSM state (the recurrence in ``forward_native``, the chunked form on the kernel path);
    ``Mixer2RMSNormGated(y, z)``; ``out_proj``.

    ``forward(hidden_states (T, hidden), conv_state, ssm_state, metadata, mup_vector=None)``:
    ``conv_state`` is ``(slots, >= K-1, conv_dim/tp)``, ``ssm_state`` ``(slots, heads/tp, head_dim,
    N)``, updated in place; rows past the batch's tokens are zero. ``intermediate_size`` must be
    ``num_heads * head_dim``; ``n_groups`` must be 1 or a multiple of the TP size (one group is
    then replicated on every rank). ``params_dtype`` (keyword) is the weights' dtype; ``A`` is fp32.
    """

    cpu_tiers = MIXER_CPU_TIERS

    def __init__(self, hidden_size: int, ssm_state_size: int, conv_kernel_size: int, intermediate_size: int,
                 use_conv_bias: bool, use_bias: bool, n_groups: int = 1, num_heads: int = 128, head_dim: int = 64,
                 rms_norm_eps: float = 1e-5, activation: str = "silu", use_rms_norm: bool = True,
                 model_config: object = None, cache_config: object = None, quant_config: object = None,
                 prefix: str = "", *, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        tp, name = get_tp_group(), f"customop.{self.name}"
        check_activation(self.name, activation)
        if conv_kernel_size < 2:
            raise ValueError(f"{name}: conv_kernel_size={conv_kernel_size} must be at least 2")
        if intermediate_size != num_heads * head_dim:
            raise ValueError(f"{name}: intermediate_size={intermediate_size} must be num_heads * head_dim = "
                             f"{num_heads} * {head_dim}")
        if num_heads % n_groups:
            raise ValueError(f"{name}: n_groups={n_groups} must divide num_heads={num_heads}")
        if num_heads % tp.tp_size:
            raise ValueError(f"{name}: num_heads={num_heads} is not divisible by tp_size={tp.tp_size}")
        if n_groups % tp.tp_size and n_groups != 1:
            raise ValueError(f"{name}: n_groups={n_groups} must be 1 or a multiple of tp_size={tp.tp_size} "
                             "(a group cannot be split over ranks)")
        dtype = params_dtype or torch.get_default_dtype()
        self.hidden_size, self.ssm_state_size, self.conv_kernel_size = hidden_size, ssm_state_size, conv_kernel_size
        self.intermediate_size, self.num_heads, self.head_dim = intermediate_size, num_heads, head_dim
        self.activation, self.use_rms_norm, self.prefix = activation, use_rms_norm, prefix
        # one group with tp > 1 is replicated to every rank, so its heads find it locally
        self.n_groups = n_groups if n_groups % tp.tp_size == 0 else tp.tp_size
        groups = self.n_groups * ssm_state_size
        self.conv_dim = intermediate_size + 2 * groups
        self.conv1d = MergedColumnParallelLinear(conv_kernel_size, [intermediate_size, groups, groups],
                                                 bias=use_conv_bias, params_dtype=dtype, prefix=f"{prefix}.conv1d")
        self.conv1d.weight.data = self.conv1d.weight.data.unsqueeze(1)  # the checkpoint's (conv_dim, 1, K)
        self.in_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size, groups, groups,
                                                                num_heads], bias=use_bias, params_dtype=dtype,
                                                  prefix=f"{prefix}.in_proj")
        ckpt = n_groups * ssm_state_size
        for layer, sizes, shards in ((self.in_proj, [intermediate_size] * 2 + [ckpt] * 2 + [num_heads], (2, 3)),
                                     (self.conv1d, [intermediate_size, ckpt, ckpt], (1, 2))):
            for param in (p for p in (layer.weight, layer.bias) if p is not None):
                param.weight_loader = functools.partial(_group_loader, layer, sizes, shards, self.n_groups // n_groups)
        self.local_heads, self.local_groups = num_heads // tp.tp_size, self.n_groups // tp.tp_size
        self.local_intermediate = self.local_heads * head_dim
        self.local_conv_dim = self.local_intermediate + 2 * self.local_groups * ssm_state_size
        self.A = ssm_parameter(tp, (self.local_heads,), torch.float32, negative_exp)
        self.D = ssm_parameter(tp, (self.local_heads,), dtype)
        self.dt_bias = ssm_parameter(tp, (self.local_heads,), dtype)
        self.out_proj = RowParallelLinear(intermediate_size, hidden_size, bias=use_bias, input_is_parallel=True,
                                          params_dtype=dtype, prefix=f"{prefix}.out_proj")
        # built with the checkpoint's group count, as in vLLM
        self.norm = Mixer2RMSNormGated(intermediate_size, n_groups, use_rms_norm, eps=rms_norm_eps, params_dtype=dtype)
        self.requires_grad_(False)  # an inference layer: its steps write the caches in place

    def get_state_shape(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-slot shapes of ``(conv_state, ssm_state)``."""
        return ((self.conv_kernel_size - 1, self.local_conv_dim),
                (self.local_heads, self.head_dim, self.ssm_state_size))

    def _check(self, h, conv_state, ssm_state, metadata, mup_vector) -> None:
        check_hidden(self.name, h, self.hidden_size)
        check_metadata(self.name, metadata, h.shape[0], h.device, chunked=True)
        check_state_caches(self.name, conv_state, ssm_state, self.get_state_shape(), h.device)
        width = self.in_proj.output_size_per_partition
        if mup_vector is not None and (mup_vector.shape[-1] != width or mup_vector.device != h.device):
            raise ValueError(f"customop.{self.name}: mup_vector has shape {tuple(mup_vector.shape)} on "
                             f"{mup_vector.device}, expected [..., {width}] on {h.device}")

    def _forward(self, h, conv_state, ssm_state, meta: MambaMetadata, mup_vector, steps: Steps,
                 path: str) -> torch.Tensor:
        n, nd, N, P = meta.num_actual_tokens, meta.num_decodes, self.ssm_state_size, self.head_dim
        if n == 0:
            return h.new_zeros(h.shape)
        zxbcdt = project(self.in_proj, h[:n], path)
        if mup_vector is not None:
            zxbcdt = zxbcdt * mup_vector
        z, xbc, dt = zxbcdt.split([self.local_intermediate, self.local_conv_dim, self.local_heads], dim=-1)
        weight = self.conv1d.weight.view(self.local_conv_dim, self.conv_kernel_size)
        xbc = conv_step(steps, xbc, conv_state, weight, self.conv1d.bias, meta, silu=True)
        G = self.local_groups
        x, B, C = xbc.split([self.local_intermediate, G * N, G * N], dim=-1)
        x, B, C = x.unflatten(-1, (self.local_heads, P)), B.unflatten(-1, (G, N)), C.unflatten(-1, (G, N))
        ys = []
        if nd:
            dt4, A4, D4, bias4 = ssd_head_form(dt[:nd], self.A, self.D, self.dt_bias, P, N)
            ys.append(steps.state_update(ssm_state, x[:nd], dt4, A4, B[:nd], C[:nd], D4, None, bias4,
                                         meta.decode_slots, True, NULL_BLOCK_ID))
        if meta.num_prefills:
            ys.append(steps.ssd(x[nd:], dt[nd:], self.A, B[nd:], C[nd:], self.D, self.dt_bias, ssm_state,
                                meta.query_start_loc_p, meta.state_indices_tensor_p, meta.has_initial_states_p,
                                meta.chunk_size, True, NULL_BLOCK_ID))
        y = (torch.cat(ys) if len(ys) > 1 else ys[0]).flatten(1)
        y = sub_op(self.norm, path)(y, z)
        return padded_output(h, project(self.out_proj, y, path))

    def forward_native(self, hidden_states: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                       metadata: MambaMetadata, mup_vector: torch.Tensor | None = None) -> torch.Tensor:
        self._check(hidden_states, conv_state, ssm_state, metadata, mup_vector)
        return self._forward(hidden_states, conv_state, ssm_state, metadata, mup_vector, NATIVE, "native")

    def _cpu(self, *args) -> torch.Tensor:
        return self._forward(*args, CPU, "cpu")

    def forward_cpu(self, hidden_states: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                    metadata: MambaMetadata, mup_vector: torch.Tensor | None = None) -> torch.Tensor:
        self._check(hidden_states, conv_state, ssm_state, metadata, mup_vector)
        return run_tiered(self.cpu_tiers, self.forward_native, hidden_states, conv_state, ssm_state, metadata,
                          mup_vector, eager=self._cpu)

    def forward_cuda(self, hidden_states: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                     metadata: MambaMetadata, mup_vector: torch.Tensor | None = None) -> torch.Tensor:
        return self.forward_kernel(hidden_states, conv_state, ssm_state, metadata, mup_vector)

    forward_xpu = forward_tpu = forward_cuda

    def forward_kernel(self, hidden_states: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                       metadata: MambaMetadata, mup_vector: torch.Tensor | None = None) -> torch.Tensor:
        """The ``torch.ops.customop`` route every accelerator shares: the conv, decode and chunked
        SSD kernels (the spec while autograd records: the cache-writing ops have no backward)."""
        self._check(hidden_states, conv_state, ssm_state, metadata, mup_vector)
        steps, path = (NATIVE, "native") if hidden_states.requires_grad and torch.is_grad_enabled() \
            else (_kernel_steps(), "kernel")
        return self._forward(hidden_states, conv_state, ssm_state, metadata, mup_vector, steps, path)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"n_groups={self.n_groups}, ssm_state_size={self.ssm_state_size}, "
                f"conv_kernel_size={self.conv_kernel_size}, use_rms_norm={self.use_rms_norm}")
