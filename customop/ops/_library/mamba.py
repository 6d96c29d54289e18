"""Kernel entry points of the state-space family: ``torch.ops.customop.{causal_conv1d_fn,
causal_conv1d_update, selective_scan, selective_state_update, ssd_chunk_scan,
mixer2_gated_rms_norm}``.

The schemas are the contract with the backends (Triton for CUDA/ROCm/XPU) that register device
kernels for them; do not change them. Tensors are token-major: ``x (T, C)`` for the conv,
``x (T, H, P)`` for the scans (Mamba-1 is one head: ``H = 1, P = D``). The caches are written IN
PLACE (declared in the schemas): ``conv_states`` is the ``(slots, C, width)`` view of a conv cache
(any strides; vLLM's ``(slots, width, C)`` buffer transposed), ``ssm_states`` is
``(slots, H, P, N)``. The batch, slot and padding rules are ``customop/math/mamba.py``'s: a
request whose slot is negative or ``null_block_id`` is computed from zero states and touches no
cache slot; a request without tokens is skipped.

The bodies are the reference (the spec: ``customop/math/mamba.py``), which runs on any device;
the fakes give shapes only.
"""

from __future__ import annotations

import torch

from customop.math import mamba as _math

Tensor = torch.Tensor

#: Written out rather than inferred so that the contract reads exactly as the backends see it.
SCHEMAS = {
    # prefill: x (T, C), weight (C, K), conv_states (slots, C, width >= K-1); -> (T, C), x's dtype
    "causal_conv1d_fn": "(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) conv_states, Tensor query_start_loc, "
                        "Tensor cache_indices, Tensor has_initial_state, bool silu, int null_block_id) -> Tensor",
    # decode: one token per request, x (B, C); -> (B, C)
    "causal_conv1d_update": "(Tensor x, Tensor(a!) conv_states, Tensor weight, Tensor? bias, Tensor cache_indices, "
                            "bool silu, int null_block_id) -> Tensor",
    # varlen recurrence: x, dt, z (T, H, P); A (H, P, N); B, C (T, G, N); D, dt_bias (H, P); -> (T, H, P)
    "selective_scan": "(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? z, Tensor? dt_bias, "
                      "Tensor(a!) ssm_states, Tensor query_start_loc, Tensor cache_indices, "
                      "Tensor has_initial_state, bool dt_softplus, int null_block_id) -> Tensor",
    # decode: one token per request, x (B, H, P), same head form; -> (B, H, P)
    "selective_state_update": "(Tensor(a!) ssm_states, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, "
                              "Tensor? D, Tensor? z, Tensor? dt_bias, Tensor cache_indices, bool dt_softplus, "
                              "int null_block_id) -> Tensor",
    # Mamba-2 prefill, chunked: x (T, H, P), dt (T, H), A, D, dt_bias (H,), B, C (T, G, N); -> (T, H, P)
    "ssd_chunk_scan": "(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? dt_bias, "
                      "Tensor(a!) ssm_states, Tensor query_start_loc, Tensor cache_indices, "
                      "Tensor has_initial_state, int chunk_size, bool dt_softplus, int null_block_id) -> Tensor",
    # x, gate (..., hidden); weight None: the gate only (use_rms_norm=False); -> promoted dtype
    "mixer2_gated_rms_norm": "(Tensor x, Tensor gate, Tensor? weight, float eps, int group_size) -> Tensor",
}


def _define(name: str, reference, fake) -> None:
    mutates = tuple(arg for arg in ("conv_states", "ssm_states") if f"Tensor(a!) {arg}" in SCHEMAS[name])
    op = torch.library.custom_op(f"customop::{name}", reference, mutates_args=mutates, schema=SCHEMAS[name])
    op.register_fake(fake)


def _like(x: Tensor, *_args) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _update_fake(ssm_states: Tensor, x: Tensor, *_args) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _norm_fake(x: Tensor, gate: Tensor, weight: Tensor | None, eps: float, group_size: int) -> Tensor:
    dtype = x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype)
    return torch.empty(x.shape, dtype=dtype, device=x.device)


_define("causal_conv1d_fn", _math.causal_conv1d_varlen, _like)
_define("causal_conv1d_update", _math.causal_conv1d_update, _like)
_define("selective_scan", _math.selective_scan_varlen, _like)
_define("selective_state_update", _math.selective_state_update, _update_fake)
_define("ssd_chunk_scan", _math.ssd_chunk_scan, _like)
_define("mixer2_gated_rms_norm", _math.mixer2_gated_rms_norm, _norm_fake)
