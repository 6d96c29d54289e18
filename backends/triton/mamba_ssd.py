"""Triton kernels of Mamba-2's chunked SSD scan (the state-space family): ``customop::ssd_chunk_scan``.

The steps of ``customop/math/mamba.py``'s ``ssd_chunked``, one launch each, in stream order:

1. ``_cumsum``: per chunk and block of heads, ``delta = softplus(dt + dt_bias)`` and the running
   sum ``a`` of ``delta * A`` from the chunk's start (fp32, per token);
2. ``_chunk_state``: per chunk and head, the state the chunk reaches from zero,
   ``x^T @ (B * exp(a_last - a) * delta)`` (a ``(P, L) @ (L, N)`` matmul);
3. ``_state_passing``: per request and head, walks the request's chunks in order from its initial
   state (the cache, or zero) and stores the state entering each chunk; the last one goes to the
   cache;
4. ``_chunk_cb``: per chunk and group, ``C @ B^T`` over the chunk's tokens (its causal half, fp32).
   Every head of the group reads it: computing it once per group instead of once per head is what
   makes the scan's matmuls the heads' own ``(L, L) @ (L, P)`` products;
5. ``_chunk_scan``: per block of a chunk's tokens and head, ``y = exp(a) * (C @ h_in^T) +
   (CB * exp(a_t - a_s) * delta_s, causal) @ x + D * x``.

Chunks never cross a request: request i is cut every ``chunk_size`` tokens from its first one.
The chunk table (start, end, request of every chunk) is built on the device from
``query_start_loc`` with a static upper bound of ``T // chunk_size + requests`` chunks; programs of
chunks past the real count exit at once. No host sync, so the op can be captured in a CUDA graph.
The per-head kernels (2 and 5) put the head on the fastest grid axis: the programs that run
together share one chunk's B, C and CB tiles in L2.

Matmul precision follows the input dtype (``DOT``): fp32 inputs multiply fp32 operands with
``input_precision="ieee"`` (TF32 would cost the fp32 path its accuracy against the spec);
bf16/fp16 inputs round each operand to the input dtype and run on the tensor cores with fp32
accumulation, as vLLM's SSD kernels do (the fp32 FMA form measured 3.6-3.9x slower than eager
PyTorch on the H200 at Mamba-2 2.7B shapes, 2026-12-01). Under the Triton interpreter, which
multiplies bf16 tiles as integers (triton 3.7.1), the same rounding is applied and the product
taken in fp32. CB, the chunk states, the state passing and the running sums stay fp32; the
states entering each chunk are handed to the scan rounded to the dtype its matmul rounds them to
anyway (fp32 in ieee mode); the cache gets the final state in its own dtype. Offsets into the
tokens and the cache are int64.

Launch shapes are data (``SSDConfig``; ``ssd_candidates`` is what the H200 sweep times,
``python -m customop.benchmarks.specs.mamba --sweep-prefill``).
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import triton
import triton.language as tl

from customop.backends.triton._common import (INTERPRETED, GRID_YZ_MAX, ConfigStack, device_guard, next_pow2,
                                              softplus)


@dataclasses.dataclass(frozen=True)
class SSDConfig:
    """Tile sizes (powers of two; clamped to the problem) and warps of each step.

    state_p / state_l / state_warps: the chunk state's head_dim rows per program, tokens per
    matmul step, warps; cb_m / cb_k / cb_warps: C B^T's square tile (tokens) and d_state step;
    scan_m / scan_k / scan_p / scan_ds / scan_warps / scan_stages: the chunk scan's output tokens
    per program, source tokens per step, head_dim columns per program, d_state per step of the
    entering state's product, warps, software-pipelining depth of its loops; stages: that depth for
    the chunk state's and C B^T's loops; pass_block: state elements per program of the state
    passing.

    The defaults are the H200 sweep's best over both models (``--sweep-prefill``, 2026-12-02, bf16,
    4096 tokens, 69 configs): Mamba-2 2.7B 258.8 us, Nemotron-H 393.2 us, 1.37x / 1.34x the
    starting shape (64 x 32 scan tiles with the whole d_state at once and two stages). The scan's
    loops have 1-8 steps: a second pipelining stage cost more than it hid at every tile size."""

    state_p: int = 64
    state_l: int = 64
    state_warps: int = 8
    cb_m: int = 64
    cb_k: int = 32
    cb_warps: int = 4
    scan_m: int = 64
    scan_k: int = 32
    scan_p: int = 64
    scan_warps: int = 4
    scan_ds: int = 64
    scan_stages: int = 1
    stages: int = 2
    pass_block: int = 1024

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name.endswith("stages"):
                if not 1 <= v <= 5:
                    raise ValueError(f"SSDConfig.{f.name} must be 1-5, got {v}")
            elif v < 1 or v & (v - 1):
                raise ValueError(f"SSDConfig.{f.name} must be a power of two, got {v}")

    def label(self) -> str:
        return (f"st{self.state_p}x{self.state_l}w{self.state_warps} cb{self.cb_m}k{self.cb_k}w{self.cb_warps} "
                f"sc{self.scan_m}x{self.scan_k}p{self.scan_p}d{self.scan_ds}w{self.scan_warps}s{self.scan_stages} "
                f"s{self.stages} pb{self.pass_block}")


#: sweeps and tests: ``with override_ssd_config(cfg):`` runs every launch inside with ``cfg``
_OVERRIDES = ConfigStack()
override_ssd_config = _OVERRIDES.use


def ssd_config() -> SSDConfig:
    """The active override, else the default launch shape."""
    return _OVERRIDES.top or SSDConfig()


def ssd_candidates() -> list[SSDConfig]:
    """The configurations the prefill sweep times: the default, the chunk scan's tiles, warps and
    pipelining depth over a grid (it is most of the time), then the other steps' one at a time."""
    base = SSDConfig()
    out = [base]
    grid = [(m, k, w, st, ds) for m in (64, 128) for k, w, st, ds in itertools.product((16, 32, 64), (4, 8), (1, 2),
                                                                                     (32, 64))]
    grid += [(32, k, w, st, 32) for k, w, st in itertools.product((16, 32), (2, 4), (1, 2))]
    for m, k, w, st, ds in grid:
        out.append(dataclasses.replace(base, scan_m=m, scan_k=k, scan_warps=w, scan_stages=st, scan_ds=ds))
    for fields in (dict(scan_ds=128), dict(scan_p=32), dict(scan_p=32, scan_m=128),
                   dict(stages=1), dict(stages=3), dict(state_p=32, state_warps=4), dict(state_l=32),
                   dict(state_warps=4), dict(cb_m=128, cb_warps=8), dict(cb_k=64, cb_warps=8),
                   dict(pass_block=256), dict(pass_block=512), dict(pass_block=2048)):
        out.append(dataclasses.replace(base, **fields))
    return list(dict.fromkeys(out))


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
                   sdt_t, sdt_h, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, CHUNK: tl.constexpr,
                   BLOCK_H: tl.constexpr):
    c = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < n_heads
    start, end = tl.load(cstart_ptr + c), tl.load(cend_ptr + c)
    t = start.to(tl.int64) + tl.arange(0, CHUNK)
    ok = (t < end)[:, None] & h_ok[None, :]
    dt = tl.load(dt_ptr + t[:, None] * sdt_t + h[None, :] * sdt_h, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        dt += tl.load(bias_ptr + h, mask=h_ok, other=0.0).to(tl.float32)[None, :]
    if SOFTPLUS:
        dt = softplus(dt)
    dt = tl.where(ok, dt, 0.0)
    a = tl.cumsum(dt * tl.load(a_ptr + h, mask=h_ok, other=0.0).to(tl.float32)[None, :], axis=0)
    row = t[:, None] * n_heads + h[None, :]
    tl.store(delta_ptr + row, dt, mask=ok)
    tl.store(acum_ptr + row, a, mask=ok)


@triton.jit
def _chunk_state_kernel(x_ptr, b_ptr, delta_ptr, acum_ptr, states_ptr, cstart_ptr, cend_ptr,
                        n_heads, head_dim, state_size, heads_per_group,
                        sx_t, sx_h, sx_p, sb_t, sb_g, sb_n,
                        BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, DOT: tl.constexpr,
                        STAGES: tl.constexpr):
    h, c = tl.program_id(0), tl.program_id(1)
    start, end = tl.load(cstart_ptr + c), tl.load(cend_ptr + c)
    if end > start:
        p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
        n = tl.arange(0, BLOCK_N)
        p_ok, n_ok = p < head_dim, n < state_size
        g = h // heads_per_group
        a_last = tl.load(acum_ptr + (end - 1).to(tl.int64) * n_heads + h)
        acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
        for t0 in tl.range(start, end, BLOCK_L, num_stages=STAGES):
            t = t0 + tl.arange(0, BLOCK_L)
            ok = t < end
            t = t.to(tl.int64)
            scale = tl.exp(a_last - tl.load(acum_ptr + t * n_heads + h, mask=ok, other=0.0)) \
                * tl.load(delta_ptr + t * n_heads + h, mask=ok, other=0.0)
            xT = tl.load(x_ptr + t[None, :] * sx_t + h * sx_h + p[:, None] * sx_p, mask=ok[None, :] & p_ok[:, None],
                         other=0.0)
            B = tl.load(b_ptr + t[:, None] * sb_t + g * sb_g + n[None, :] * sb_n, mask=ok[:, None] & n_ok[None, :],
                        other=0.0)
            acc += _mm(xT, B.to(tl.float32) * scale[:, None], x_ptr.dtype.element_ty, DOT)
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
        tl.store(h_in_ptr + row, s.to(h_in_ptr.dtype.element_ty), mask=ok)
        a_total = tl.load(acum_ptr + (tl.load(cend_ptr + c) - 1).to(tl.int64) * n_heads + h)
        s = tl.exp(a_total) * s + tl.load(states_ptr + row, mask=ok, other=0.0)
    if real & (count > 0):
        tl.store(cached, s.to(cache_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _chunk_cb_kernel(b_ptr, c_ptr, cb_ptr, cstart_ptr, cend_ptr, n_groups, state_size, chunk_size, blocks_per_chunk,
                     sb_t, sb_g, sb_n, sc_t, sc_g, sc_n, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                     DOT: tl.constexpr, STAGES: tl.constexpr):
    """CB[c, g, i, j] = C[start + i] . B[start + j] for the tile (i, j) of program 2, causal
    tiles only (j's block <= i's); tiles above the diagonal are never read."""
    g, c = tl.program_id(0), tl.program_id(1)
    bi, bj = tl.program_id(2) // blocks_per_chunk, tl.program_id(2) % blocks_per_chunk
    start, end = tl.load(cstart_ptr + c), tl.load(cend_ptr + c)
    i = bi * BLOCK_M + tl.arange(0, BLOCK_M)
    j = bj * BLOCK_M + tl.arange(0, BLOCK_M)
    if (bj <= bi) & (start + bi * BLOCK_M < end):
        ti, tj = (start + i).to(tl.int64), (start + j).to(tl.int64)
        i_ok, j_ok = ti < end, tj < end
        acc = tl.zeros([BLOCK_M, BLOCK_M], dtype=tl.float32)
        for k0 in tl.range(0, state_size, BLOCK_K, num_stages=STAGES):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < state_size
            C = tl.load(c_ptr + ti[:, None] * sc_t + g * sc_g + k[None, :] * sc_n, mask=i_ok[:, None] & k_ok[None, :],
                        other=0.0)
            BT = tl.load(b_ptr + tj[None, :] * sb_t + g * sb_g + k[:, None] * sb_n, mask=j_ok[None, :] & k_ok[:, None],
                         other=0.0)
            acc += _mm(C, BT, c_ptr.dtype.element_ty, DOT)
        out = cb_ptr + ((c * n_groups + g).to(tl.int64) * chunk_size + i[:, None]) * chunk_size + j[None, :]
        tl.store(out, acc, mask=(i[:, None] < chunk_size) & (j[None, :] < chunk_size))


@triton.jit
def _chunk_scan_kernel(x_ptr, c_ptr, cb_ptr, d_ptr, delta_ptr, acum_ptr, h_in_ptr, out_ptr, cstart_ptr, cend_ptr,
                       n_heads, head_dim, state_size, heads_per_group, n_groups, chunk_size, blocks_per_chunk,
                       sx_t, sx_h, sx_p, sc_t, sc_g, sc_n,
                       HAS_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_DS: tl.constexpr,
                       BLOCK_K: tl.constexpr, DOT: tl.constexpr, STAGES: tl.constexpr):
    h = tl.program_id(0)
    c = tl.program_id(1) // blocks_per_chunk
    start, end = tl.load(cstart_ptr + c), tl.load(cend_ptr + c)
    i0 = (tl.program_id(1) % blocks_per_chunk) * BLOCK_M
    if start + i0 < end:
        g = h // heads_per_group
        p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
        p_ok = p < head_dim
        i = i0 + tl.arange(0, BLOCK_M)
        tm = start + i
        m_ok = tm < end
        tm64 = tm.to(tl.int64)
        a_m = tl.load(acum_ptr + tm64 * n_heads + h, mask=m_ok, other=0.0)
        h_rows = h_in_ptr + ((c * n_heads + h).to(tl.int64) * head_dim + p[None, :]) * state_size
        acc = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
        for n0 in tl.range(0, state_size, BLOCK_DS, num_stages=STAGES):  # C @ h_in^T, BLOCK_DS at a time
            n = n0 + tl.arange(0, BLOCK_DS)
            n_ok = n < state_size
            C = tl.load(c_ptr + tm64[:, None] * sc_t + g * sc_g + n[None, :] * sc_n,
                        mask=m_ok[:, None] & n_ok[None, :], other=0.0)
            h_in = tl.load(h_rows + n[:, None], mask=n_ok[:, None] & p_ok[None, :], other=0.0)  # (N, P)
            acc += _mm(C, h_in, x_ptr.dtype.element_ty, DOT)
        acc *= tl.exp(a_m)[:, None]
        cb_rows = cb_ptr + ((c * n_groups + g).to(tl.int64) * chunk_size + i[:, None]) * chunk_size
        # source tokens up to the block's last: every step but the last is below the diagonal
        for k0 in tl.range(0, tl.minimum(end - start, i0 + BLOCK_M), BLOCK_K, num_stages=STAGES):
            j = k0 + tl.arange(0, BLOCK_K)
            tk = start + j
            k_ok = tk < end
            tk64 = tk.to(tl.int64)
            causal = (j[None, :] <= i[:, None]) & k_ok[None, :] & m_ok[:, None]
            cb = tl.load(cb_rows + j[None, :], mask=causal, other=0.0)
            a_k = tl.load(acum_ptr + tk64 * n_heads + h, mask=k_ok, other=0.0)
            decay = tl.exp(tl.where(causal, a_m[:, None] - a_k[None, :], float("-inf")))
            scores = cb * decay * tl.load(delta_ptr + tk64 * n_heads + h, mask=k_ok, other=0.0)[None, :]
            x = tl.load(x_ptr + tk64[:, None] * sx_t + h * sx_h + p[None, :] * sx_p,
                        mask=k_ok[:, None] & p_ok[None, :], other=0.0)
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


def _tile(want: int, size: int, floor: int = 16) -> int:
    """``want`` clamped to ``size``'s power of two, at least ``floor`` (tl.dot's smallest)."""
    return max(floor, min(want, next_pow2(size)))


def ssd_chunk_scan(x, dt, A, B, C, D, dt_bias, ssm_states, query_start_loc, cache_indices, has_initial_state,
                   chunk_size, dt_softplus, null_block_id) -> torch.Tensor:
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    out = torch.empty((T, H, P), dtype=x.dtype, device=x.device)
    S = cache_indices.shape[0]
    if T == 0 or S == 0:
        return out
    cfg = ssd_config()
    # the chunks ride the grid's second axis (the heads go first: see above)
    if (T // chunk_size + S) * triton.cdiv(chunk_size, _tile(cfg.scan_m, chunk_size)) > GRID_YZ_MAX:
        raise ValueError(f"ssd_chunk_scan: {T} tokens in chunks of {chunk_size} exceed the kernels' grid "
                         f"({GRID_YZ_MAX} chunk blocks); expected at most ~{GRID_YZ_MAX * chunk_size // 4} "
                         "tokens a call")
    cstart, cend, first, count = chunk_table(query_start_loc, T, chunk_size)
    n_chunks = cstart.shape[0]
    f32 = dict(dtype=torch.float32, device=x.device)
    delta, acum = torch.empty((T, H), **f32), torch.empty((T, H), **f32)
    dot = dot_mode(x.dtype)
    states = torch.empty((n_chunks, H, P, N), **f32)
    # the scan rounds the entering states to x's dtype for its matmul (fp32 only in ieee mode), so
    # the state passing stores them rounded: half the traffic of that hand-off, the same bits
    h_in = torch.empty((n_chunks, H, P, N), dtype=torch.float32 if dot == "ieee" else x.dtype, device=x.device)
    cb = torch.empty((n_chunks, G, chunk_size, chunk_size), **f32)
    block_n = max(16, next_pow2(N))
    state_p, state_l = _tile(cfg.state_p, P), _tile(cfg.state_l, chunk_size)
    cb_m, cb_k = _tile(cfg.cb_m, chunk_size), _tile(cfg.cb_k, N)
    scan_m, scan_k, scan_p = _tile(cfg.scan_m, chunk_size), _tile(cfg.scan_k, chunk_size), _tile(cfg.scan_p, P)
    cb_blocks, scan_blocks = triton.cdiv(chunk_size, cb_m), triton.cdiv(chunk_size, scan_m)
    flat = min(cfg.pass_block, next_pow2(P * N))
    block_h = min(16, next_pow2(H))
    slots, init = cache_indices.to(torch.int32), has_initial_state.to(torch.int8)
    with device_guard(x.device):
        _cumsum_kernel[(n_chunks, triton.cdiv(H, block_h))](
            dt, dt_bias if dt_bias is not None else A, A, delta, acum, cstart, cend, H, dt.stride(0), dt.stride(1),
            HAS_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus, CHUNK=next_pow2(chunk_size), BLOCK_H=block_h)
        _chunk_state_kernel[(H, n_chunks, triton.cdiv(P, state_p))](
            x, B, delta, acum, states, cstart, cend, H, P, N, H // G, *x.stride(), *B.stride(),
            BLOCK_P=state_p, BLOCK_N=block_n, BLOCK_L=state_l, DOT=dot, STAGES=cfg.stages,
            num_warps=cfg.state_warps)
        _state_passing_kernel[(S, H, triton.cdiv(P * N, flat))](
            states, h_in, acum, ssm_states, cend, first, count, slots, init, null_block_id, H, P, N,
            *ssm_states.stride(), BLOCK=flat)
        _chunk_cb_kernel[(G, n_chunks, cb_blocks * cb_blocks)](
            B, C, cb, cstart, cend, G, N, chunk_size, cb_blocks, *B.stride(), *C.stride(),
            BLOCK_M=cb_m, BLOCK_K=cb_k, DOT=dot, STAGES=cfg.stages, num_warps=cfg.cb_warps)
        _chunk_scan_kernel[(H, n_chunks * scan_blocks, triton.cdiv(P, scan_p))](
            x, C, cb, D if D is not None else A, delta, acum, h_in, out, cstart, cend, H, P, N, H // G, G,
            chunk_size, scan_blocks, *x.stride(), *C.stride(),
            HAS_D=D is not None, BLOCK_M=scan_m, BLOCK_P=scan_p, BLOCK_DS=_tile(cfg.scan_ds, N), BLOCK_K=scan_k,
            DOT=dot, STAGES=cfg.scan_stages, num_warps=cfg.scan_warps)
    return out


KERNELS = {"customop::ssd_chunk_scan": ssd_chunk_scan}
