"""Triton kernel of the selective-scan recurrence (the state-space family):
``customop::selective_scan`` (varlen prefill, Mamba-1) and ``customop::selective_state_update``
(decode, Mamba-1 and Mamba-2), in vLLM's head form (``customop/ops/_library/mamba.py``).

One program owns a ``(BLOCK_P, N)`` tile of one head's state for one request, keeps it in
registers across the request's tokens, and reads and writes the cache once: the state is the
traffic that matters at decode (read + write per token), so nothing else is stored. Decode is the
same kernel over one-token requests. Mamba-2's per-head ``dt, A, D, dt_bias`` arrive expanded
with stride 0 and are read as such (one value per head).

All math in fp32; the state is stored in the cache's dtype, the output in x's. A padding request
(slot < 0 or the null block) runs from a zero state and stores no state. Offsets into the cache
and the tokens are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from customop.backends.triton._common import device_guard, next_pow2, silu, softplus


@triton.jit
def _token_step(state, A, D, dt_bias, x_row, dt_row, b_row, c_row, z_row, p_ok, n_ok, HAS_D: tl.constexpr,
                HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr):
    """Reads one token's inputs and returns the advanced state and the token's output (fp32)."""
    x = tl.load(x_row, mask=p_ok, other=0.0).to(tl.float32)
    dt = tl.load(dt_row, mask=p_ok, other=0.0).to(tl.float32)
    B = tl.load(b_row, mask=n_ok, other=0.0).to(tl.float32)
    C = tl.load(c_row, mask=n_ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        dt += dt_bias
    if SOFTPLUS:
        dt = softplus(dt)
    state = state * tl.exp(dt[:, None] * A) + (dt * x)[:, None] * B[None, :]
    y = tl.sum(state * C[None, :], axis=1)
    if HAS_D:
        y += D * x
    if HAS_Z:
        y *= silu(tl.load(z_row, mask=p_ok, other=0.0).to(tl.float32))
    return state, y


@triton.jit
def _scan_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, bias_ptr, state_ptr, out_ptr,
    qsl_ptr, slot_ptr, init_ptr, null_slot, head_dim, state_size, heads_per_group,
    sx_t, sx_h, sx_p, sdt_t, sdt_h, sdt_p, sa_h, sa_p, sa_n, sb_t, sb_g, sb_n, sc_t, sc_g, sc_n,
    sd_h, sd_p, sz_t, sz_h, sz_p, sbias_h, sbias_p, ss_s, ss_h, ss_p, ss_n, so_t, so_h,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, DECODE: tl.constexpr,
):
    seq, h = tl.program_id(0), tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_ok, n_ok = p < head_dim, n < state_size
    tile_ok = p_ok[:, None] & n_ok[None, :]
    slot = tl.load(slot_ptr + seq)
    real = (slot >= 0) & (slot != null_slot)
    if DECODE:  # request `seq` is token `seq`, from its cached state: no token table to read
        start = seq
        end = seq + 1
        from_cache = real
    else:
        start, end = tl.load(qsl_ptr + seq), tl.load(qsl_ptr + seq + 1)
        from_cache = real & (tl.load(init_ptr + seq) != 0)
    g = h // heads_per_group
    state_tile = (state_ptr + tl.maximum(slot, 0).to(tl.int64) * ss_s + h * ss_h
                  + p[:, None] * ss_p + n[None, :] * ss_n)
    state = tl.load(state_tile, mask=tile_ok & from_cache, other=0.0).to(tl.float32)
    A = tl.load(a_ptr + h * sa_h + p[:, None] * sa_p + n[None, :] * sa_n, mask=tile_ok, other=0.0).to(tl.float32)
    D = 0.0
    dt_bias = 0.0
    if HAS_D:
        D = tl.load(d_ptr + h * sd_h + p * sd_p, mask=p_ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        dt_bias = tl.load(bias_ptr + h * sbias_h + p * sbias_p, mask=p_ok, other=0.0).to(tl.float32)
    # row pointers at the request's first token, advanced by one token's stride per step (64-bit)
    t0 = start.to(tl.int64)
    x_row, dt_row = x_ptr + t0 * sx_t + h * sx_h + p * sx_p, dt_ptr + t0 * sdt_t + h * sdt_h + p * sdt_p
    b_row, c_row = b_ptr + t0 * sb_t + g * sb_g + n * sb_n, c_ptr + t0 * sc_t + g * sc_g + n * sc_n
    z_row, o_row = z_ptr + t0 * sz_t + h * sz_h + p * sz_p, out_ptr + t0 * so_t + h * so_h + p
    if DECODE:  # one step, no loop-carried registers (the loop form kept ~226 live at N = 128)
        state, y = _token_step(state, A, D, dt_bias, x_row, dt_row, b_row, c_row, z_row, p_ok, n_ok,
                               HAS_D, HAS_Z, HAS_BIAS, SOFTPLUS)
        tl.store(o_row, y.to(out_ptr.dtype.element_ty), mask=p_ok)
    else:
        for _ in range(start, end):
            state, y = _token_step(state, A, D, dt_bias, x_row, dt_row, b_row, c_row, z_row, p_ok, n_ok,
                                   HAS_D, HAS_Z, HAS_BIAS, SOFTPLUS)
            tl.store(o_row, y.to(out_ptr.dtype.element_ty), mask=p_ok)
            x_row += sx_t
            dt_row += sdt_t
            b_row += sb_t
            c_row += sc_t
            z_row += sz_t
            o_row += so_t
    if real & (end > start):
        tl.store(state_tile, state.to(state_ptr.dtype.element_ty), mask=tile_ok)


def _strides(t: torch.Tensor | None, dims: int) -> tuple[int, ...]:
    return (0,) * dims if t is None else tuple(t.stride())


def _launch(x, dt, A, B, C, D, z, dt_bias, ssm_states, qsl, slots, init, dt_softplus, null_block_id,
            decode: bool = False) -> torch.Tensor:
    """``decode``: one token per request, each from its cached state (``qsl``/``init`` unread)."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    out = torch.empty((T, H, P), dtype=x.dtype, device=x.device)
    S = slots.shape[0]
    if T == 0 or S == 0:
        return out
    block_n = max(16, next_pow2(N))
    # the (BLOCK_P, N) fp32 state and A tiles stay in registers: 2K state values per program
    # (16 x 128 for Mamba-2) compile for sm_90 without spills at 4 warps; 32 x 128 spilled
    block_p = max(1, min(next_pow2(P), 2048 // block_n, 64))
    any_ = x  # a valid pointer for absent optional tensors (never read)
    with device_guard(x.device):
        _scan_kernel[(S, H, triton.cdiv(P, block_p))](
            x, dt, A, B, C, D if D is not None else any_, z if z is not None else any_,
            dt_bias if dt_bias is not None else any_, ssm_states, out,
            qsl if decode else qsl.to(torch.int32), slots, init if decode else init.to(torch.int8),
            null_block_id, P, N, H // G,
            *x.stride(), *dt.stride(), *A.stride(), *B.stride(), *C.stride(), *_strides(D, 2), *_strides(z, 3),
            *_strides(dt_bias, 2), *ssm_states.stride(), out.stride(0), out.stride(1),
            HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus,
            BLOCK_P=block_p, BLOCK_N=block_n, DECODE=decode, num_warps=4)
    return out


def selective_scan(x, dt, A, B, C, D, z, dt_bias, ssm_states, query_start_loc, cache_indices, has_initial_state,
                   dt_softplus, null_block_id) -> torch.Tensor:
    return _launch(x, dt, A, B, C, D, z, dt_bias, ssm_states, query_start_loc, cache_indices, has_initial_state,
                   dt_softplus, null_block_id)


def selective_state_update(ssm_states, x, dt, A, B, C, D, z, dt_bias, cache_indices, dt_softplus,
                           null_block_id) -> torch.Tensor:
    """One token per request, always from the cached state: the kernel's decode form (one launch,
    nothing allocated besides the output)."""
    return _launch(x, dt, A, B, C, D, z, dt_bias, ssm_states, cache_indices, cache_indices, cache_indices,
                   dt_softplus, null_block_id, decode=True)


KERNELS = {
    "customop::selective_scan": selective_scan,
    "customop::selective_state_update": selective_state_update,
}
