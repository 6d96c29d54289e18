"""The ``xla`` kernels of the state-space family's ``torch.ops.customop`` ops (``mamba.py`` has the
JAX side; ``xla_kernels.py`` the bridge these reuse: ``_jax``, ``_pallas``, ``_spec``, and the
``AutogradXLA`` functionalization of ops that write their arguments).

| op | on XLA tensors |
|---|---|
| ``selective_state_update`` | Pallas kernel (decode, Mamba-1 and Mamba-2 head forms) |
| ``ssd_chunk_scan`` | Pallas kernel (Mamba-2 prefill, chunked) |
| ``causal_conv1d_fn``, ``causal_conv1d_update`` | JAX (shifted gathers), compiled by XLA |
| ``selective_scan`` | JAX (``lax.scan`` over the tokens), compiled by XLA |
| ``mixer2_gated_rms_norm`` | no ``xla`` kernel: its reference body runs on the XLA device, fused by XLA |

Every op here but the norm writes a cache in place: the JAX function returns the new cache and the
kernel copies it into the caller's tensor (``x.copy_(new)`` is a rebinding in the lazy graph).
Float inputs in a dtype the kernels do not take (fp64) run the op's spec (``customop/math/mamba.py``)
on CPU copies (``_reference`` says why not on the XLA device, as the other families do). Slot
numbers and offsets stay on the device (int32: JAX traces without x64). Run only in emulation:
the XLA CPU device, Pallas in interpret mode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from customop.backends.tpu import mamba
from customop.backends.tpu import xla_kernels as xk
from customop.math import mamba as spec

Tensor = torch.Tensor


def _reference(fn: Callable[..., Any], cache_at: int, *args: Any) -> Tensor:
    """The fp64 exception: the spec on CPU copies, its output and the cache it wrote copied back.
    The spec reads the batch layout on the host (``tolist``), which a functionalized call cannot
    (``xla_kernels._spec``), and its per-token writes go through views, which raw XLA tensors
    (below functionalization, where kernels run) do not carry back. Exact, and slow."""
    host = [a.cpu() if isinstance(a, Tensor) else a for a in args]
    out = fn(*host)
    args[cache_at].copy_(host[cache_at].to(args[cache_at].device))
    return out.to(args[cache_at].device)


def _ints(t: Tensor) -> Tensor:
    return t.to(torch.int32)


def causal_conv1d_fn(x: Tensor, weight: Tensor, bias: Tensor | None, conv_states: Tensor, query_start_loc: Tensor,
                     cache_indices: Tensor, has_initial_state: Tensor, silu: bool, null_block_id: int) -> Tensor:
    if not xk._takes(x, weight, bias, conv_states):
        return _reference(spec.causal_conv1d_varlen, 3, x, weight, bias, conv_states, query_start_loc, cache_indices,
                        has_initial_state, silu, null_block_id)
    out, new = xk._jax(mamba.causal_conv1d_fn, x, weight, bias, conv_states, _ints(query_start_loc),
                       _ints(cache_indices), _ints(has_initial_state), silu=silu, null_block_id=null_block_id)
    conv_states.copy_(new)
    return out


def causal_conv1d_update(x: Tensor, conv_states: Tensor, weight: Tensor, bias: Tensor | None, cache_indices: Tensor,
                         silu: bool, null_block_id: int) -> Tensor:
    if not xk._takes(x, weight, bias, conv_states):
        return _reference(spec.causal_conv1d_update, 1, x, conv_states, weight, bias, cache_indices, silu,
                          null_block_id)
    out, new = xk._jax(mamba.causal_conv1d_update, x, conv_states, weight, bias, _ints(cache_indices), silu=silu,
                       null_block_id=null_block_id)
    conv_states.copy_(new)
    return out


def selective_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None, z: Tensor | None,
                   dt_bias: Tensor | None, ssm_states: Tensor, query_start_loc: Tensor, cache_indices: Tensor,
                   has_initial_state: Tensor, dt_softplus: bool, null_block_id: int) -> Tensor:
    if not xk._takes(x, dt, A, B, C, D, z, dt_bias, ssm_states):
        return _reference(spec.selective_scan_varlen, 8, x, dt, A, B, C, D, z, dt_bias, ssm_states, query_start_loc,
                        cache_indices, has_initial_state, dt_softplus, null_block_id)
    y, new = xk._jax(mamba.selective_scan, x, dt, A, B, C, D, z, dt_bias, ssm_states, _ints(query_start_loc),
                     _ints(cache_indices), _ints(has_initial_state), dt_softplus=dt_softplus,
                     null_block_id=null_block_id)
    ssm_states.copy_(new)
    return y


def selective_state_update(ssm_states: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                           D: Tensor | None, z: Tensor | None, dt_bias: Tensor | None, cache_indices: Tensor,
                           dt_softplus: bool, null_block_id: int) -> Tensor:
    if not xk._takes(ssm_states, x, dt, A, B, C, D, z, dt_bias):
        return _reference(spec.selective_state_update, 0, ssm_states, x, dt, A, B, C, D, z, dt_bias, cache_indices,
                        dt_softplus, null_block_id)
    y, new = xk._pallas(mamba.selective_state_update, ssm_states, x, dt, A, B, C, D, z, dt_bias,
                        _ints(cache_indices), dt_softplus=dt_softplus, null_block_id=null_block_id)
    ssm_states.copy_(new)
    return y


def ssd_chunk_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None, dt_bias: Tensor | None,
                   ssm_states: Tensor, query_start_loc: Tensor, cache_indices: Tensor, has_initial_state: Tensor,
                   chunk_size: int, dt_softplus: bool, null_block_id: int) -> Tensor:
    if not xk._takes(x, dt, A, B, C, D, dt_bias, ssm_states):
        return _reference(spec.ssd_chunk_scan, 7, x, dt, A, B, C, D, dt_bias, ssm_states, query_start_loc,
                          cache_indices, has_initial_state, chunk_size, dt_softplus, null_block_id)
    y, new = xk._pallas(mamba.ssd_chunk_scan, x, dt, A, B, C, D, dt_bias, ssm_states, _ints(query_start_loc),
                        _ints(cache_indices), _ints(has_initial_state), chunk_size=chunk_size,
                        dt_softplus=dt_softplus, null_block_id=null_block_id)
    ssm_states.copy_(new)
    return y


#: op name -> xla kernel; every one writes a cache (``IN_PLACE``)
KERNELS: dict[str, Callable[..., Any]] = {
    "causal_conv1d_fn": causal_conv1d_fn,
    "causal_conv1d_update": causal_conv1d_update,
    "selective_scan": selective_scan,
    "selective_state_update": selective_state_update,
    "ssd_chunk_scan": ssd_chunk_scan,
}
IN_PLACE = tuple(KERNELS)


def register() -> None:
    """Registers the kernels above for XLA tensors (once; ``xla_kernels.register_table``)."""
    xk.register_table(__name__, KERNELS, IN_PLACE)
