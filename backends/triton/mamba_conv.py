"""Triton kernels of the causal depthwise conv1d with its state cache (the state-space family):
``customop::causal_conv1d_fn`` (varlen prefill) and ``customop::causal_conv1d_update`` (decode).

Prefill is two launches, in stream order: every (token block, channel block) program computes its
outputs independently (a tap that reaches before its request's first token reads the cached state,
or zero), then one program per (request, channel block) writes the request's last ``K - 1``
inputs into its slot. Splitting the two keeps the output fully parallel over tokens and no
program reads a state another may be writing. The token -> request map is one ``searchsorted``
on the device (no host sync). Decode is one program per (request, channel block): read the
window, write the output and the shifted window.

Numerics as the spec (``customop/math/mamba.py``): inputs rounded to the cache's dtype, fp32
accumulation, output in x's dtype. Offsets into the cache and the tokens are int64 (slots x
channels x width passes 2**31 in a large cache). ``K`` is a compile-time constant (any K >= 2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from customop.backends.triton._common import device_guard, next_pow2, silu

#: channels per program: 16-byte loads of a token's channel run in bf16 and enough programs at
#: decode batch sizes; tokens per prefill program: the taps reuse the block's rows from L1. 16 x 128
#: at 8 warps compiles for sm_90 without spills (124 registers; 32 x 128 at 4 warps spilled: the
#: int64 pointer tiles take two registers an element) - not yet timed on a GPU
BLOCK_C = 128
BLOCK_T = 16


@triton.jit
def _conv_fwd_kernel(
    x_ptr, w_ptr, b_ptr, state_ptr, out_ptr, qsl_ptr, slot_ptr, init_ptr, seq_ptr,
    n_tokens, n_channels, null_slot,
    sx_t, sx_c, sw_c, sw_k, ss_s, ss_c, ss_w,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_ok, c_ok = t < n_tokens, c < n_channels
    seq = tl.load(seq_ptr + t, mask=t_ok, other=0)
    start = tl.load(qsl_ptr + seq, mask=t_ok, other=0)
    slot = tl.load(slot_ptr + seq, mask=t_ok, other=0)
    from_state = (tl.load(init_ptr + seq, mask=t_ok, other=0) != 0) & (slot >= 0) & (slot != null_slot)
    state_row = state_ptr + tl.maximum(slot, 0).to(tl.int64) * ss_s
    c64 = c.to(tl.int64)
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(K):
        src = t - (K - 1) + k  # the token this tap reads; before `start` it is in the cached window
        in_x = src >= start
        m_x = (t_ok & in_x)[:, None] & c_ok[None, :]
        xv = tl.load(x_ptr + src.to(tl.int64)[:, None] * sx_t + c64[None, :] * sx_c, mask=m_x, other=0.0)
        xv = xv.to(state_ptr.dtype.element_ty).to(tl.float32)
        col = (K - 1) + (src - start)
        m_s = (t_ok & ~in_x & from_state)[:, None] & c_ok[None, :]
        sv = tl.load(state_row[:, None] + c64[None, :] * ss_c + col[:, None] * ss_w, mask=m_s, other=0.0)
        w = tl.load(w_ptr + c * sw_c + k * sw_k, mask=c_ok, other=0.0).to(tl.float32)
        acc += tl.where(in_x[:, None], xv, sv.to(tl.float32)) * w[None, :]
    if SILU:
        acc = silu(acc)
    out = out_ptr + t.to(tl.int64)[:, None] * n_channels + c64[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & c_ok[None, :])


@triton.jit
def _conv_state_kernel(
    x_ptr, state_ptr, qsl_ptr, slot_ptr, init_ptr, n_channels, null_slot,
    sx_t, sx_c, ss_s, ss_c, ss_w, K: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Column j of the new window is input ``L + j`` of ``[old window (K-1) | the L tokens]``."""
    seq = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < n_channels
    start, end = tl.load(qsl_ptr + seq), tl.load(qsl_ptr + seq + 1)
    slot = tl.load(slot_ptr + seq)
    if (end > start) & (slot >= 0) & (slot != null_slot):
        from_state = tl.load(init_ptr + seq) != 0
        row = state_ptr + slot.to(tl.int64) * ss_s + c.to(tl.int64) * ss_c
        n = end - start
        # Increasing j: column j is written only after column n + j > j was read, so no read
        # sees a column this loop already replaced.
        for j in tl.static_range(K - 1):
            p = n + j - (K - 1)  # the token index within the request, or before it: the old window
            xv = tl.load(x_ptr + (start + p).to(tl.int64) * sx_t + c.to(tl.int64) * sx_c, mask=c_ok & (p >= 0),
                         other=0.0).to(state_ptr.dtype.element_ty)
            sv = tl.load(row + (n + j) * ss_w, mask=c_ok & (p < 0) & from_state, other=0.0)
            tl.store(row + j * ss_w, tl.where(p >= 0, xv, sv), mask=c_ok)


@triton.jit
def _conv_update_kernel(
    x_ptr, w_ptr, b_ptr, state_ptr, out_ptr, slot_ptr, n_channels, null_slot,
    sx_b, sx_c, sw_c, sw_k, ss_s, ss_c, ss_w,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_C: tl.constexpr,
):
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < n_channels
    slot = tl.load(slot_ptr + b)
    real = (slot >= 0) & (slot != null_slot)  # padding: a zero window, no write
    row = state_ptr + tl.maximum(slot, 0).to(tl.int64) * ss_s + c.to(tl.int64) * ss_c
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
    # column j is read before column j - 1 is rewritten with it: the shift happens in place
    for j in tl.static_range(K - 1):
        s = tl.load(row + j * ss_w, mask=c_ok & real, other=0.0)
        acc += s.to(tl.float32) * tl.load(w_ptr + c * sw_c + j * sw_k, mask=c_ok, other=0.0).to(tl.float32)
        if j > 0:
            tl.store(row + (j - 1) * ss_w, s, mask=c_ok & real)
    xv = tl.load(x_ptr + b.to(tl.int64) * sx_b + c * sx_c, mask=c_ok, other=0.0).to(state_ptr.dtype.element_ty)
    acc += xv.to(tl.float32) * tl.load(w_ptr + c * sw_c + (K - 1) * sw_k, mask=c_ok, other=0.0).to(tl.float32)
    tl.store(row + (K - 2) * ss_w, xv, mask=c_ok & real)
    if SILU:
        acc = silu(acc)
    tl.store(out_ptr + b.to(tl.int64) * n_channels + c, acc.to(out_ptr.dtype.element_ty), mask=c_ok)


def token_requests(query_start_loc: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """The request of each token (int32), on the device: no host sync."""
    tokens = torch.arange(n_tokens, device=query_start_loc.device, dtype=query_start_loc.dtype)
    return torch.searchsorted(query_start_loc[1:].contiguous(), tokens, right=True).to(torch.int32)


def _block_c(n_channels: int) -> int:
    return min(BLOCK_C, max(16, next_pow2(n_channels)))


def causal_conv1d_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_states: torch.Tensor,
                     query_start_loc: torch.Tensor, cache_indices: torch.Tensor, has_initial_state: torch.Tensor,
                     silu: bool, null_block_id: int) -> torch.Tensor:
    T, C = x.shape
    K = weight.shape[1]
    out = torch.empty((T, C), dtype=x.dtype, device=x.device)
    S = cache_indices.shape[0]
    if T == 0 or S == 0:
        return out
    qsl, slots = query_start_loc.to(torch.int32), cache_indices.to(torch.int32)
    init = has_initial_state.to(torch.int8)
    bc = _block_c(C)
    strides = (x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), *conv_states.stride())
    with device_guard(x.device):
        _conv_fwd_kernel[(triton.cdiv(T, BLOCK_T), triton.cdiv(C, bc))](
            x, weight, bias if bias is not None else weight, conv_states, out, qsl, slots, init,
            token_requests(qsl, T), T, C, null_block_id, *strides,
            K=K, HAS_BIAS=bias is not None, SILU=silu, BLOCK_T=BLOCK_T, BLOCK_C=bc,
            num_warps=8 if BLOCK_T * bc >= 2048 else 4)
        _conv_state_kernel[(S, triton.cdiv(C, bc))](
            x, conv_states, qsl, slots, init, C, null_block_id, x.stride(0), x.stride(1), *conv_states.stride(),
            K=K, BLOCK_C=bc)
    return out


def causal_conv1d_update(x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         cache_indices: torch.Tensor, silu: bool, null_block_id: int) -> torch.Tensor:
    B, C = x.shape
    out = torch.empty((B, C), dtype=x.dtype, device=x.device)
    if B == 0:
        return out
    bc = _block_c(C)
    with device_guard(x.device):
        _conv_update_kernel[(B, triton.cdiv(C, bc))](
            x, weight, bias if bias is not None else weight, conv_states, out, cache_indices.to(torch.int32), C,
            null_block_id, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), *conv_states.stride(),
            K=weight.shape[1], HAS_BIAS=bias is not None, SILU=silu, BLOCK_C=bc)
    return out


KERNELS = {
    "customop::causal_conv1d_fn": causal_conv1d_fn,
    "customop::causal_conv1d_update": causal_conv1d_update,
}
