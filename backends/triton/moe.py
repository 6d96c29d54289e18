"""Triton kernels of the MoE experts: ``customop::moe_align_block_size`` and
``customop::fused_experts``.

``fused_experts`` on the Triton route (``moe_tuning`` may choose ``torch._grouped_mm`` instead):

1. alignment: count the (token, k) slots per local expert (atomics), prefix-sum the counts padded
   to the token block ``BLOCK_M``, scatter each slot into its expert's run; blocks past the used
   ones are skipped by the GEMMs, slots of remote experts (expert map) or id -1 are left out;
2. GEMM1, grouped: each program takes one ``BLOCK_M`` run of one expert, gathers its tokens' rows
   of x, and accumulates gate and up tiles of ``x @ w13[e]^T`` in fp32 (two accumulators), then
   applies the activation in the epilogue and writes one row per slot of ``[T*K, I]``;
3. GEMM2, grouped: ``act @ w2[e]^T`` per slot, times the fp32 router weight before the single
   cast, one row per slot of ``[T*K, H]``;
4. the top-k sum: ``out[t] = sum_k`` of the slot rows of local experts, in fp32, cast once.

Sparse decode (``T * top_k * 4 <= E``, no expert map) skips the alignment: each GEMM block is one
slot, its expert read from the ids. Ids outside ``[0, E)`` (which only the op classes' CPU check
rejects) are dropped on every route, never read out of bounds.

Both GEMMs accumulate in fp32; fp32 inputs use full-precision dots (``input_precision="ieee"``,
not TF32). Under the Triton interpreter (CI) bf16 operands are widened to fp32 before ``tl.dot``,
whose bf16 form is wrong there; the GPU runs the bf16 dot.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from customop.backends.triton import moe_tuning
from customop.backends.triton._common import device_guard, gelu_erf, gelu_tanh, next_pow2, silu
from customop.math import moe as _math

SILU, GELU, GELU_TANH, SWIGLU = (tl.constexpr(i) for i in range(4))
_ACT_CODES = {"silu": SILU, "gelu": GELU, "gelu_tanh": GELU_TANH, "swigluoai": SWIGLU, "swigluoai_uninterleave": SWIGLU}
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


# ---- alignment ----------------------------------------------------------------------------------


@triton.jit
def _local_expert(ids_ptr, map_ptr, offs, mask, n_ids, HAS_MAP: tl.constexpr):
    """The local expert of each slot, -1 for none: id -1, an id outside [0, n_ids) (dropped, not
    read out of bounds: devices skip the op classes' range check), or a remote expert."""
    e = tl.load(ids_ptr + offs, mask=mask, other=-1)
    e = tl.where((e >= 0) & (e < n_ids), e, -1)
    if HAS_MAP:
        e = tl.where(e >= 0, tl.load(map_ptr + tl.maximum(e, 0), mask=mask & (e >= 0), other=-1), -1)
    return e


@triton.jit
def _count_kernel(ids_ptr, map_ptr, counts_ptr, n_slots, n_ids, HAS_MAP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_slots
    e = _local_expert(ids_ptr, map_ptr, offs, mask, n_ids, HAS_MAP)
    tl.atomic_add(counts_ptr + e, 1, mask=mask & (e >= 0))


@triton.jit
def _offsets_kernel(counts_ptr, cursor_ptr, expert_ids_ptr, ntpp_ptr, n_experts, n_blocks,
                    BLOCK_SIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr):
    # one program: E <= 1024 counts fit in registers
    e = tl.arange(0, BLOCK_E)
    e_ok = e < n_experts
    counts = tl.load(counts_ptr + e, mask=e_ok, other=0)
    padded = (counts + BLOCK_SIZE - 1) // BLOCK_SIZE * BLOCK_SIZE
    ends = tl.cumsum(padded, 0)
    tl.store(cursor_ptr + e, ends - padded, mask=e_ok)  # the scatter's write positions start here
    total = tl.sum(padded, 0)
    tl.store(ntpp_ptr, total)
    for b0 in range(0, n_blocks, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        start = blocks * BLOCK_SIZE
        # a block's expert = the number of experts whose padded run ends at or before its start
        expert = tl.sum(((ends[None, :] <= start[:, None]) & e_ok[None, :]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + blocks, tl.where(start < total, expert, -1), mask=blocks < n_blocks)


@triton.jit
def _scatter_kernel(ids_ptr, map_ptr, cursor_ptr, sorted_ptr, n_slots, n_ids, HAS_MAP: tl.constexpr,
                    BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_slots
    e = _local_expert(ids_ptr, map_ptr, offs, mask, n_ids, HAS_MAP)
    valid = mask & (e >= 0)
    pos = tl.atomic_add(cursor_ptr + e, 1, mask=valid)  # order within a run: arrival order
    tl.store(sorted_ptr + pos, offs, mask=valid)


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int,
                         expert_map: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n_slots = topk_ids.numel()
    dev = topk_ids.device
    capacity = _math.align_capacity(n_slots, num_experts, block_size)
    n_blocks = triton.cdiv(capacity, block_size)
    sorted_ids = torch.full((capacity,), n_slots, dtype=torch.int32, device=dev)
    expert_ids = torch.empty((n_blocks,), dtype=torch.int32, device=dev)
    ntpp = torch.empty((1,), dtype=torch.int32, device=dev)
    counts = torch.zeros((num_experts,), dtype=torch.int32, device=dev)
    cursor = torch.empty((num_experts,), dtype=torch.int32, device=dev)
    ids = topk_ids.contiguous()
    emap = expert_map if expert_map is not None else ids
    n_ids = expert_map.numel() if expert_map is not None else num_experts
    block = 256
    grid = (max(1, triton.cdiv(n_slots, block)),)
    with device_guard(dev):
        _count_kernel[grid](ids, emap, counts, n_slots, n_ids, HAS_MAP=expert_map is not None, BLOCK=block)
        _offsets_kernel[(1,)](counts, cursor, expert_ids, ntpp, num_experts, n_blocks, BLOCK_SIZE=block_size,
                              BLOCK_E=next_pow2(num_experts), BLOCK_B=max(16, min(64, 4096 // next_pow2(num_experts))))
        _scatter_kernel[grid](ids, emap, cursor, sorted_ids, n_slots, n_ids, HAS_MAP=expert_map is not None,
                              BLOCK=block)
    return sorted_ids, expert_ids, ntpp


# ---- the grouped GEMM ---------------------------------------------------------------------------


@triton.jit
def _act(g, u, alpha, limit, beta, ACT: tl.constexpr):
    if ACT == SILU:
        return silu(tl.minimum(g, limit)) * tl.minimum(tl.maximum(u, -limit), limit)
    elif ACT == GELU:
        return gelu_erf(g) * u
    elif ACT == GELU_TANH:
        return gelu_tanh(g, _SQRT_2_OVER_PI) * u
    else:  # SWIGLU (gpt-oss form)
        g = tl.minimum(g, limit)
        return g * tl.sigmoid(alpha * g) * (tl.minimum(tl.maximum(u, -limit), limit) + beta)


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, w_ptr, sorted_ptr, expert_ids_ptr, ntpp_ptr,
    N, K, n_slots, n_experts, grid_m, a_stride, b_stride_e, b_stride_n, c_stride, bias_stride_e, up_offset, gate_step,
    alpha, limit, beta,
    A_DIV: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
    W_ON_INPUT: tl.constexpr, W_ON_OUTPUT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    NAIVE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # grouped program order: GROUP_M token blocks sweep N together, so their B tiles stay in L2
    pid = tl.program_id(0)
    grid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    if NAIVE:
        # decode without alignment: block pid_m is slot pid_m alone (row 0), its expert read from
        # the ids (expert_ids_ptr); a slot without a valid expert is left unwritten (the sum skips it)
        slot = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, n_slots)
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        if (expert < 0) | (expert >= n_experts):
            return
    else:
        if pid_m * BLOCK_M >= tl.load(ntpp_ptr):
            return
        slot = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    valid = slot < n_slots
    offs_k = tl.arange(0, BLOCK_K)
    # pointer tiles advanced by BLOCK_K per step (recomputing them each step costs registers);
    # out-of-range columns of N read row n % N (valid memory) and are masked at the store
    a_ptrs = a_ptr + (slot // A_DIV).to(tl.int64)[:, None] * a_stride + offs_k[None, :]
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    gate_rows = ((n % N) * gate_step).to(tl.int64)
    b_ptrs = b_ptr + expert * b_stride_e + gate_rows[None, :] * b_stride_n + offs_k[:, None]
    up_step = up_offset * b_stride_n
    if W_ON_INPUT:  # vLLM scales x by the weight in x's dtype before GEMM1
        w_in = tl.load(w_ptr + slot, mask=valid, other=0.0).to(a_ptr.dtype.element_ty).to(tl.float32)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & (offs_k[None, :] < k_left), other=0.0)
        if W_ON_INPUT:
            a = (a.to(tl.float32) * w_in[:, None]).to(a_ptr.dtype.element_ty)
        b_mask = offs_k[:, None] < k_left
        acc_g = _dot(a, tl.load(b_ptrs, mask=b_mask, other=0.0), acc_g, UPCAST, PRECISION)
        if GATED:
            acc_u = _dot(a, tl.load(b_ptrs + up_step, mask=b_mask, other=0.0), acc_u, UPCAST, PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    n_ok = n < N
    if HAS_BIAS:
        bias_row = bias_ptr + expert * bias_stride_e + gate_rows
        acc_g += tl.load(bias_row, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_u += tl.load(bias_row + up_offset, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = acc_g
    if GATED:
        y = _act(acc_g, acc_u, alpha, limit, beta, ACT)
    if W_ON_OUTPUT:
        y = y * tl.load(w_ptr + slot, mask=valid, other=0.0)[:, None]
    c = c_ptr + slot.to(tl.int64)[:, None] * c_stride + n[None, :]
    tl.store(c, y.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _topk_sum_kernel(c_ptr, ids_ptr, map_ptr, out_ptr, H, n_ids, TOPK: tl.constexpr, HAS_MAP: tl.constexpr,
                     BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOPK):
        slot = t * TOPK + k
        e = tl.load(ids_ptr + slot)
        e = tl.where((e >= 0) & (e < n_ids), e, -1)
        if HAS_MAP:
            e = tl.where(e >= 0, tl.load(map_ptr + tl.maximum(e, 0)), -1)
        # slots of remote experts were never computed: skip them (their rows are unwritten)
        acc += tl.load(c_ptr + slot * H + h, mask=h_ok & (e >= 0), other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + h, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


def _interpreted() -> bool:
    return type(_moe_gemm_kernel).__name__ == "InterpretedFunction"


def _gemm(a, b, c, bias, weights, align, grid_m, cfg: moe_tuning.GemmConfig, block_m: int, a_div: int,
          n: int, k: int, gated: tuple | None, w_on_input: bool, w_on_output: bool, naive: bool) -> None:
    sorted_ids, expert_ids, ntpp = align
    act, up_offset, gate_step, alpha, limit, beta = gated or (SILU, 0, 1, 1.0, math.inf, 0.0)
    dtype = a.dtype
    grid = (grid_m * triton.cdiv(n, cfg.block_n),)
    _moe_gemm_kernel[grid](
        a, b, c, bias if bias is not None else b, weights, sorted_ids, expert_ids, ntpp,
        n, k, weights.numel(), b.shape[0], grid_m, a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        bias.stride(0) if bias is not None else 0, up_offset, gate_step, alpha, limit, beta,
        A_DIV=a_div, GATED=gated is not None, ACT=act.value, HAS_BIAS=bias is not None, W_ON_INPUT=w_on_input,
        W_ON_OUTPUT=w_on_output, UPCAST=_interpreted() and dtype == torch.bfloat16,
        PRECISION="ieee" if dtype == torch.float32 else None, NAIVE=naive,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, expert_map: torch.Tensor | None, w13_bias: torch.Tensor | None,
                  w2_bias: torch.Tensor | None, activation: str, alpha: float, limit: float, beta: float,
                  apply_router_weight_on_input: bool) -> torch.Tensor:
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    n_local = w13.shape[0]
    inter = w2.shape[2]
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    cfg = moe_tuning.config(x.device, tokens, n_local, inter, hidden, top_k, x.dtype)
    if cfg.path == "grouped_mm" and moe_tuning.grouped_mm_applies(x.device, x.dtype, hidden, inter):
        return _math.fused_experts_grouped(x, w13, w2, topk_weights, topk_ids, expert_map, w13_bias, w2_bias,
                                           activation, alpha, limit, beta, apply_router_weight_on_input)
    act = _ACT_CODES[activation]
    # gate rows and the up rows' offset: halves [gate | up] or interleaved (gate, up) pairs
    gate_step, up_offset = (2, 1) if activation == "swigluoai" else (1, inter)
    weights = topk_weights.contiguous()
    ids = topk_ids.contiguous()
    slots = tokens * top_k
    # sparse decode (every slot likely its own expert, no expert map): no alignment, one block
    # per slot (vLLM's shortcut, same condition)
    naive = moe_tuning.sparse_decode(tokens, n_local, top_k, expert_map is not None)
    with device_guard(x.device):
        if naive:
            align, grid_m = (ids, ids, ids), slots
        else:
            align = moe_align_block_size(ids, cfg.block_m, n_local, expert_map)
            grid_m = min(align[1].numel(), slots)  # a used block holds at least one slot
        act_rows = torch.empty((slots, inter), dtype=x.dtype, device=x.device)
        _gemm(x, w13, act_rows, w13_bias, weights, align, grid_m, cfg.gemm1, cfg.block_m, top_k, inter, hidden,
              (act, up_offset, gate_step, alpha, limit, beta), apply_router_weight_on_input, False, naive)
        down_rows = torch.empty((slots, hidden), dtype=x.dtype, device=x.device)
        _gemm(act_rows, w2, down_rows, w2_bias, weights, align, grid_m, cfg.gemm2, cfg.block_m, 1, hidden, inter,
              None, False, not apply_router_weight_on_input, naive)
        block_h = min(1024, next_pow2(hidden))
        _topk_sum_kernel[(tokens, triton.cdiv(hidden, block_h))](
            down_rows, ids, expert_map if expert_map is not None else ids, out, hidden,
            expert_map.numel() if expert_map is not None else n_local, TOPK=top_k,
            HAS_MAP=expert_map is not None, BLOCK_H=block_h)
    return out


KERNELS = {
    "customop::moe_align_block_size": moe_align_block_size,
    "customop::fused_experts": fused_experts,
}
