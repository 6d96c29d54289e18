"""Linear layers, replicated and tensor-parallel (op-semantics.md D.8).

Each rank holds a slice of the weight and runs a local GEMM; the layers differ in which slice and
in the one collective that follows:

- ``ReplicatedLinear``: the full weight everywhere, no communication.
- ``ColumnParallelLinear``: weight rows (output features) split over ranks; ``gather_output``
  all-gathers the last dim. ``MergedColumnParallelLinear`` (gate/up) and ``QKVParallelLinear``
  split each sub-matrix separately, so every rank holds its part of each.
- ``RowParallelLinear``: weight columns (input features) split; the partial products are summed
  with an all-reduce; the bias is added on rank 0 only, so it is counted once.

``weight_loader(param, full_tensor[, shard_id])`` takes the *full* checkpoint tensor and copies
this rank's slice; every parameter also carries it as ``param.weight_loader`` (vLLM's loading loop
calls ``getattr(param, "weight_loader")``). Forwards return ``(output, output_bias)`` where
``output_bias`` is the bias left for the caller to add (``skip_bias_add``), else None; with
``return_bias=False`` only the output.

GPUs use the vendor GEMM through ``F.linear``; ``forward_cpu`` uses oneDNN where it measured faster
(``cpu_linear``). Weights are created with ``requires_grad=False``: these are inference layers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from customop.backends.cpu.tiering import for_this_cpu
from customop.custom_op import CustomOp
from customop.distributed import TPGroup, get_tp_group

Gemm = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]

# ---- the math (plain torch; the collective is the group's one call) ----------------------------


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x · Wᵀ + b``: the reference GEMM (cuBLAS/hipBLAS/oneDNN behind ``F.linear``)."""
    return F.linear(x, weight, bias)


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: TPGroup,
                           gather_output: bool, gemm: Gemm = linear) -> torch.Tensor:
    """``y_local = x · W_localᵀ + b_local``; with ``gather_output`` the ranks' ``y_local`` are
    concatenated on the last dim (all-gather), giving the full ``y`` everywhere."""
    out = gemm(x, weight, bias)
    return tp.all_gather(out, dim=-1) if gather_output else out


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: TPGroup,
                        input_is_parallel: bool, reduce_results: bool, gemm: Gemm = linear) -> torch.Tensor:
    """``y = Σ_r x_r · W_rᵀ (+ b on rank 0)``: ``x_r`` is this rank's chunk of the last dim of
    ``x`` (``x`` itself when ``input_is_parallel``); ``reduce_results`` does the sum (all-reduce)."""
    if not input_is_parallel and tp.tp_size > 1:
        x = x.chunk(tp.tp_size, dim=-1)[tp.tp_rank]
    out = gemm(x, weight, bias)
    return tp.all_reduce(out) if reduce_results else out


# ---- the CPU GEMM choice (benchmarks/results/cpu_linear.md) -------------------------------------

_onednn_ok: bool | None = None
#: Dtypes where oneDNN's linear on dense weights beat F.linear on the 2-core CI CPU (fp32: 1.2-1.7x
#: on one thread, 1.5-2x on two, against MKL's sgemm). bf16 F.linear already runs oneDNN's matmul,
#: so there it is a tie and F.linear stays (it has autograd and is public API).
ONEDNN_DTYPES = frozenset({torch.float32})
#: Below this many rows the two are within noise (weight reads dominate); keep F.linear.
ONEDNN_MIN_ROWS = 2
#: dtype -> from how many rows a half-precision GEMM runs in fp32 instead (x and the weight
#: converted on each call, the result rounded back once), on this CPU. Where ATen's capability is
#: AVX2 (no AVX-512: oneDNN's bf16 and fp16 GEMMs get no hardware help; the AMD EPYC CI machines)
#: bf16 F.linear ran at 17-20 GFLOP/s and fp32 at 110-130, so from a few dozen rows the fp32 GEMM
#: plus the conversions wins: 2 threads, 4096 x 4096 weights, bf16 16 / 32 / 128 rows 0.59x /
#: 1.07x / 2.67x, 256 x 4096 x 14336 3.3x; fp16 32 / 128 rows 0.79x / 1.77x; 1024 x 1024
#: weights from 16 rows (BENCHMARKS.md "issue 18, CPU, thirteenth day (2)"). The math is the
#: spec's (fp32 accumulation, one rounding); empty elsewhere (AVX512_BF16 and AMX CPUs).
FP32_GEMM_FROM_ROWS: dict[torch.dtype, int] = for_this_cpu({}, AVX2={torch.bfloat16: 32, torch.float16: 64})
#: the largest weight (elements) converted so: its fp32 copy is a transient allocation of 4 bytes
#: an element (256 MB here; the largest measured weight, 4096 x 14336, is 58.7M elements). A
#: memory bound, not a speed one: an LM head of 150k x 4096 would take 2.5 GB a call
FP32_GEMM_MAX_WEIGHT = 1 << 26


def onednn_linear_available() -> bool:
    """Whether ``torch.ops.mkldnn._linear_pointwise`` exists and agrees with F.linear (probed once)."""
    global _onednn_ok
    if _onednn_ok is None:
        _onednn_ok = False
        if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
            try:
                x, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
                got = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
                _onednn_ok = bool(torch.allclose(got, F.linear(x, w, b), atol=1e-5, rtol=1e-5))
            except (RuntimeError, NotImplementedError):  # a build without the kernel
                pass
    return _onednn_ok


def use_onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether ``cpu_linear`` takes the oneDNN path for these operands. Never inside a
    ``torch.compile`` trace: Inductor lowers this op only for frozen (constant) weights, and picks
    its own GEMM (oneDNN included, with ``freezing``) from ``F.linear``."""
    if torch.compiler.is_compiling():
        return False
    return bool(onednn_linear_available() and x.dtype in ONEDNN_DTYPES and weight.dtype == x.dtype
                and x.device.type == "cpu"
                and x.numel() >= ONEDNN_MIN_ROWS * x.shape[-1] and (bias is None or bias.dtype == x.dtype)
                and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))  # no autograd


def use_fp32_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``cpu_linear`` runs this half-precision GEMM in fp32 (FP32_GEMM_FROM_ROWS). Never
    inside a ``torch.compile`` trace (Inductor picks its own GEMM)."""
    from_rows = FP32_GEMM_FROM_ROWS.get(x.dtype)
    return bool(from_rows is not None and weight.dtype == x.dtype and x.device.type == "cpu"
                and x.numel() >= from_rows * x.shape[-1] and weight.numel() <= FP32_GEMM_MAX_WEIGHT
                and not torch.compiler.is_compiling())


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               onednn: bool = True) -> torch.Tensor:
    """``linear`` on the faster CPU path: oneDNN for the dtypes and sizes where it won, an fp32
    GEMM where half-precision GEMMs are slow, else F.linear. ``onednn=False``: never oneDNN (a
    caller whose products measured slower on it: the conv patch GEMMs)."""
    if onednn and use_onednn(x, weight, bias):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if use_fp32_gemm(x, weight):
        return fp32_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def fp32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` computed in fp32 and rounded once to ``x``'s dtype (``use_fp32_gemm``'s route)."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


# ---- loading helpers ----------------------------------------------------------------------------


def _copy_slice(layer: str, param: torch.Tensor, loaded: torch.Tensor, dim: int | None, full: int,
                start: int, size: int, dst_start: int = 0, tp: TPGroup | None = None) -> None:
    """Copies ``loaded.narrow(dim, start, size)`` into ``param.narrow(dim, dst_start, size)`` after
    checking that ``loaded`` is the full tensor (``full`` along ``dim``, ``param``'s size elsewhere)."""
    if dim is None:
        expected = tuple(param.shape)
    else:
        expected = tuple(full if d == dim else s for d, s in enumerate(param.shape))
    if tuple(loaded.shape) != expected:
        where = f" (rank {tp.tp_rank} of tp_size={tp.tp_size} keeps {size} of {full} along dim {dim})" \
            if tp is not None and dim is not None else ""
        raise ValueError(f"{layer}.weight_loader: expected the full checkpoint tensor of shape {expected}, "
                         f"got {tuple(loaded.shape)}{where}; pass the unsharded tensor")
    src = loaded if dim is None else loaded.narrow(dim, start, size)
    dst = param.data if dim is None else param.data.narrow(dim, dst_start, size)
    dst.copy_(src)


def _param(shape: Sequence[int], dtype: torch.dtype, loader: Callable, **attrs: int) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader
    for key, value in attrs.items():
        setattr(p, key, value)
    return p


# ---- layers -------------------------------------------------------------------------------------


class LinearBase(CustomOp):
    """Shared construction; subclasses set the local parameter shapes and ``weight_loader``."""

    def __init__(self, input_size: int, output_size: int, skip_bias_add: bool = False,
                 params_dtype: torch.dtype | None = None, quant_config: object = None, prefix: str = "", *,
                 return_bias: bool = True, disable_tp: bool = False) -> None:
        super().__init__()
        if quant_config is not None:
            raise NotImplementedError(f"{type(self).__name__}: quantized linear layers are not implemented")
        self.tp = TPGroup() if disable_tp else get_tp_group()
        self.tp_rank, self.tp_size = self.tp.tp_rank, self.tp.tp_size
        self.input_size, self.output_size = input_size, output_size
        self.skip_bias_add, self.return_bias, self.prefix = skip_bias_add, return_bias, prefix
        self.params_dtype = params_dtype or torch.get_default_dtype()

    def _out(self, output: torch.Tensor | None):
        output_bias = self.bias if self.skip_bias_add else None
        return (output, output_bias) if self.return_bias else output

    def _fused_bias(self) -> torch.Tensor | None:
        return None if self.skip_bias_add else self.bias

    def _check_input(self, x: torch.Tensor, want: int, what: str = "input_size") -> None:
        """Every path checks x before the GEMM: oneDNN and F.linear fail on a wrong width with
        errors that name neither the layer nor the argument (or, broadcast by a caller, not at all)."""
        op = getattr(type(self), "name", type(self).__name__)
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"customop.{op}: x must be a tensor, got {type(x).__name__}")
        if x.dim() == 0 or x.shape[-1] != want:
            raise ValueError(f"customop.{op}: x has shape {tuple(x.shape)}, expected [..., {want}] ({what})")

    def extra_repr(self) -> str:
        return (f"in_features={self.input_size}, output_features={self.output_size}, "
                f"bias={self.bias is not None}, tp_size={self.tp_size}")


@CustomOp.register("replicated_linear")
class ReplicatedLinear(LinearBase):
    """The full weight on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, skip_bias_add: bool = False,
                 params_dtype: torch.dtype | None = None, quant_config: object = None, prefix: str = "", *,
                 return_bias: bool = True, disable_tp: bool = False) -> None:
        super().__init__(input_size, output_size, skip_bias_add, params_dtype, quant_config, prefix,
                         return_bias=return_bias, disable_tp=disable_tp)
        self.weight = _param((output_size, input_size), self.params_dtype, self.weight_loader)
        self.bias = _param((output_size,), self.params_dtype, self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        _copy_slice(type(self).__name__, param, loaded_weight, None, 0, 0, 0)

    def forward_native(self, x: torch.Tensor):
        self._check_input(x, self.input_size)
        return self._out(linear(x, self.weight, self._fused_bias()))

    def forward_cpu(self, x: torch.Tensor):
        self._check_input(x, self.input_size)
        return self._out(cpu_linear(x, self.weight, self._fused_bias()))


@CustomOp.register("column_parallel_linear")
class ColumnParallelLinear(LinearBase):
    """Output features split over ranks: rank r holds rows ``[r·n/tp, (r+1)·n/tp)`` of W and b.
    With ``skip_bias_add`` the returned bias is this rank's shard, even when ``gather_output``
    gathers the output (vLLM's behaviour)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = False,
                 skip_bias_add: bool = False, params_dtype: torch.dtype | None = None,
                 quant_config: object = None, output_sizes: list[int] | None = None, prefix: str = "", *,
                 return_bias: bool = True, disable_tp: bool = False) -> None:
        super().__init__(input_size, output_size, skip_bias_add, params_dtype, quant_config, prefix,
                         return_bias=return_bias, disable_tp=disable_tp)
        self.gather_output = gather_output
        self.output_sizes = list(output_sizes) if output_sizes is not None else [output_size]
        name = type(self).__name__
        self.output_partition_sizes = [self.tp.shard_size(n, f"{name} output_size") for n in self.output_sizes]
        self.output_size_per_partition = sum(self.output_partition_sizes)
        self.weight = _param((self.output_size_per_partition, input_size), self.params_dtype, self.weight_loader,
                             output_dim=0, input_dim=1)
        self.bias = _param((self.output_size_per_partition,), self.params_dtype, self.weight_loader,
                           output_dim=0) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        local = self.output_size_per_partition
        _copy_slice(type(self).__name__, param, loaded_weight, 0, self.output_size, self.tp_rank * local, local,
                    tp=self.tp)

    def forward_native(self, x: torch.Tensor):
        self._check_input(x, self.input_size)
        return self._out(column_parallel_linear(x, self.weight, self._fused_bias(), self.tp, self.gather_output))

    def forward_cpu(self, x: torch.Tensor):
        self._check_input(x, self.input_size)
        return self._out(column_parallel_linear(x, self.weight, self._fused_bias(), self.tp, self.gather_output,
                                                gemm=cpu_linear))


@CustomOp.register("merged_column_parallel_linear")
class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices fused along the output dim (gate and up of a gated MLP).
    Each is split separately: rank r holds ``[gate_r; up_r]``, not a slice of ``[gate; up]``.

    ``weight_loader(param, w, shard_id)``: ``w`` is the full sub-matrix ``shard_id`` (0 gate, 1 up),
    or with ``shard_id=None`` the full fused ``[gate; up]`` as some checkpoints store it.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = True, gather_output: bool = False,
                 skip_bias_add: bool = False, params_dtype: torch.dtype | None = None,
                 quant_config: object = None, prefix: str = "", *, return_bias: bool = True,
                 disable_tp: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias, gather_output, skip_bias_add, params_dtype,
                         quant_config, output_sizes, prefix, return_bias=return_bias, disable_tp=disable_tp)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:
            _split_fused(type(self).__name__, self.weight_loader, param, loaded_weight, self.output_sizes)
            return
        if not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"{type(self).__name__}.weight_loader: shard_id {shard_id} is not in "
                             f"[0, {len(self.output_sizes)})")
        local = self.output_partition_sizes[shard_id]
        _copy_slice(f"{type(self).__name__}[{shard_id}]", param, loaded_weight, 0, self.output_sizes[shard_id],
                    self.tp_rank * local, local, dst_start=sum(self.output_partition_sizes[:shard_id]), tp=self.tp)


@CustomOp.register("qkv_parallel_linear")
class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections fused, split by attention head. With fewer KV heads than ranks each KV
    head is replicated on ``tp_size / total_num_kv_heads`` consecutive ranks (rank r holds KV head
    ``r // replicas``), as in vLLM. ``weight_loader(param, w, shard_id)`` with ``shard_id`` in
    ``"q" | "k" | "v"`` (the full projection) or None (the full fused ``[q; k; v]``)."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int | None = None, bias: bool = True, skip_bias_add: bool = False,
                 params_dtype: torch.dtype | None = None, quant_config: object = None, prefix: str = "", *,
                 return_bias: bool = True, disable_tp: bool = False, v_head_size: int | None = None) -> None:
        tp = TPGroup() if disable_tp else get_tp_group()
        name = type(self).__name__
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        v_head_size = v_head_size or head_size
        num_heads = tp.shard_size(total_num_heads, f"{name} total_num_heads")
        if tp.tp_size >= total_num_kv_heads:
            if tp.tp_size % total_num_kv_heads:
                raise ValueError(f"{name}: tp_size={tp.tp_size} is not a multiple of total_num_kv_heads="
                                 f"{total_num_kv_heads}, so KV heads cannot be replicated evenly")
            num_kv_heads, replicas = 1, tp.tp_size // total_num_kv_heads
        else:
            num_kv_heads, replicas = tp.shard_size(total_num_kv_heads, f"{name} total_num_kv_heads"), 1
        local = [num_heads * head_size, num_kv_heads * head_size, num_kv_heads * v_head_size]
        # output_size counts replicated KV heads once per rank, as vLLM's does.
        super().__init__(hidden_size, sum(local) * tp.tp_size, bias, False, skip_bias_add, params_dtype,
                         quant_config, [n * tp.tp_size for n in local], prefix, return_bias=return_bias,
                         disable_tp=disable_tp)
        self.head_size, self.v_head_size = head_size, v_head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads, self.num_kv_heads, self.num_kv_head_replicas = num_heads, num_kv_heads, replicas
        self.q_size, self.kv_size, self.v_size = local
        # What the checkpoint holds: the unreplicated q, k and v projections.
        self.full_sizes = {"q": total_num_heads * head_size, "k": total_num_kv_heads * head_size,
                           "v": total_num_kv_heads * v_head_size}

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | None = None) -> None:
        name = type(self).__name__
        if shard_id is None:
            fused = [self.full_sizes[k] for k in "qkv"]
            _split_fused(name, self.weight_loader, param, loaded_weight, fused, ids="qkv")
            return
        if shard_id not in ("q", "k", "v"):
            raise ValueError(f"{name}.weight_loader: shard_id must be 'q', 'k', 'v' or None, got {shard_id!r}")
        index = "qkv".index(shard_id)
        local = self.output_partition_sizes[index]
        owner = self.tp_rank if shard_id == "q" else self.tp_rank // self.num_kv_head_replicas
        _copy_slice(f"{name}[{shard_id}]", param, loaded_weight, 0, self.full_sizes[shard_id], owner * local, local,
                    dst_start=sum(self.output_partition_sizes[:index]), tp=self.tp)


def _split_fused(layer: str, load: Callable, param: nn.Parameter, fused: torch.Tensor, sizes: list[int],
                 ids: Sequence = ()) -> None:
    """Loads a fused checkpoint tensor (sub-matrices stacked on dim 0) one sub-matrix at a time."""
    if fused.shape[0] != sum(sizes):
        raise ValueError(f"{layer}.weight_loader: the fused tensor has {fused.shape[0]} rows, expected "
                         f"{sum(sizes)} = {' + '.join(map(str, sizes))}")
    for i, part in enumerate(fused.split(sizes, dim=0)):
        load(param, part, ids[i] if ids else i)


@CustomOp.register("row_parallel_linear")
class RowParallelLinear(LinearBase):
    """Input features split over ranks: rank r holds columns ``[r·k/tp, (r+1)·k/tp)`` of W; the bias
    is whole on every rank and added on rank 0 only; ``reduce_results`` all-reduces the sum."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, input_is_parallel: bool = True,
                 skip_bias_add: bool = False, params_dtype: torch.dtype | None = None, reduce_results: bool = True,
                 quant_config: object = None, prefix: str = "", *, return_bias: bool = True,
                 disable_tp: bool = False) -> None:
        super().__init__(input_size, output_size, skip_bias_add, params_dtype, quant_config, prefix,
                         return_bias=return_bias, disable_tp=disable_tp)
        if not reduce_results and bias and not skip_bias_add:
            # Each rank's partial sum would carry its own bias (or only rank 0's would): a wrong total.
            raise ValueError("RowParallelLinear: with reduce_results=False the bias must be skipped "
                             "(skip_bias_add=True) or disabled, or the sum would be wrong")
        self.input_is_parallel, self.reduce_results = input_is_parallel, reduce_results
        self.input_size_per_partition = self.tp.shard_size(input_size, "RowParallelLinear input_size")
        self.weight = _param((output_size, self.input_size_per_partition), self.params_dtype, self.weight_loader,
                             output_dim=0, input_dim=1)
        self.bias = _param((output_size,), self.params_dtype, self.weight_loader, output_dim=0) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        name = type(self).__name__
        if param.dim() == 1:  # the bias is whole on every rank
            _copy_slice(name, param, loaded_weight, None, 0, 0, 0)
            return
        local = self.input_size_per_partition
        _copy_slice(name, param, loaded_weight, 1, self.input_size, self.tp_rank * local, local, tp=self.tp)

    def _rank_bias(self) -> torch.Tensor | None:
        return None if self.tp_rank > 0 else self._fused_bias()

    def _check(self, x: torch.Tensor) -> None:
        if self.input_is_parallel:
            self._check_input(x, self.input_size_per_partition,
                              f"input_size_per_partition: input_is_parallel=True, tp_size={self.tp_size}")
        else:
            self._check_input(x, self.input_size, "input_size: input_is_parallel=False")

    def forward_native(self, x: torch.Tensor):
        self._check(x)
        return self._out(row_parallel_linear(x, self.weight, self._rank_bias(), self.tp, self.input_is_parallel,
                                             self.reduce_results))

    def forward_cpu(self, x: torch.Tensor):
        self._check(x)
        return self._out(row_parallel_linear(x, self.weight, self._rank_bias(), self.tp, self.input_is_parallel,
                                             self.reduce_results, gemm=cpu_linear))
