"""Triton kernels of Mamba-2's chunked SSD scan (the state-space family): ``customop::ssd_chunk_scan``.

The four steps of ``customop/math/mamba.py``'s ``ssd_chunked``, one launch each, in stream order:

1. ``_cumsum``: per chunk and head, ``delta = softplus(dt + dt_bias)`` and the running sum ``a`` of
   ``delta * A`` from the chunk's start (fp32, per token);
2. ``_chunk_state``: per chunk and head, the state the chunk reaches from zero,
   ``x^T @ (B * exp(a_last - a) * delta)`` (a ``(P, L) @ (L, N)`` matmul);
3. ``_state_passing``: per request and head, walks the request's chunks in order from its initial
   state (the cache, or zero) and stores the state entering each chunk; the last one goes to the
   cache;
4. ``_chunk_scan``: per block of a chunk's tokens and head, ``y = exp(a) * (C @ h_in^T) +
   ((C @ B^T) * exp(a_t - a_s) * delta_s, causal) @ x + D * x`` (matmuls over the chunk).

Chunks never cross a request: request i is cut every ``chunk_size`` tokens from its first one.
The chunk table (start, end, request of every chunk) is built on the device from
``query_start_loc`` with a static upper bound of ``T // chunk_size + requests`` chunks; programs of
chunks past the real count exit at once. No host sync, so the op can be captured in a CUDA graph.

Matmul precision follows the input dtype (``DOT``): fp32 inputs multiply fp32 operands with
``input_precision="ieee"`` (TF32 would cost the fp32 path its accuracy against the spec);
bf16/fp16 inputs round each operand to the input dtype and run on the tensor cores with fp32
accumulation, as vLLM's SSD kernels do (the fp32 FMA form measured 3.6-3.9x slower than eager
PyTorch on the H200 at Mamba-2 2.7B shapes, 2026-12-01). Under the Triton interpreter, which
multiplies bf16 tiles as integers (triton 3.7.1), the same rounding is applied and the product
taken in fp32. The passed states are kept in fp32; the cache gets the final state in its own
dtype. Offsets into the tokens and the cache are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from customop.backends.triton._common import INTERPRETED, device_guard, next_pow2, softplus

#: tokens per matmul block of steps 2 and 4
BLOCK_L = 32


def dot_mode(dtype: torch.dtype) -> str:
    """``ieee`` (fp32 operands), ``mma`` (operands rounded to the 16-bit input dtype, tensor
    cores) or ``mma_emulated`` (the same rounding, fp32 product: the interpreter)."""
    if dtype == torch.float32:
        return "ieee"
    return "mma_emulated" if INTERPRETED else "mma"


@triton.jit
def _mm(a, b, op_dtype, DOT: tl.constexpr):
    if DOT == "ieee":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif DOT == "mma":
        return tl.dot(a.to(op_dtype), b.to(op_dtype))
    else:
        return tl.dot(a.to(op_dtype).to(tl.float32), b.to(op_dtype).to(tl.float32), input_precision="ieee")


@triton.jit
def _cumsum_kernel(dt_ptr, bias_ptr, a_ptr, delta_ptr, acum_ptr, cstart_ptr, cend_ptr, n_heads,
                   sdt_t, sdt_h, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, CHUNK: tl.constexpr):
    c, h = tl.program_id(0), tl.program_id(1)
    start, end = tl.load(cstart_ptr + c), tl.load(cend_ptr + c)
    t = start.to(tl.int64) + tl.arange(0, CHUNK)
    ok = t < end
    dt = tl.load(dt_ptr + t * sdt_t + h * sdt_h, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        dt += tl.load(bias_ptr + h).to(tl.float32)
    if SOFTPLUS:
        dt = softplus(dt)
    dt = tl.where(ok, dt, 0.0)
    a = tl.cumsum(dt * tl.load(a_ptr + h).to(tl.float32), axis=0)
    tl.store(delta_ptr + t * n_heads + h, dt, mask=ok)
    tl.store(acum_ptr + t * n_heads + h, a, mask=ok)


@triton.jit
def _chunk_state_kernel(x_ptr, b_ptr, delta_ptr, acum_ptr, states_ptr, cstart_ptr, cend_ptr,
                        n_heads, head_dim, state_size, heads_per_group,
                        sx_t, sx_h, sx_p, sb_t, sb_g, sb_n,
                        BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, DOT: tl.constexpr):
    c, h = tl.program_id(0), tl.program_id(1)
    start, end = tl.load(cstart_ptr + c), tl.load(cend_ptr + c)
    if end > start:
        p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
        n = tl.arange(0, BLOCK_N)
        p_ok, n_ok = p < head_dim, n < state_size
        g = h // heads_per_group
        a_last = tl.load(acum_ptr + (end - 1).to(tl.int64) * n_heads + h)
        acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
        for t0 in range(start, end, BLOCK_L):
            t = t0 + tl.arange(0, BLOCK_L)
            ok = t < end
            t = t.to(tl.int64)
            scale = tl.exp(a_last - tl.load(acum_ptr + t * n_heads + h, mask=ok, other=0.0)) \
                * tl.load(delta_ptr + t * n_heads + h, mask=ok, other=0.0)
            x = tl.load(x_ptr + t[:, None] * sx_t + h * sx_h + p[None, :] * sx_p, mask=ok[:, None] & p_ok[None, :],
                        other=0.0)
            B = tl.load(b_ptr + t[:, None] * sb_t + g * sb_g + n[None, :] * sb_n, mask=ok[:, None] & n_ok[None, :],
                        other=0.0).to(tl.float32)
            acc += _mm(tl.trans(x), B * scale[:, None], x_ptr.dtype.element_ty, DOT)
        out = states_ptr + ((c * n_heads + h).to(tl.int64) * head_dim + p[:, None]) * state_size + n[None, :]
        tl.store(out, acc, mask=p_ok[:, None] & n_ok[None, :])


@triton.jit
def _state_passing_kernel(states_ptr, h_in_ptr, acum_ptr, cache_ptr, cend_ptr, first_ptr, count_ptr,
                          slot_ptr, init_ptr, null_slot, n_heads, head_dim, state_size,
                          ss_s, ss_h, ss_p, ss_n, BLOCK: tl.constexpr):
    seq, h = tl.program_id(0), tl.program_id(1)
    e = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)  # flat (p, n) index
    ok = e < head_dim * state_size
    slot = tl.load(slot_ptr + seq)
    real = (slot >= 0) & (slot != null_slot)
    cached = (cache_ptr + tl.maximum(slot, 0).to(tl.int64) * ss_s + h * ss_h
              + (e // state_size) * ss_p + (e % state_size) * ss_n)
    s = tl.load(cached, mask=ok & real & (tl.load(init_ptr + seq) != 0), other=0.0).to(tl.float32)
    first, count = tl.load(first_ptr + seq), tl.load(count_ptr + seq)
    for c in range(first, first + count):
        row = (c * n_heads + h).to(tl.int64) * head_dim * state_size + e
        tl.store(h_in_ptr + row, s, mask=ok)
        a_total = tl.load(acum_ptr + (tl.load(cend_ptr + c) - 1).to(tl.int64) * n_heads + h)
        s = tl.exp(a_total) * s + tl.load(states_ptr + row, mask=ok, other=0.0)
    if real & (count > 0):
        tl.store(cached, s.to(cache_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _chunk_scan_kernel(x_ptr, b_ptr, c_ptr, d_ptr, delta_ptr, acum_ptr, h_in_ptr, out_ptr, cstart_ptr, cend_ptr,
                       n_heads, head_dim, state_size, heads_per_group, blocks_per_chunk,
                       sx_t, sx_h, sx_p, sb_t, sb_g, sb_n, sc_t, sc_g, sc_n,
                       HAS_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_L: tl.constexpr, DOT: tl.constexpr):
    c, h = tl.program_id(0) // blocks_per_chunk, tl.program_id(1)
    start, end = tl.load(cstart_ptr + c), tl.load(cend_ptr + c)
    m0 = start + (tl.program_id(0) % blocks_per_chunk) * BLOCK_M
    if m0 < end:
        g = h // heads_per_group
        p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
        n = tl.arange(0, BLOCK_N)
        p_ok, n_ok = p < head_dim, n < state_size
        tm = m0 + tl.arange(0, BLOCK_M)
        m_ok = tm < end
        tm64 = tm.to(tl.int64)
        a_m = tl.load(acum_ptr + tm64 * n_heads + h, mask=m_ok, other=0.0)
        C = tl.load(c_ptr + tm64[:, None] * sc_t + g * sc_g + n[None, :] * sc_n, mask=m_ok[:, None] & n_ok[None, :],
                    other=0.0).to(tl.float32)
        h_in = tl.load(h_in_ptr + ((c * n_heads + h).to(tl.int64) * head_dim + p[None, :]) * state_size + n[:, None],
                       mask=n_ok[:, None] & p_ok[None, :], other=0.0)  # (N, P)
        acc = _mm(C, h_in, x_ptr.dtype.element_ty, DOT) * tl.exp(a_m)[:, None]
        for k0 in range(start, tl.minimum(end, m0 + BLOCK_M), BLOCK_L):  # source tokens up to the block's last
            tk = k0 + tl.arange(0, BLOCK_L)
            k_ok = tk < end
            tk64 = tk.to(tl.int64)
            B = tl.load(b_ptr + tk64[:, None] * sb_t + g * sb_g + n[None, :] * sb_n,
                        mask=k_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
            a_k = tl.load(acum_ptr + tk64 * n_heads + h, mask=k_ok, other=0.0)
            causal = (tk[None, :] <= tm[:, None]) & k_ok[None, :]
            decay = tl.exp(tl.where(causal, a_m[:, None] - a_k[None, :], float("-inf")))
            scores = _mm(C, tl.trans(B), x_ptr.dtype.element_ty, DOT) * decay \
                * tl.load(delta_ptr + tk64 * n_heads + h, mask=k_ok, other=0.0)[None, :]
            x = tl.load(x_ptr + tk64[:, None] * sx_t + h * sx_h + p[None, :] * sx_p,
                        mask=k_ok[:, None] & p_ok[None, :], other=0.0).to(tl.float32)
            acc += _mm(scores, x, x_ptr.dtype.element_ty, DOT)
        x_m = tl.load(x_ptr + tm64[:, None] * sx_t + h * sx_h + p[None, :] * sx_p, mask=m_ok[:, None] & p_ok[None, :],
                      other=0.0).to(tl.float32)
        if HAS_D:
            acc += tl.load(d_ptr + h).to(tl.float32) * x_m
        out = out_ptr + (tm64[:, None] * n_heads + h) * head_dim + p[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & p_ok[None, :])


def chunk_table(query_start_loc: torch.Tensor, n_tokens: int, chunk_size: int):
    """(start, end of each chunk; first chunk and chunk count of each request), int32 on the
    device. There are ``n_tokens // chunk_size + requests`` rows, an upper bound of the real count
    (sum of ceil(len / chunk_size)); rows past it are empty (start == end)."""
    qsl = query_start_loc.to(torch.int64)
    lens = qsl[1:] - qsl[:-1]
    count = (lens + chunk_size - 1) // chunk_size
    last = torch.cumsum(count, 0)
    first = last - count
    rows = torch.arange(n_tokens // chunk_size + lens.shape[0], device=qsl.device)
    seq = torch.searchsorted(last, rows, right=True).clamp(max=lens.shape[0] - 1)
    start = qsl[seq] + (rows - first[seq]) * chunk_size
    real = rows < last[-1]
    end = torch.where(real, torch.minimum(start + chunk_size, qsl[seq + 1]), start)
    i32 = torch.int32
    return start.to(i32), end.to(i32), first.to(i32), count.to(i32)


def ssd_chunk_scan(x, dt, A, B, C, D, dt_bias, ssm_states, query_start_loc, cache_indices, has_initial_state,
                   chunk_size, dt_softplus, null_block_id) -> torch.Tensor:
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    out = torch.empty((T, H, P), dtype=x.dtype, device=x.device)
    S = cache_indices.shape[0]
    if T == 0 or S == 0:
        return out
    cstart, cend, first, count = chunk_table(query_start_loc, T, chunk_size)
    n_chunks = cstart.shape[0]
    f32 = dict(dtype=torch.float32, device=x.device)
    delta, acum = torch.empty((T, H), **f32), torch.empty((T, H), **f32)
    states, h_in = torch.empty((n_chunks, H, P, N), **f32), torch.empty((n_chunks, H, P, N), **f32)
    block_n = max(16, next_pow2(N))
    block_p = max(16, min(next_pow2(P), 64))
    block_m = min(64, max(16, next_pow2(chunk_size)))
    blocks_per_chunk = triton.cdiv(chunk_size, block_m)
    flat = min(1024, next_pow2(P * N))
    # the chunk scan holds C (block_m x N), h_in (N x block_p) and the accumulators at once: with
    # N = 128 that is ~20K fp32 values, which 4 warps could hold only by spilling (not yet tuned
    # on a GPU: these are starting points, like the block sizes above)
    warps = 8 if block_n >= 128 else 4
    # the chunk state's (P x N) accumulator: 64 x 128 spilled at 8 warps on sm_90, 32 x 128 did not
    state_p = min(block_p, 32) if block_n >= 128 else block_p
    slots, init = cache_indices.to(torch.int32), has_initial_state.to(torch.int8)
    dot = dot_mode(x.dtype)
    with device_guard(x.device):
        _cumsum_kernel[(n_chunks, H)](
            dt, dt_bias if dt_bias is not None else A, A, delta, acum, cstart, cend, H, dt.stride(0), dt.stride(1),
            HAS_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus, CHUNK=next_pow2(chunk_size))
        _chunk_state_kernel[(n_chunks, H, triton.cdiv(P, state_p))](
            x, B, delta, acum, states, cstart, cend, H, P, N, H // G, *x.stride(), *B.stride(),
            BLOCK_P=state_p, BLOCK_N=block_n, BLOCK_L=BLOCK_L, DOT=dot, num_warps=warps)
        _state_passing_kernel[(S, H, triton.cdiv(P * N, flat))](
            states, h_in, acum, ssm_states, cend, first, count, slots, init, null_block_id, H, P, N,
            *ssm_states.stride(), BLOCK=flat)
        _chunk_scan_kernel[(n_chunks * blocks_per_chunk, H, triton.cdiv(P, block_p))](
            x, B, C, D if D is not None else A, delta, acum, h_in, out, cstart, cend, H, P, N, H // G,
            blocks_per_chunk, *x.stride(), *B.stride(), *C.stride(),
            HAS_D=D is not None, BLOCK_M=block_m, BLOCK_P=block_p, BLOCK_N=block_n, BLOCK_L=BLOCK_L, DOT=dot,
            num_warps=warps)
    return out


KERNELS = {"customop::ssd_chunk_scan": ssd_chunk_scan}
