"""Absorbed MLA decode over a paged latent cache: ``customop::mla_decode`` on CUDA, ROCm and XPU.

``mla_decode(q_latent [B, N, L], q_pe [B, N, R], kv_cache [blocks, block_size, L + R], block_table,
seq_lens, max_seq_len, scale)`` -> the latent output ``[B, N, L]`` (schema in
customop/ops/_library/mla.py). Split-context ("flash-decoding") in two kernels:

1. ``_split_kernel``, program ``(head block, split, row)``: ``BLOCK_H`` heads of one row share
   every cache tile they load (all heads attend over the same latent rows, which is what lets a
   decode step run at the cache's read bandwidth rather than once per head), and walk their
   split of the row's context ``BLOCK_N`` positions at a time through the block table. Scores
   ``q_latent . kv_c + q_pe . k_pe`` (two dots into one fp32 tile; ``scale * log2(e)`` folded in,
   base-2 softmax), an online softmax in fp32, and ``P @ kv_c`` from the same tile transposed (the
   latent is both key and value). Each program writes its normalised partial output and its
   log-sum-exp (``-inf`` for an empty split). Head blocks are the grid's fastest axis so that
   the programs reading one split's tiles run together and share them through L2.
2. ``_merge_kernel``, program ``(row, head)``: rescales the splits by their log-sum-exp and sums
   them. A row of length 0 has only empty splits and gets zeros.

The number of splits is chosen on the host without reading ``seq_lens``: enough programs to fill
the GPU twice over, at least ``MIN_SPLIT`` positions each, at most ``MAX_SPLITS``; the context
bound is ``max_seq_len`` when the caller knows it, else the block table's width times the block
size. Lengths are clamped into that width and block ids into the cache, so a malformed table
gives wrong rows, never a wild access. 16-bit inputs feed the tensor cores (the probabilities are
rounded to q's dtype before ``P @ kv_c``, as FlashAttention does); fp32 multiplies in full fp32.

So far this has run only under the Triton interpreter (tests/backends/triton/test_mla_triton.py);
the tile sizes are a first guess, not tuned on a GPU (tests/gpu/test_mla_cuda.py, benchmarks/specs/mla.py).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from customop.backends.triton._common import INTERPRETED, device_guard, interpreter_safe_dot, next_pow2

_LOG2E = 1.4426950408889634
#: heads per program (tl.dot needs at least 16 rows; fewer heads are masked)
BLOCK_H = 16
#: the fewest context positions a split gets, and the most splits
MIN_SPLIT = 256
MAX_SPLITS = 64
_OP = "customop::mla_decode"


@triton.jit
def _split_kernel(Q, QPE, C, BT, SL, MID_O, MID_LSE, qk_scale, num_blocks, table_width, heads,
                  stride_qb, stride_qh, stride_pb, stride_ph, stride_cb, stride_cs, stride_tb,
                  L: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                  NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    head_block = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.program_id(2)
    seq_len = tl.minimum(tl.maximum(tl.load(SL + row).to(tl.int32), 0), table_width * BLOCK_SIZE)
    # each split a multiple of BLOCK_N positions; trailing splits may be empty
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    hs = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = hs < heads
    lanes = tl.arange(0, BLOCK_L)
    l_ok = lanes < L
    pe = tl.arange(0, BLOCK_R)
    pe_ok = pe < R
    q = tl.load(Q + row.to(tl.int64) * stride_qb + hs[:, None] * stride_qh + lanes[None, :],
                mask=h_ok[:, None] & l_ok[None, :], other=0.0)
    q_pe = tl.load(QPE + row.to(tl.int64) * stride_pb + hs[:, None] * stride_ph + pe[None, :],
                   mask=h_ok[:, None] & pe_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    table = BT + row.to(tl.int64) * stride_tb
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        ok = pos < end
        block = tl.load(table + pos // BLOCK_SIZE, mask=ok, other=0)
        block = tl.minimum(tl.maximum(block, 0), num_blocks - 1).to(tl.int64)
        base = C + block * stride_cb + (pos % BLOCK_SIZE).to(tl.int64) * stride_cs
        kv = tl.load(base[None, :] + lanes[:, None], mask=l_ok[:, None] & ok[None, :], other=0.0)  # [BLOCK_L, BLOCK_N]
        k_pe = tl.load(base[None, :] + L + pe[:, None], mask=pe_ok[:, None] & ok[None, :], other=0.0)
        kv = kv.to(q.dtype)
        s = (interpreter_safe_dot(q, kv, PRECISION, UPCAST)
             + interpreter_safe_dot(q_pe, k_pe.to(q.dtype), PRECISION, UPCAST))
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile holds at least one position
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + interpreter_safe_dot(p.to(q.dtype), tl.trans(kv), PRECISION, UPCAST)
        m_i = m_new
    filled = l_i > 0
    out = acc / tl.where(filled, l_i, 1.0)[:, None]
    lse = tl.where(filled, m_i + tl.log2(tl.where(filled, l_i, 1.0)), float("-inf"))
    slot = (row.to(tl.int64) * heads + hs) * NUM_SPLITS + split  # MID_* are [B, N, NUM_SPLITS(, L)]
    tl.store(MID_O + slot[:, None] * BLOCK_L + lanes[None, :], out, mask=h_ok[:, None] & l_ok[None, :])
    tl.store(MID_LSE + slot, lse, mask=h_ok)


@triton.jit
def _merge_kernel(MID_O, MID_LSE, O, stride_ob, stride_oh, heads,
                  L: tl.constexpr, BLOCK_L: tl.constexpr, NUM_SPLITS: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    first = (row.to(tl.int64) * heads + head) * NUM_SPLITS
    lanes = tl.arange(0, BLOCK_L)
    l_ok = lanes < L
    m = tl.load(MID_LSE + first)
    for s in range(1, NUM_SPLITS):
        m = tl.maximum(m, tl.load(MID_LSE + first + s))
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty: every weight below is 0
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_L], tl.float32)
    for s in range(NUM_SPLITS):
        w = tl.exp2(tl.load(MID_LSE + first + s) - m)
        acc += w * tl.load(MID_O + (first + s) * BLOCK_L + lanes, mask=l_ok, other=0.0)
        total += w
    out = tl.where(total > 0, acc / tl.where(total > 0, total, 1.0), 0.0)
    tl.store(O + row.to(tl.int64) * stride_ob + head * stride_oh + lanes, out.to(O.dtype.element_ty), mask=l_ok)


def _config(dtype: torch.dtype, device_type: str) -> tuple[int, int]:
    """(BLOCK_N, warps): 32 positions and 8 warps for 16-bit (a [16, 512] fp32 accumulator plus a
    [512, 32] cache tile), 16 positions for fp32. A first guess; ROCm: half the warps (64 lanes)."""
    block_n, warps = (16, 8) if dtype == torch.float32 else (32, 8)
    if device_type == "cuda" and torch.version.hip is not None:
        warps //= 2
    return block_n, warps


@functools.cache
def _units(device_type: str, index: int) -> int:
    """Streaming multiprocessors (CUDA/ROCm) or compute units: what the grid has to fill."""
    if device_type == "cuda":
        return torch.cuda.get_device_properties(index).multi_processor_count
    if device_type == "xpu":
        return getattr(torch.xpu.get_device_properties(index), "gpu_subslice_count", 64)
    return 64


def num_splits(rows: int, heads: int, max_context: int, device: torch.device) -> int:
    """Context splits per row: about two programs per compute unit over the whole grid, each split
    at least ``MIN_SPLIT`` positions, at most ``MAX_SPLITS``."""
    if max_context <= 0:
        return 1
    index = device.index if device.index is not None else 0
    programs = rows * triton.cdiv(heads, BLOCK_H)
    want = triton.cdiv(2 * _units(device.type, index), max(programs, 1))
    return max(1, min(want, triton.cdiv(max_context, MIN_SPLIT), MAX_SPLITS))


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
                      seq_lens: torch.Tensor, scale: float, splits: int, block_n: int | None = None) -> torch.Tensor:
    """The two kernels with a given number of context splits (tests and sweeps pick it)."""
    rows, heads, lat = q_latent.shape
    rope = q_pe.shape[-1]
    out = torch.empty((rows, heads, lat), dtype=q_latent.dtype, device=q_latent.device)
    if out.numel() == 0:
        return out
    q_latent, q_pe, block_table = _unit_last(q_latent), _unit_last(q_pe), _unit_last(block_table)
    if kv_cache.stride(-1) != 1 or kv_cache.shape[0] == 0:
        raise ValueError(f"{_OP}: kv_cache must have unit last stride and at least one block")
    bn, warps = _config(q_latent.dtype, q_latent.device.type)
    bn = block_n or bn
    block_l, block_r = max(16, next_pow2(lat)), max(16, next_pow2(rope))
    mid_o = torch.empty((rows, heads, splits, block_l), dtype=torch.float32, device=out.device)
    mid_lse = torch.empty((rows, heads, splits), dtype=torch.float32, device=out.device)
    with device_guard(out.device):
        _split_kernel[(triton.cdiv(heads, BLOCK_H), splits, rows)](
            q_latent, q_pe, kv_cache, block_table, seq_lens, mid_o, mid_lse, scale * _LOG2E, kv_cache.shape[0],
            block_table.shape[1], heads, q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
            L=lat, R=rope, BLOCK_L=block_l, BLOCK_R=block_r, BLOCK_SIZE=kv_cache.shape[1], BLOCK_H=BLOCK_H,
            BLOCK_N=bn, NUM_SPLITS=splits, PRECISION="ieee" if q_latent.dtype == torch.float32 else "tf32",
            UPCAST=q_latent.dtype == torch.bfloat16 and INTERPRETED, num_warps=warps, num_stages=2)
        _merge_kernel[(rows, heads)](mid_o, mid_lse, out, out.stride(0), out.stride(1), heads,
                                     L=lat, BLOCK_L=block_l, NUM_SPLITS=splits, num_warps=4)
    return out


def mla_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, max_seq_len: int, scale: float) -> torch.Tensor:
    """The ``customop::mla_decode`` kernel (schema in customop/ops/_library/mla.py)."""
    _check(q_latent, q_pe, kv_cache, block_table, seq_lens)
    bound = block_table.shape[1] * kv_cache.shape[1]
    context = min(max_seq_len, bound) if max_seq_len > 0 else bound
    if context <= 0 or kv_cache.shape[0] == 0:
        return q_latent.new_zeros(q_latent.shape)  # nothing can be attended: every row's output is 0
    splits = num_splits(q_latent.shape[0], q_latent.shape[1], context, q_latent.device)
    return mla_decode_splits(q_latent, q_pe, kv_cache, block_table, seq_lens, scale, splits)


KERNELS = {_OP: mla_decode}
