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
and the tokens are int64 (the decode kernel: int32 where its config asks and the sizes allow).

Decode has its own kernel (``_decode_kernel``): one read and one write of the state, nothing
loop-carried. Its launch shape and code variants come from one function, ``decode_config``
(``DecodeConfig``: rows per program, warps, the d_state tiles a program loops over, per-head
scalars, unmasked tiles, 32-bit offsets, evict-first on the state), which returns the same
shape as before unless ``override_decode_config`` is active (the sweep:
``python -m customop.benchmarks.specs.mamba --sweep-decode``). Nothing is autotuned at call time.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from customop.backends.triton._common import ConfigStack, device_guard, next_pow2, silu, softplus


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
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    seq, h = tl.program_id(0), tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_ok, n_ok = p < head_dim, n < state_size
    tile_ok = p_ok[:, None] & n_ok[None, :]
    slot = tl.load(slot_ptr + seq)
    real = (slot >= 0) & (slot != null_slot)
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


@triton.jit
def _ld(ptr, mask, EVEN: tl.constexpr):
    """A load that is masked (zero fill) unless the tile is known to be in bounds."""
    if EVEN:
        v = tl.load(ptr)
    else:
        v = tl.load(ptr, mask=mask, other=0.0)
    return v


@triton.jit
def _decode_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, bias_ptr, state_ptr, out_ptr, slot_ptr,
    null_slot, head_dim, state_size, heads_per_group,
    sx_t, sx_h, sx_p, sdt_t, sdt_h, sdt_p, sa_h, sa_p, sa_n, sb_t, sb_g, sb_n, sc_t, sc_g, sc_n,
    sd_h, sd_p, sz_t, sz_h, sz_p, sbias_h, sbias_p, ss_s, ss_h, ss_p, ss_n, so_t, so_h,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, N_TILES: tl.constexpr, PER_HEAD: tl.constexpr,
    EVEN: tl.constexpr, OFF64: tl.constexpr, EVICT: tl.constexpr, STATE_MAJOR: tl.constexpr = False,
):
    """One decode step of rows ``[BLOCK_P * pid2, +BLOCK_P)`` of head ``pid1`` for request ``pid0``
    (token ``pid0``), over ``N_TILES`` tiles of ``BLOCK_N`` state columns. PER_HEAD: dt, A, D and
    dt_bias are one value per head (Mamba-2), read once; else per row (A per element). EVEN: the
    tiles are in bounds (no masks). OFF64: 64-bit offsets. EVICT: the state's eviction policy.
    STATE_MAJOR: the grid is (row blocks, heads, requests) instead, so that the programs in flight
    walk one request's state in address order, as a copy does, instead of one head across requests."""
    if STATE_MAJOR:
        seq, h, p_block = tl.program_id(2), tl.program_id(1), tl.program_id(0)
    else:
        seq, h, p_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    p = p_block * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_ok = p < head_dim
    slot = tl.load(slot_ptr + seq)
    real = (slot >= 0) & (slot != null_slot)
    g = h // heads_per_group
    row = tl.maximum(slot, 0)
    tok = seq
    if OFF64:
        row = row.to(tl.int64)
        tok = tok.to(tl.int64)
    x = _ld(x_ptr + tok * sx_t + h * sx_h + p * sx_p, p_ok, EVEN).to(tl.float32)
    if PER_HEAD:
        dt = tl.load(dt_ptr + tok * sdt_t + h * sdt_h).to(tl.float32)
        if HAS_BIAS:
            dt += tl.load(bias_ptr + h * sbias_h).to(tl.float32)
        if SOFTPLUS:
            dt = softplus(dt)
        decay = tl.exp(dt * tl.load(a_ptr + h * sa_h).to(tl.float32))
        D = 0.0
        if HAS_D:
            D = tl.load(d_ptr + h * sd_h).to(tl.float32)
    else:
        dt = _ld(dt_ptr + tok * sdt_t + h * sdt_h + p * sdt_p, p_ok, EVEN).to(tl.float32)
        if HAS_BIAS:
            dt += _ld(bias_ptr + h * sbias_h + p * sbias_p, p_ok, EVEN).to(tl.float32)
        if SOFTPLUS:
            dt = softplus(dt)
        D = 0.0
        if HAS_D:
            D = _ld(d_ptr + h * sd_h + p * sd_p, p_ok, EVEN).to(tl.float32)
    dx = dt * x
    state_rows = state_ptr + row * ss_s + h * ss_h + p[:, None] * ss_p
    b_row, c_row = b_ptr + tok * sb_t + g * sb_g, c_ptr + tok * sc_t + g * sc_g
    y = tl.zeros([BLOCK_P], dtype=tl.float32)
    for k in tl.static_range(N_TILES):
        nk = k * BLOCK_N + n
        n_ok = nk < state_size
        tile_ok = p_ok[:, None] & n_ok[None, :]
        tile = state_rows + nk[None, :] * ss_n
        if EVEN:  # the padding request's mask is uniform: the loads stay vectorised
            state = tl.load(tile, mask=real, other=0.0, eviction_policy=EVICT).to(tl.float32)
        else:
            state = tl.load(tile, mask=tile_ok & real, other=0.0, eviction_policy=EVICT).to(tl.float32)
        B = _ld(b_row + nk * sb_n, n_ok, EVEN).to(tl.float32)
        C = _ld(c_row + nk * sc_n, n_ok, EVEN).to(tl.float32)
        if PER_HEAD:
            state = state * decay + dx[:, None] * B[None, :]
        else:
            A = _ld(a_ptr + h * sa_h + p[:, None] * sa_p + nk[None, :] * sa_n, tile_ok, EVEN).to(tl.float32)
            state = state * tl.exp(dt[:, None] * A) + dx[:, None] * B[None, :]
        y += tl.sum(state * C[None, :], axis=1)
        if real:
            if EVEN:
                tl.store(tile, state.to(state_ptr.dtype.element_ty), eviction_policy=EVICT)
            else:
                tl.store(tile, state.to(state_ptr.dtype.element_ty), mask=tile_ok, eviction_policy=EVICT)
    if HAS_D:
        y += D * x
    if HAS_Z:
        y *= silu(_ld(z_ptr + tok * sz_t + h * sz_h + p * sz_p, p_ok, EVEN).to(tl.float32))
    o_row = out_ptr + tok * so_t + h * so_h + p
    if EVEN:
        tl.store(o_row, y.to(out_ptr.dtype.element_ty))
    else:
        tl.store(o_row, y.to(out_ptr.dtype.element_ty), mask=p_ok)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """The decode kernel's launch shape and code variant (every field's default is the shape the
    kernel had before it was configurable, except ``block_p``, which ``decode_config`` sets).

    block_p: head_dim rows per program (clamped to head_dim's power of two); num_warps;
    n_tiles: the d_state tiles one program loops over, a power of two (1: the whole row at once;
    more: fewer state values live per thread, the same traffic; the output's sum over d_state stays
    inside the program); per_head: Mamba-2's dt, A, D, dt_bias read once per head as scalars
    (when their head_dim and d_state strides are 0; otherwise per row / element as Mamba-1 needs);
    unmasked: no tile masks when block_p divides head_dim and the tiles cover d_state exactly;
    offsets32: 32-bit offsets when every tensor's reach fits; evict_first: the state's load and
    store carry the evict-first hint (it is streamed once); state_major: programs ordered along
    one request's state (row blocks, then heads, then requests) rather than requests first."""

    block_p: int = 16
    num_warps: int = 4
    n_tiles: int = 1
    per_head: bool = False
    unmasked: bool = False
    offsets32: bool = False
    evict_first: bool = False
    state_major: bool = False

    def __post_init__(self):
        for name in ("block_p", "n_tiles"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"DecodeConfig.{name} must be a power of two, got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"DecodeConfig.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")

    def label(self) -> str:
        flags = "".join(c for c, on in (("h", self.per_head), ("u", self.unmasked), ("o", self.offsets32),
                                        ("e", self.evict_first), ("s", self.state_major)) if on)
        return f"p{self.block_p} w{self.num_warps}" + (f" n/{self.n_tiles}" if self.n_tiles > 1 else "") \
            + (f" {flags}" if flags else "")


#: sweeps and tests: ``with override_decode_config(cfg):`` runs every decode launch inside with ``cfg``
_DECODE_OVERRIDES = ConfigStack()
override_decode_config = _DECODE_OVERRIDES.use


#: decode batches from which the programs go in state order (``DecodeConfig.state_major``). H200
#: sweep, 2026-12-02, bf16 activations, fp32 state, 8 x 128 tiles at 4 warps: Nemotron-H batch 16
#: / 64 / 256 34.3 / 130.2 / 526.3 us in state order against 35.9 / 140.9 / 590.7 requests first
#: (98% of the 4220 GB/s copy at 64 and 256, was 86-91%); Mamba-2 2.7B 64 / 256: 82.0 / 323.6 against
#: 87.0 / 350.5; at batch 1 requests first stays ahead (Nemotron-H 3.3 us against 3.5).
STATE_MAJOR_MIN_BATCH = 16


def decode_config(head_dim: int, state_size: int, batch: int = 0) -> DecodeConfig:
    """The decode launch for a head of ``head_dim`` rows x ``state_size`` columns and ``batch``
    requests: the active override, else (BLOCK_P, N) fp32 tiles of 1K values at 4 warps (8 x 128
    for Mamba-2) with every code variant on (per-head scalars, unmasked tiles, 32-bit offsets,
    evict-first), in state order from STATE_MAJOR_MIN_BATCH requests.
    The H200 sweep (``--sweep-decode``, 2026-12-01, bf16 activations, fp32 state) chose it: at
    batch 64 / 256, 1.16x / 1.13x the previous 16-row tiles without the variants (Mamba-2 2.7B)
    and 1.21x / 1.14x (Nemotron-H); best or within 4% of the best config at every batch >= 16,
    2.8 us at batch 1 (the best, 32 rows at 8 warps, 2.7)."""
    if _DECODE_OVERRIDES.top is not None:
        return _DECODE_OVERRIDES.top
    block_n = max(16, next_pow2(state_size))
    return DecodeConfig(block_p=max(1, min(next_pow2(head_dim), 1024 // block_n, 64)), num_warps=4,
                        per_head=True, unmasked=True, offsets32=True, evict_first=True,
                        state_major=batch >= STATE_MAJOR_MIN_BATCH)


def decode_meta(cfg: DecodeConfig, head_dim: int, state_size: int, per_head_layout: bool,
                offsets_fit_32: bool) -> dict:
    """The kernel's tile constexprs for ``cfg`` on a head of ``head_dim`` x ``state_size``:
    ``per_head_layout``: dt, A, D, dt_bias have stride 0 along head_dim (and d_state);
    ``offsets_fit_32``: every offset the kernel forms is below 2**31."""
    full_n = max(16, next_pow2(state_size))
    n_tiles = min(cfg.n_tiles, full_n)
    block_n = full_n // n_tiles
    block_p = max(1, min(cfg.block_p, next_pow2(head_dim)))
    return dict(BLOCK_P=block_p, BLOCK_N=block_n, N_TILES=n_tiles, PER_HEAD=cfg.per_head and per_head_layout,
                EVEN=cfg.unmasked and head_dim % block_p == 0 and state_size == block_n * n_tiles,
                OFF64=not (cfg.offsets32 and offsets_fit_32), EVICT="evict_first" if cfg.evict_first else "",
                STATE_MAJOR=cfg.state_major)


def decode_candidates() -> list[DecodeConfig]:
    """The configurations the decode sweep times (Mamba-2's 64 x 128 heads in mind): the default
    first, then all-flags-on variants over rows per program / warps / d_state tiles, then the
    default's shape with all flags on but one (each flag's share)."""
    lean = dict(per_head=True, unmasked=True, offsets32=True, evict_first=True)
    out = [DecodeConfig()]
    for bp, w, nt in ((16, 4, 1), (8, 4, 1), (4, 4, 1), (4, 2, 1), (1, 1, 1), (16, 8, 1), (32, 8, 1), (64, 16, 1),
                      (16, 4, 2), (32, 4, 4)):
        out.append(DecodeConfig(bp, w, nt, **lean))
    for flag in lean:
        out.append(DecodeConfig(16, 4, 1, **dict(lean, **{flag: False})))
    # the programs in a request's state order (Nemotron-H's batch 256 stayed at 86% of copy with
    # requests first: consecutive programs 4 MiB apart)
    for bp, w in ((8, 4), (4, 2), (16, 4), (8, 2), (32, 8)):
        out.append(DecodeConfig(bp, w, 1, **lean, state_major=True))
    return out


def _reach(t: torch.Tensor | None, sizes) -> int:
    """The largest element offset a kernel forms into ``t`` over index ranges ``sizes``."""
    return 0 if t is None else sum((n - 1) * abs(s) for n, s in zip(sizes, t.stride()))


def _decode_launch(x, dt, A, B, C, D, z, dt_bias, ssm_states, slots, dt_softplus, null_block_id) -> torch.Tensor:
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    out = torch.empty((T, H, P), dtype=x.dtype, device=x.device)
    S = slots.shape[0]
    if T == 0 or S == 0:
        return out
    cfg = decode_config(P, N, slots.shape[0])
    full_n = max(16, next_pow2(N))
    block_p = max(1, min(cfg.block_p, next_pow2(P)))
    p_pad = triton.cdiv(P, block_p) * block_p
    per_head = (A.stride(1) == 0 and A.stride(2) == 0 and dt.stride(2) == 0
                and (D is None or D.stride(1) == 0) and (dt_bias is None or dt_bias.stride(1) == 0))
    reach = max(_reach(ssm_states, (ssm_states.shape[0], H, p_pad, full_n)),
                *(_reach(t, (S, H, p_pad)) for t in (x, dt, z, out)),
                *(_reach(t, (S, G, full_n)) for t in (B, C)), _reach(A, (H, p_pad, full_n)))
    meta = decode_meta(cfg, P, N, per_head, reach < 2**31)
    any_ = x  # a valid pointer for absent optional tensors (never read)
    with device_guard(x.device):
        grid = (triton.cdiv(P, block_p), H, S) if cfg.state_major else (S, H, triton.cdiv(P, block_p))
        _decode_kernel[grid](
            x, dt, A, B, C, D if D is not None else any_, z if z is not None else any_,
            dt_bias if dt_bias is not None else any_, ssm_states, out, slots, null_block_id, P, N, H // G,
            *x.stride(), *dt.stride(), *A.stride(), *B.stride(), *C.stride(), *_strides(D, 2), *_strides(z, 3),
            *_strides(dt_bias, 2), *ssm_states.stride(), out.stride(0), out.stride(1),
            HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus,
            **meta, num_warps=cfg.num_warps)
    return out


def _strides(t: torch.Tensor | None, dims: int) -> tuple[int, ...]:
    return (0,) * dims if t is None else tuple(t.stride())


def _launch(x, dt, A, B, C, D, z, dt_bias, ssm_states, qsl, slots, init, dt_softplus, null_block_id) -> torch.Tensor:
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
            qsl.to(torch.int32), slots, init.to(torch.int8),
            null_block_id, P, N, H // G,
            *x.stride(), *dt.stride(), *A.stride(), *B.stride(), *C.stride(), *_strides(D, 2), *_strides(z, 3),
            *_strides(dt_bias, 2), *ssm_states.stride(), out.stride(0), out.stride(1),
            HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus,
            BLOCK_P=block_p, BLOCK_N=block_n, num_warps=4)
    return out


def selective_scan(x, dt, A, B, C, D, z, dt_bias, ssm_states, query_start_loc, cache_indices, has_initial_state,
                   dt_softplus, null_block_id) -> torch.Tensor:
    return _launch(x, dt, A, B, C, D, z, dt_bias, ssm_states, query_start_loc, cache_indices, has_initial_state,
                   dt_softplus, null_block_id)


def selective_state_update(ssm_states, x, dt, A, B, C, D, z, dt_bias, cache_indices, dt_softplus,
                           null_block_id) -> torch.Tensor:
    """One token per request, always from the cached state: ``_decode_kernel`` at
    ``decode_config``'s launch (one launch, nothing allocated besides the output)."""
    return _decode_launch(x, dt, A, B, C, D, z, dt_bias, ssm_states, cache_indices, dt_softplus, null_block_id)


KERNELS = {
    "customop::selective_scan": selective_scan,
    "customop::selective_state_update": selective_state_update,
}
