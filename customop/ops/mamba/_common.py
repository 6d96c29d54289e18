"""What the state-space ops share: the per-path implementations of the conv and scan steps, the
input checks (one place, every path) and the batch plumbing (decode rows first, then prefills).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from customop.backends.cpu import CpuTiers
from customop.backends.cpu import mamba as cpu
from customop.math import mamba as spec
from customop.math.mamba import NULL_BLOCK_ID, MambaMetadata

# ---- the steps each path runs -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Steps:
    """The conv and scan steps of one path; every step has its ``customop::`` op's signature."""

    conv_fn: Callable
    conv_update: Callable
    selective_scan: Callable
    state_update: Callable
    ssd: Callable  # Mamba-2 prefill


def _ssd_recurrent(x, dt, A, B, C, D, dt_bias, ssm_states, query_start_loc, cache_indices, has_initial_state,
                   chunk_size, dt_softplus, null_block_id):
    """``customop::ssd_chunk_scan``'s signature; the recurrence ignores the chunk size."""
    return spec.ssd_recurrent(x, dt, A, B, C, D, dt_bias, ssm_states, query_start_loc, cache_indices,
                              has_initial_state, dt_softplus, null_block_id)


#: forward_native: the spec, token by token (Mamba-2 prefill: the recurrence, not the chunked form)
NATIVE = Steps(spec.causal_conv1d_varlen, spec.causal_conv1d_update, spec.selective_scan_varlen,
               spec.selective_state_update, _ssd_recurrent)
#: forward_cpu: the spec's math batched over requests and tokens (backends/cpu/mamba.py)
CPU = Steps(cpu.causal_conv1d_varlen, cpu.causal_conv1d_update, cpu.selective_scan_varlen,
            cpu.selective_state_update, cpu.ssd_prefill)


def _kernel_steps() -> Steps:
    ops = torch.ops.customop
    return Steps(ops.causal_conv1d_fn, ops.causal_conv1d_update, ops.selective_scan, ops.selective_state_update,
                 ops.ssd_chunk_scan)


#: The mixers' CPU path never compiles: the batch layout (request lengths, slots) is read on the
#: host, so Inductor would break the graph and recompile per batch shape; the CPU steps above are
#: already one batched kernel per step or a chunked matmul form (docs/mamba.md, "CPU").
MIXER_CPU_TIERS = CpuTiers(min_numel=math.inf, rows=False, dynamic=False)


# ---- checks ---------------------------------------------------------------------------------------


def check_hidden(op: str, h: torch.Tensor, hidden: int) -> None:
    if not h.is_floating_point():
        raise TypeError(f"customop.{op}: hidden_states must be a floating-point tensor, got {h.dtype}")
    if h.dim() != 2 or h.shape[1] != hidden:
        raise ValueError(f"customop.{op}: hidden_states has shape {tuple(h.shape)}, expected (tokens, {hidden})")


def _check_index(op: str, name: str, t: torch.Tensor | None, shape: tuple[int, ...], device: torch.device,
                 dtype: torch.dtype | None = None) -> None:
    if t is None:
        raise ValueError(f"customop.{op}: metadata.{name} is None but the batch needs it")
    if tuple(t.shape) != shape:
        raise ValueError(f"customop.{op}: metadata.{name} has shape {tuple(t.shape)}, expected {shape}")
    if (dtype is None and (t.is_floating_point() or t.dtype == torch.bool)) or (dtype is not None and t.dtype != dtype):
        raise TypeError(f"customop.{op}: metadata.{name} has dtype {t.dtype}, expected {dtype or 'an integer dtype'}")
    if t.device != device:
        raise ValueError(f"customop.{op}: metadata.{name} is on {t.device} but hidden_states is on {device}")


def check_metadata(op: str, meta: MambaMetadata, tokens: int, device: torch.device,
                   chunked: bool = False) -> None:
    """The batch description against the token count; host-side facts only (shapes, dtypes,
    devices): slot values and offsets live on the device and are not read here."""
    if not isinstance(meta, MambaMetadata):
        raise TypeError(f"customop.{op}: metadata must be a customop.math.mamba.MambaMetadata, got {type(meta).__name__}")
    if min(meta.num_decodes, meta.num_prefills, meta.num_prefill_tokens) < 0:
        raise ValueError(f"customop.{op}: metadata counts must be >= 0")
    if meta.num_actual_tokens > tokens:
        raise ValueError(f"customop.{op}: metadata describes {meta.num_decodes} decode + {meta.num_prefill_tokens} "
                         f"prefill tokens but hidden_states has {tokens} rows")
    if meta.num_decodes:
        d = meta.state_indices_tensor_d
        if d is not None and d.dim() == 2 and d.shape[1] != 1:
            raise NotImplementedError(f"customop.{op}: state_indices_tensor_d of shape {tuple(d.shape)}: "
                                      "speculative decoding (several tokens per decode request) is not supported")
        _check_index(op, "state_indices_tensor_d", meta.decode_slots, (meta.num_decodes,), device)
    if meta.num_prefills:
        n = meta.num_prefills
        _check_index(op, "query_start_loc_p", meta.query_start_loc_p, (n + 1,), device)
        _check_index(op, "state_indices_tensor_p", meta.state_indices_tensor_p, (n,), device)
        _check_index(op, "has_initial_states_p", meta.has_initial_states_p, (n,), device, torch.bool)
    elif meta.num_prefill_tokens:
        raise ValueError(f"customop.{op}: metadata has {meta.num_prefill_tokens} prefill tokens but no prefill request")
    if chunked and (meta.chunk_size < 1 or meta.chunk_size & (meta.chunk_size - 1)):
        raise ValueError(f"customop.{op}: metadata.chunk_size={meta.chunk_size} must be a power of two")


def check_cache(op: str, name: str, cache: torch.Tensor, tail: tuple[int, ...], device: torch.device,
                min_width: int | None = None) -> None:
    """``cache`` is float ``(slots, *tail)`` on ``device``; with ``min_width`` (a conv cache
    ``(slots, width, C)``) ``tail[0]`` is a lower bound of the width."""
    if not isinstance(cache, torch.Tensor) or not cache.is_floating_point():
        raise TypeError(f"customop.{op}: {name} must be a floating-point tensor")
    shape = tuple(cache.shape)
    ok = len(shape) == len(tail) + 1 and (
        shape[2:] == tail[1:] and shape[1] >= min_width if min_width is not None else shape[1:] == tail)
    if not ok:
        want = f"(slots, >={min_width}, {tail[1]})" if min_width is not None else f"(slots, {', '.join(map(str, tail))})"
        raise ValueError(f"customop.{op}: {name} has shape {shape}, expected {want}")
    if cache.device != device:
        raise ValueError(f"customop.{op}: {name} is on {cache.device} but hidden_states is on {device}")


def check_state_caches(op: str, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                       shapes: tuple[tuple[int, ...], tuple[int, ...]], device: torch.device) -> None:
    """A mixer's two caches: each of its per-slot shape (``get_state_shape()``), same slot count."""
    conv_shape, ssm_shape = shapes
    check_cache(op, "conv_state", conv_state, conv_shape, device, min_width=conv_shape[0])
    check_cache(op, "ssm_state", ssm_state, ssm_shape, device)
    if conv_state.shape[0] != ssm_state.shape[0]:
        raise ValueError(f"customop.{op}: conv_state has {conv_state.shape[0]} slots, ssm_state {ssm_state.shape[0]}")


def check_activation(op: str, activation: str) -> None:
    if activation not in ("silu", "swish"):
        raise ValueError(f"customop.{op}: activation={activation!r}: the conv supports 'silu' (or 'swish') only")


# ---- batch plumbing ---------------------------------------------------------------------------------


def conv_step(steps: Steps, x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None, meta: MambaMetadata, silu: bool) -> torch.Tensor:
    """The conv over ``x = [decode rows | prefill rows]`` (``(tokens, C)``); ``conv_state`` is the
    user's ``(slots, width, C)`` cache, seen by the steps as ``(slots, C, width)``."""
    view, nd, parts = conv_state.transpose(1, 2), meta.num_decodes, []
    if nd:
        parts.append(steps.conv_update(x[:nd], view, weight, bias, meta.decode_slots, silu, NULL_BLOCK_ID))
    if meta.num_prefills:
        parts.append(steps.conv_fn(x[nd:], weight, bias, view, meta.query_start_loc_p, meta.state_indices_tensor_p,
                                   meta.has_initial_states_p, silu, NULL_BLOCK_ID))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def project(layer, x: torch.Tensor, path: str) -> torch.Tensor:
    """A linear sub-layer on ``path``'s route: its spec, its CPU path, or its own dispatch."""
    out = {"native": layer.forward_native, "cpu": layer.forward_cpu}.get(path, layer)(x)
    return out[0] if isinstance(out, tuple) else out


def sub_op(op, path: str):
    """A CustomOp sub-layer's forward on ``path``'s route."""
    return {"native": op.forward_native, "cpu": op.forward_cpu}.get(path, op)


def padded_output(h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (the batch's rows) in a ``hidden_states``-shaped tensor; padding rows are zero."""
    if out.shape[0] == h.shape[0]:
        return out
    full = out.new_zeros(h.shape[0], out.shape[1])
    full[:out.shape[0]] = out
    return full
