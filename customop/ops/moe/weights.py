"""The experts' weights: creation in vLLM's layout and ``weight_loader`` for per-expert checkpoints.

Layout on each rank: ``w13_weight [E_local, 2 I, H]`` (gate rows ``[0, I)``, up rows ``[I, 2I)``;
for ``swigluoai`` gate and up interleaved by row, gate first), ``w2_weight [E_local, H, I]``,
and with ``has_bias`` ``w13_bias [E_local, 2I]`` (same row order), ``w2_bias [E_local, H]``.
``I`` is this rank's slice of the intermediate size under tensor parallelism.

``weight_loader(param, loaded_weight, weight_name, shard_id, expert_id)`` (vLLM's signature) takes
the checkpoint tensor of one expert (global id; experts held by another rank are skipped) and
copies this rank's slice: ``shard_id`` ``"w1"`` (gate ``[I_full, H]``), ``"w3"`` (up), ``"w2"``
(down ``[H, I_full]``), or ``"w13"`` (the fused gate/up tensor ``[2 I_full, H]`` in the layer's
own row order, as gpt-oss checkpoints store it). Biases take the same shard ids with the last
dimension dropped. ``expert_id=None`` loads every expert from a tensor with a leading ``[E]``.
"""

from __future__ import annotations

import torch
from torch import nn

SHARD_IDS = ("w1", "w2", "w3", "w13")


def create_weights(layer: nn.Module, num_local: int, hidden: int, inter: int, dtype: torch.dtype,
                   has_bias: bool) -> None:
    """Registers the parameters (uninitialised, ``requires_grad=False``: inference weights)."""
    shapes = {"w13_weight": (num_local, 2 * inter, hidden), "w2_weight": (num_local, hidden, inter)}
    if has_bias:
        shapes.update(w13_bias=(num_local, 2 * inter), w2_bias=(num_local, hidden))
    for name, shape in shapes.items():
        param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        param.weight_loader = layer.weight_loader  # vLLM's loading loop looks it up on the parameter
        layer.register_parameter(name, param)
    if not has_bias:
        layer.register_parameter("w13_bias", None)
        layer.register_parameter("w2_bias", None)


def _local_expert(layer, expert_id: int) -> int:
    if not 0 <= expert_id < layer.global_num_experts:
        raise ValueError(f"customop fused_moe.weight_loader: expert_id={expert_id} is not in "
                         f"[0, {layer.global_num_experts})")
    if layer.expert_map is None:
        return expert_id
    return int(layer.expert_map[expert_id])


def _gate_up_rows(layer, half: str) -> slice:
    """The rows of w13 that hold this rank's gate (``w1``) or up (``w3``) rows."""
    inter = layer.intermediate_size_per_partition
    if layer.interleaved:
        return slice(0 if half == "w1" else 1, 2 * inter, 2)
    return slice(0, inter) if half == "w1" else slice(inter, 2 * inter)


def _tp_slice(layer, full: torch.Tensor, dim: int, what: str) -> torch.Tensor:
    inter, rank = layer.intermediate_size_per_partition, layer.tp_rank
    expected = inter * layer.tp_size
    if full.shape[dim] != expected:
        raise ValueError(f"customop fused_moe.weight_loader: {what} has {full.shape[dim]} intermediate rows/columns "
                         f"(dim {dim}, shape {tuple(full.shape)}), expected intermediate_size={expected}")
    return full.narrow(dim, rank * inter, inter)


def _fused_w13_slice(layer, full: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a full fused gate/up tensor ``[2 I_full, ...]`` in the layer's order."""
    inter, rank, tp = layer.intermediate_size_per_partition, layer.tp_rank, layer.tp_size
    if full.shape[0] != 2 * inter * tp:
        raise ValueError(f"customop fused_moe.weight_loader: w13 has {full.shape[0]} rows, expected "
                         f"2 * intermediate_size = {2 * inter * tp}")
    if layer.interleaved:  # (gate, up) row pairs: this rank's pairs are contiguous
        return full.narrow(0, 2 * inter * rank, 2 * inter)
    half = inter * tp
    return torch.cat([full.narrow(0, rank * inter, inter), full.narrow(0, half + rank * inter, inter)])


def load_expert(layer, param: nn.Parameter, loaded: torch.Tensor, shard_id: str, expert_id: int) -> bool:
    """Copies this rank's part of one expert's ``loaded`` tensor into ``param``; False when the
    expert lives on another rank (nothing to do)."""
    if shard_id not in SHARD_IDS:
        raise ValueError(f"customop fused_moe.weight_loader: shard_id must be one of {SHARD_IDS}, got {shard_id!r}")
    names = {id(p): n for n, p in layer.named_parameters(recurse=False)}
    name = names.get(id(param))
    if name is None:
        raise ValueError("customop fused_moe.weight_loader: param is not a parameter of this layer")
    is_w13 = name.startswith("w13")
    if is_w13 != (shard_id != "w2"):
        raise ValueError(f"customop fused_moe.weight_loader: shard_id {shard_id!r} does not load {name}")
    local = _local_expert(layer, expert_id)
    if local < 0:
        return False
    target = param.data[local]
    is_bias = name.endswith("bias")
    with torch.no_grad():
        if shard_id == "w2":
            # down_proj: its input (intermediate) dim is split; the bias is not (every rank holds it)
            src = loaded if is_bias else _tp_slice(layer, loaded, 1, "w2")
            _copy(target, src, name)
        elif shard_id == "w13":
            _copy(target, _fused_w13_slice(layer, loaded), name)
        else:
            _copy(target[_gate_up_rows(layer, shard_id)], _tp_slice(layer, loaded, 0, shard_id), name)
    return True


def _copy(target: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if src.shape != target.shape:
        raise ValueError(f"customop fused_moe.weight_loader: {name} expects {tuple(target.shape)} per expert "
                         f"on this rank, got {tuple(src.shape)}")
    target.copy_(src)
