"""Absorbed MLA decode over a paged latent cache: ``customop::mla_decode`` on CUDA, ROCm and XPU.

``mla_decode(q_latent [B, N, L], q_pe [B, N, R], kv_cache [blocks, block_size, L + R], block_table,
seq_lens, max_seq_len, scale)`` -> the latent output ``[B, N, L]`` (schema in
customop/ops/_library/mla.py). Split-context ("flash-decoding") in two kernels:

1. ``_split_kernel``, program ``(head block, split, row)``: ``BLOCK_H`` heads of one row share
   every cache tile they load (all heads attend over the same latent rows, which is what lets a
   decode step run at the cache's read bandwidth rather than once per head), and walk their
   split of the row's context ``BLOCK_N`` positions at a time. When ``BLOCK_N`` divides the cache
   block size a tile never straddles a cache block: its block id is one scalar load and the
   tile is ``BLOCK_N`` contiguous cache rows, loaded as ``[BLOCK_N, L]`` and ``[BLOCK_N, R]``
   (no per-position gather); otherwise each position looks its block up. Scores
   ``q_latent . kv_cᵀ + q_pe . k_peᵀ`` (``q`` is the dots' A operand: ``BLOCK_H`` rows, so 64
   heads make the M=64 tiles of Hopper's wgmma), ``scale * log2(e)`` folded in, an online
   base-2 softmax in fp32, and ``P @ kv_c`` into an fp32 ``[BLOCK_H, L]`` accumulator from the
   same tile (the latent is both key and value; P rounded to q's dtype, as FlashAttention does).
   The loop is software-pipelined (``tl.range(num_stages=...)``). Each program writes its
   normalised partial output and its log-sum-exp (``-inf`` for an empty split). Head blocks are
   the grid's fastest axis, so the programs reading one split's tiles run together and share
   them through L2.
2. ``_merge_kernel``, program ``(row, head, lane block)``: loads every split's log-sum-exp and
   partial output for its lanes at once, rescales and sums them. A row of length 0 has only
   empty splits and gets zeros. With one split there is no merge: the split kernel writes the
   output itself (``DIRECT``).

Value halves (``Config.v_splits`` 2): axis 0 of the split grid also runs over two halves of the
latent lanes; each program still scores with all ``L + R`` lanes (its own half's dot, the other
half's, the rope's) but accumulates and writes only its half of ``P @ kv_c``. That halves the
accumulator (``[64, 256]`` fp32 fits one warpgroup) and doubles the programs, at the price of
scoring every tile twice; ``choose`` takes it (``HALVES``) where the splits are short (batch 1 x
4096 on the H200: 18.5 -> 15.2 us).

The tiles and the split policy come from one function, ``config`` (a ``Config``: heads and
positions per tile, warps, pipeline stages, ``wave``: how many programs per compute unit the
splits aim for, and ``v_splits``), and ``choose``, which may swap in ``HALVES`` for the call's
batch and context; ``override(Config(...))`` replaces both for a sweep
(``python -m customop.benchmarks.specs.mla --sweep``). Nothing is autotuned on the request path.
The number of splits is chosen on the host without reading ``seq_lens``: about ``wave`` programs
per compute unit, at least ``MIN_SPLIT`` positions each, at most ``MAX_SPLITS``, a power of two;
the context bound is ``max_seq_len`` when the caller knows it, else the block table's width times
the block size.
It is a runtime argument of both kernels (the split kernel compiles once per tile config and
one-split-or-not, the merge once per power of two of the split count, whatever the batch). Lengths are clamped into that width and block ids into the cache, so a malformed table
gives wrong rows, never a wild access. 16-bit inputs feed the tensor cores; fp32 multiplies in
full fp32 (IEEE, small tiles: the fp32 path is for correctness, not speed).

The 16-bit CUDA tiles (64 heads, 64 positions, 8 warps, 2 stages on sm_90/sm_100) are chosen for
Hopper's tensor cores (the three dots compile to wgmma) and shared memory, and picked by the H200
sweep (2026-12-01, BENCHMARKS.md): DeepSeek-V3 shapes run 3.3-5x faster than the first 16-head
kernel, but reach only 17-28% of the latent-cache read floor (b64 x 4096: 268 us; b1 x 32768:
52 us; the targets, 70%, need a kernel that keeps the tensor cores fed while the next tile loads
in a separate warp group, as FlashMLA does). The GPU tests (tests/gpu/test_mla_cuda.py) passed on
the H200. Other GPUs keep small first-guess tiles, never timed.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from customop.backends.triton._common import INTERPRETED, ConfigStack, device_guard, next_pow2

_LOG2E = 1.4426950408889634
#: the fewest context positions a split gets (one 64-position tile), and the most splits. H200,
#: 2026-12-03, DeepSeek-V3 shapes, bf16 (h200/2026-12-03-mla-split-sweep-scratch.txt), us at
#: 256 -> 64 positions a split (compile): batch 1 x 1024 / 2048 / 4096 / 8192 positions 21.77 /
#: 22.74 / 24.37 / 24.56 -> 14.30 / 14.05 / 18.40 / 21.96 (12.12 / 14.51 / 19.04 / 21.43); 128
#: was 0.7 us faster at 1 x 4096 and 1.8-3.6 slower at 1024-2048
MIN_SPLIT = 64
MAX_SPLITS = 64
#: fp32 partial outputs one merge program loads at once (splits x lanes: 32 KB)
_MERGE_TILE = 8192
_OP = "customop::mla_decode"


@triton.jit
def _mma(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` (fp32 ``acc``); ``UPCAST`` (bf16 under the interpreter, which multiplies
    bf16 tiles as their uint16 bits in triton 3.7.1): through fp32, exact for bf16 products."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


# the split count and the cache/table sizes vary per call: no recompile when they do
@triton.jit(do_not_specialize=["num_blocks", "table_width", "num_splits"])
def _split_kernel(Q, QPE, C, BT, SL, MID_O, MID_LSE, O, qk_scale, num_blocks, table_width, heads, num_splits,
                  stride_qb, stride_qh, stride_pb, stride_ph, stride_cb, stride_cs, stride_tb, stride_ob, stride_oh,
                  L: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
                  V_SPLITS: tl.constexpr, BLOCK_V: tl.constexpr, DIRECT: tl.constexpr, PRECISION: tl.constexpr,
                  UPCAST: tl.constexpr):
    # axis 0: head block x value half (V_SPLITS 2: each program accumulates BLOCK_V of the L lanes)
    head_block = tl.program_id(0) // V_SPLITS
    half = tl.program_id(0) % V_SPLITS
    split = tl.program_id(1)
    row = tl.program_id(2)
    seq_len = tl.minimum(tl.maximum(tl.load(SL + row).to(tl.int32), 0), table_width * BLOCK_SIZE)
    # each split a multiple of BLOCK_N positions (so, when BLOCK_N divides BLOCK_SIZE, no tile
    # straddles a cache block); trailing splits may be empty
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    hs = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = hs < heads
    # the lanes this program accumulates (all L with one value split); with two, the score also
    # needs the other half's lanes (`rest`), loaded and multiplied separately
    lanes = half * BLOCK_V + tl.arange(0, BLOCK_V)
    l_ok = lanes < L
    pe = tl.arange(0, BLOCK_R)
    pe_ok = pe < R
    q_rows = Q + row.to(tl.int64) * stride_qb + hs[:, None] * stride_qh
    q = tl.load(q_rows + lanes[None, :], mask=h_ok[:, None] & l_ok[None, :], other=0.0)
    if V_SPLITS == 2:
        rest = (1 - half) * BLOCK_V + tl.arange(0, BLOCK_V)
        rest_ok = rest < L
        q_rest = tl.load(q_rows + rest[None, :], mask=h_ok[:, None] & rest_ok[None, :], other=0.0)
    q_pe = tl.load(QPE + row.to(tl.int64) * stride_pb + hs[:, None] * stride_ph + pe[None, :],
                   mask=h_ok[:, None] & pe_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    table = BT + row.to(tl.int64) * stride_tb
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in tl.range(start, end, BLOCK_N, num_stages=STAGES):
        ok = n0 + offs_n < end
        if BLOCK_SIZE % BLOCK_N == 0:  # the tile is BLOCK_N contiguous rows of one cache block
            block = tl.load(table + n0 // BLOCK_SIZE)
            block = tl.minimum(tl.maximum(block, 0), num_blocks - 1).to(tl.int64)
            first = C + block * stride_cb + (n0 % BLOCK_SIZE) * stride_cs
            rows = first + offs_n * stride_cs  # [BLOCK_N] row pointers, int32 offsets
        else:  # a block lookup per position
            pos = n0 + offs_n
            block = tl.load(table + pos // BLOCK_SIZE, mask=ok, other=0)
            block = tl.minimum(tl.maximum(block, 0), num_blocks - 1).to(tl.int64)
            rows = C + block * stride_cb + (pos % BLOCK_SIZE).to(tl.int64) * stride_cs
        if BLOCK_L == L:
            kv = tl.load(rows[:, None] + lanes[None, :], mask=ok[:, None], other=0.0)  # [BLOCK_N, BLOCK_V]
        else:
            kv = tl.load(rows[:, None] + lanes[None, :], mask=ok[:, None] & l_ok[None, :], other=0.0)
        if BLOCK_R == R:
            k_pe = tl.load(rows[:, None] + L + pe[None, :], mask=ok[:, None], other=0.0)  # [BLOCK_N, BLOCK_R]
        else:
            k_pe = tl.load(rows[:, None] + L + pe[None, :], mask=ok[:, None] & pe_ok[None, :], other=0.0)
        kv = kv.to(q.dtype)
        s = _mma(q, tl.trans(kv), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), PRECISION, UPCAST)
        if V_SPLITS == 2:
            if BLOCK_L == L:
                kv_rest = tl.load(rows[:, None] + rest[None, :], mask=ok[:, None], other=0.0)
            else:
                kv_rest = tl.load(rows[:, None] + rest[None, :], mask=ok[:, None] & rest_ok[None, :], other=0.0)
            s = _mma(q_rest, tl.trans(kv_rest.to(q.dtype)), s, PRECISION, UPCAST)
        s = _mma(q_pe, tl.trans(k_pe.to(q.dtype)), s, PRECISION, UPCAST)
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile holds at least one position
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _mma(p.to(q.dtype), kv, acc * alpha[:, None], PRECISION, UPCAST)
        m_i = m_new
    filled = l_i > 0
    out = acc / tl.where(filled, l_i, 1.0)[:, None]  # an empty split: zeros
    if DIRECT:  # one split: the output itself, no merge
        tl.store(O + row.to(tl.int64) * stride_ob + hs[:, None] * stride_oh + lanes[None, :],
                 out.to(O.dtype.element_ty), mask=h_ok[:, None] & l_ok[None, :])
    else:
        lse = tl.where(filled, m_i + tl.log2(tl.where(filled, l_i, 1.0)), float("-inf"))
        slot = (row.to(tl.int64) * heads + hs) * num_splits + split  # MID_* are [B, N, splits(, BLOCK_L)]
        tl.store(MID_O + slot[:, None] * BLOCK_L + lanes[None, :], out, mask=h_ok[:, None] & l_ok[None, :])
        # one writer per slot: the halves' scores agree to fp32 rounding (their dots add in another
        # order), and the first half's log-sum-exp weighs both, so the merge is deterministic
        tl.store(MID_LSE + slot, lse, mask=h_ok & (half == 0))


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(MID_O, MID_LSE, O, stride_ob, stride_oh, heads, num_splits,
                  L: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_LM: tl.constexpr):
    # every split of one (row, head) and BLOCK_LM lanes in one load: no loop whose loads wait in turn
    row = tl.program_id(0)
    head = tl.program_id(1)
    first = (row.to(tl.int64) * heads + head) * num_splits
    splits = tl.arange(0, BLOCK_S)
    s_ok = splits < num_splits
    lanes = tl.program_id(2) * BLOCK_LM + tl.arange(0, BLOCK_LM)
    l_ok = lanes < L
    lse = tl.load(MID_LSE + first + splits, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty: every weight below is 0
    w = tl.exp2(lse - m)
    total = tl.sum(w, 0)
    part = tl.load(MID_O + (first + splits)[:, None] * BLOCK_L + lanes[None, :], mask=s_ok[:, None] & l_ok[None, :],
                   other=0.0)
    acc = tl.sum(w[:, None] * part, 0)
    out = tl.where(total > 0, acc / tl.where(total > 0, total, 1.0), 0.0)
    tl.store(O + row.to(tl.int64) * stride_ob + head * stride_oh + lanes, out.to(O.dtype.element_ty), mask=l_ok)


# ---- the tile and split choice ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    """One launch configuration of ``_split_kernel``: ``block_h`` heads and ``block_n`` positions
    per tile, ``warps``, ``stages`` (software pipeline depth of the cache loads), and ``wave``:
    the splits aim for about ``wave`` programs per compute unit over the grid, each split at
    least ``min_split`` context positions."""

    block_h: int
    block_n: int
    warps: int
    stages: int
    wave: float = 1.0
    min_split: int = MIN_SPLIT
    v_splits: int = 1

    def __post_init__(self):
        if self.v_splits not in (1, 2):
            raise ValueError(f"{_OP}: Config.v_splits must be 1 or 2, got {self.v_splits}")

    def __str__(self) -> str:
        base = f"h{self.block_h} n{self.block_n} w{self.warps} s{self.stages} x{self.wave:g}"
        base = base if self.min_split == MIN_SPLIT else f"{base} m{self.min_split}"
        return base if self.v_splits == 1 else f"{base} v{self.v_splits}"


#: sweeps and tests: ``with override(cfg):`` runs every launch inside with ``cfg`` as given
_OVERRIDES = ConfigStack()
override = _OVERRIDES.use


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def tiles(dtype: torch.dtype, heads: int, block_size: int, hopper: bool, hip: bool = False) -> Config:
    """The default configuration (``config`` without an override; ``hopper``: NVIDIA sm_90/sm_100).

    - 16-bit on Hopper: 64 heads per program (``q`` [64, 576] is the dots' A operand: wgmma's
      M=64; an fp32 [64, 512] accumulator over 8 warps is 128 registers a thread), 64 positions a
      tile when the cache block size is a multiple of 64, else 32 (16 when it is a multiple of 16
      but not of 32, so tiles stay inside a block), 2 stages (``q`` and two [64, 576] cache tiles
      in shared memory: 216 KB of the 227 KB), about one program per SM over the grid. Measured
      on the H200 (``--sweep``, 2026-12-01): 64 positions beat 32 by 1.3-1.5x at every shape;
      32 heads, 3 stages, or twice / half the splits were slower;
    - fewer heads: the next power of two (at least 16, tl.dot's minimum), 4 warps below 64;
    - fp32: 16 heads x 16 positions, 2 stages (IEEE fp32 multiplies, no tensor cores; one stage
      spills on sm_90), 2 programs per unit;
    - other GPUs (older NVIDIA, ROCm: half the warps for 64-lane wavefronts, XPU): 16 heads x 32
      positions, one stage, 2 programs per unit (first guesses, never timed)."""
    block_n = 16 if block_size % 32 and not block_size % 16 else 32
    if dtype == torch.float32:
        return Config(16, 16, 4 if hip else 8, 2, 2.0)
    if hopper:
        fit = max(16, min(64, next_pow2(heads)))
        # 64 positions a tile where they stay inside a cache block: the H200 sweep's best at every
        # DeepSeek-V3 shape (b64 x 4096: 268 us against 397 at 32 positions, 668 at 16)
        return Config(fit, 64 if fit >= 64 and block_size % 64 == 0 else block_n, 8 if fit >= 64 else 4, 2, 1.0)
    return Config(16, block_n, 4 if hip else 8, 1, 2.0)


def config(dtype: torch.dtype, heads: int, block_size: int, device: torch.device) -> Config:
    """The launch configuration: ``override``'s when one is active, else ``tiles``' for the
    device (the interpreter, device ``cpu``, takes the Hopper tiles so that tests run them)."""
    if _OVERRIDES.top is not None:
        return _OVERRIDES.top
    hip = device.type == "cuda" and torch.version.hip is not None
    hopper = device.type == "cpu" or (device.type == "cuda" and not hip and _capability(device.index or 0)[0] in (9, 10))
    return tiles(dtype, heads, block_size, hopper, hip)


@functools.cache
def _units(device_type: str, index: int) -> int:
    """Streaming multiprocessors (CUDA/ROCm) or compute units: what the grid has to fill."""
    if device_type == "cuda":
        return torch.cuda.get_device_properties(index).multi_processor_count
    if device_type == "xpu":
        return getattr(torch.xpu.get_device_properties(index), "gpu_subslice_count", 64)
    return 64


def num_splits(rows: int, heads: int, max_context: int, device: torch.device, cfg: Config) -> int:
    """Context splits per row: about ``cfg.wave`` programs per compute unit over the whole grid
    (rounded: 128 programs on 132 SMs stay one split), each split at least ``cfg.min_split``
    positions, at most ``MAX_SPLITS``, rounded down to a power of two."""
    if max_context <= 0:
        return 1
    index = device.index if device.index is not None else 0
    programs = max(1, rows * triton.cdiv(heads, cfg.block_h) * cfg.v_splits)
    want = int(cfg.wave * _units(device.type, index) / programs + 0.5)
    splits = max(1, min(want, triton.cdiv(max_context, cfg.min_split), MAX_SPLITS))
    # a power of two: 4 rows x 4096 positions in 17 splits (16 of 256 positions and an empty one,
    # merged over 32) took 33.9 us on the H200, in 16 splits 28.0
    return 1 << (splits.bit_length() - 1)


def _check(q_latent, q_pe, kv_cache, block_table, seq_lens) -> None:
    """The schema's contract (the op class checks the metadata with its own messages)."""
    if q_latent.dim() != 3 or q_pe.dim() != 3 or q_pe.shape[:2] != q_latent.shape[:2]:
        raise ValueError(f"{_OP}: q_latent [B, N, L] and q_pe [B, N, R], got {tuple(q_latent.shape)} and "
                         f"{tuple(q_pe.shape)}")
    rows, _, lat = q_latent.shape
    width = lat + q_pe.shape[-1]
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != width:
        raise ValueError(f"{_OP}: kv_cache must be [num_blocks, block_size, {width}] (L + R), got {tuple(kv_cache.shape)}")
    if q_pe.dtype != q_latent.dtype or not q_latent.is_floating_point():
        raise TypeError(f"{_OP}: q_latent and q_pe must share one floating dtype, got {q_latent.dtype} and {q_pe.dtype}")
    ints = (torch.int32, torch.int64)
    if block_table.dim() != 2 or block_table.shape[0] != rows or block_table.dtype not in ints:
        raise ValueError(f"{_OP}: block_table must be [{rows}, max_blocks] int32, got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    if seq_lens.shape != (rows,) or seq_lens.dtype not in ints:
        raise ValueError(f"{_OP}: seq_lens must be [{rows}] int32, got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    for name, t in (("q_pe", q_pe), ("kv_cache", kv_cache), ("block_table", block_table), ("seq_lens", seq_lens)):
        if t.device != q_latent.device:
            raise ValueError(f"{_OP}: {name} is on {t.device}, q_latent on {q_latent.device}")


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def mla_decode_splits(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, scale: float, splits: int, cfg: Config | None = None) -> torch.Tensor:
    """The two kernels with a given number of context splits and configuration (default:
    ``config``'s; tests and sweeps pick them)."""
    rows, heads, lat = q_latent.shape
    rope = q_pe.shape[-1]
    out = torch.empty((rows, heads, lat), dtype=q_latent.dtype, device=q_latent.device)
    if out.numel() == 0:
        return out
    q_latent, q_pe, block_table = _unit_last(q_latent), _unit_last(q_pe), _unit_last(block_table)
    if kv_cache.stride(-1) != 1 or kv_cache.shape[0] == 0:
        raise ValueError(f"{_OP}: kv_cache must have unit last stride and at least one block")
    cfg = cfg or config(q_latent.dtype, heads, kv_cache.shape[1], q_latent.device)
    block_l, block_r = max(16, next_pow2(lat)), max(16, next_pow2(rope))
    if cfg.v_splits == 2 and block_l < 32:
        raise ValueError(f"{_OP}: two value halves need at least 32 latent lanes (each half is a dot's K of 16 or "
                         f"more), got L={lat}")
    direct = splits == 1
    if direct:  # the split kernel writes the output; MID_* are never touched
        mid_o = mid_lse = out
    else:
        mid_o = torch.empty((rows, heads, splits, block_l), dtype=torch.float32, device=out.device)
        mid_lse = torch.empty((rows, heads, splits), dtype=torch.float32, device=out.device)
    with device_guard(out.device):
        _split_kernel[(triton.cdiv(heads, cfg.block_h) * cfg.v_splits, splits, rows)](
            q_latent, q_pe, kv_cache, block_table, seq_lens, mid_o, mid_lse, out, scale * _LOG2E, kv_cache.shape[0],
            block_table.shape[1], heads, splits, q_latent.stride(0), q_latent.stride(1), q_pe.stride(0),
            q_pe.stride(1), kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0), out.stride(0),
            out.stride(1), L=lat, R=rope, BLOCK_L=block_l, BLOCK_R=block_r, BLOCK_SIZE=kv_cache.shape[1],
            BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, STAGES=cfg.stages, V_SPLITS=cfg.v_splits,
            BLOCK_V=block_l // cfg.v_splits, DIRECT=direct,
            PRECISION="ieee" if q_latent.dtype == torch.float32 else "tf32",
            UPCAST=q_latent.dtype == torch.bfloat16 and INTERPRETED, num_warps=cfg.warps)
        if not direct:
            block_s = next_pow2(splits)
            block_lm = min(block_l, max(16, _MERGE_TILE // block_s))
            _merge_kernel[(rows, heads, triton.cdiv(lat, block_lm))](
                mid_o, mid_lse, out, out.stride(0), out.stride(1), heads, splits,
                L=lat, BLOCK_L=block_l, BLOCK_S=block_s, BLOCK_LM=block_lm, num_warps=4)
    return out


#: the Hopper tiles' short-split form: two value halves a head block, one warpgroup each
#: (``[64, 256]`` fp32 accumulator: 128 registers a thread at 4 warps, against ``[64, 512]`` at 8)
HALVES = Config(64, 64, 4, 2, 1.0, MIN_SPLIT, 2)
#: the longest split (positions) for which HALVES replaces the Hopper tiles. H200, 2026-12-03,
#: DeepSeek-V3 shapes, bf16, us, Hopper tiles -> HALVES (compile): batch 1 x 2048 / 4096 / 8192
#: positions (splits of 64 / 64 / 128) 14.17 / 18.77 / 21.84 -> 12.53 / 15.36 / 20.15 (15.07 /
#: 19.02 / 21.21), 2 x 4096 (128) 20.82 -> 20.59; longer splits lose: 4 x 4096 (256) 28.92 ->
#: 29.05, 1 x 32768 (512) 52.38 -> 54.11, 64 x 4096 (one split of 4096) 267 -> 355
HALVES_MAX_SPLIT = 128


def choose(dtype: torch.dtype, rows: int, heads: int, latent: int, context: int, block_size: int,
           device: torch.device) -> tuple[Config, int]:
    """The launch configuration and split count for a call: ``config``'s tiles and
    ``num_splits``, except that the Hopper tiles give way to ``HALVES`` (same positions a tile,
    twice the programs, each accumulating half the latent lanes on one warpgroup) when their
    splits would hold at most ``HALVES_MAX_SPLIT`` positions and HALVES' grid still fits one
    wave (one program an SM: both take 216 KB of shared memory), the latent at least 32 lanes
    (two dots of 16): there, a program's fixed cost (its q, its 128-register accumulator,
    its partial output) outweighs its chain of tiles, and HALVES' programs carry half of it. An
    ``override`` is taken as given."""
    cfg = config(dtype, heads, block_size, device)
    splits = num_splits(rows, heads, context, device, cfg)
    hopper_16bit = dtype != torch.float32 and cfg == tiles(dtype, heads, block_size, hopper=True)
    if (_OVERRIDES.top is None and hopper_16bit and (cfg.block_h, cfg.block_n) == (HALVES.block_h, HALVES.block_n)
            and latent >= 32 and triton.cdiv(context, splits) <= HALVES_MAX_SPLIT):
        halves = num_splits(rows, heads, context, device, HALVES)
        programs = rows * triton.cdiv(heads, HALVES.block_h) * HALVES.v_splits * halves
        if programs <= _units(device.type, device.index if device.index is not None else 0):  # one wave
            return HALVES, halves
    return cfg, splits


def mla_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, max_seq_len: int, scale: float) -> torch.Tensor:
    """The ``customop::mla_decode`` kernel (schema in customop/ops/_library/mla.py)."""
    _check(q_latent, q_pe, kv_cache, block_table, seq_lens)
    bound = block_table.shape[1] * kv_cache.shape[1]
    context = min(max_seq_len, bound) if max_seq_len > 0 else bound
    if context <= 0 or kv_cache.shape[0] == 0:
        return q_latent.new_zeros(q_latent.shape)  # nothing can be attended: every row's output is 0
    rows, heads, lat = q_latent.shape
    cfg, splits = choose(q_latent.dtype, rows, heads, lat, context, kv_cache.shape[1], q_latent.device)
    return mla_decode_splits(q_latent, q_pe, kv_cache, block_table, seq_lens, scale, splits, cfg)


KERNELS = {_OP: mla_decode}
