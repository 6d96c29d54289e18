"""Triton kernel of MoE routing: ``customop::fused_topk`` and ``customop::grouped_topk`` in one
kernel (plain top-k is grouped top-k with one group).

One program takes ``BLOCK_T`` tokens with all their experts in registers (E <= 1024 in the
models that use these routers). Scores are fp32; top-k is ``K`` rounds of argmax (ties to the
lowest index, as the spec's stable sort) with the winner masked out, so no sort is needed; the
group step computes each group's score with masked row maxima and keeps ``topk_group`` groups the
same way. Outputs: fp32 weights, int32 ids, written once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from customop.backends.triton._common import device_guard, next_pow2

_NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _pick(values, cols, idx):
    """The entries of ``values`` at column ``idx`` per row: ``values[t, idx[t]]``."""
    return tl.sum(tl.where(cols[None, :] == idx[:, None], values, 0.0), axis=1)


@triton.jit
def _topk_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, n_tokens, n_experts, logits_stride, scale,
    TOPK: tl.constexpr, BLOCK_K: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr, GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < n_tokens
    col_ok = cols < n_experts
    mask = row_ok[:, None] & col_ok[None, :]
    logits = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * logits_stride + cols[None, :], mask=mask,
                     other=float("-inf")).to(tl.float32)
    # rows past the end compute on zeros (and are not stored): no inf - inf in them
    logits = tl.where(row_ok[:, None], logits, 0.0)
    if SOFTMAX:
        top = tl.max(logits, axis=1)
        p = tl.where(mask, tl.exp(logits - top[:, None]), 0.0)
        scores = p / tl.where(row_ok, tl.sum(p, axis=1), 1.0)[:, None]
    else:
        scores = tl.sigmoid(logits)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(col_ok[None, :], choice, _NEG_INF)

    if GROUPS > 1:
        group_size = n_experts // GROUPS
        gid = cols // group_size
        gcols = tl.arange(0, BLOCK_G)
        gscores = tl.full([BLOCK_T, BLOCK_G], float("-inf"), tl.float32)
        for g in tl.static_range(GROUPS):
            member = tl.where((gid == g)[None, :], choice, _NEG_INF)
            best = tl.max(member, axis=1)
            if HAS_BIAS:  # the sum of the two best: mask out one (the first) best and take the max again
                first = tl.argmax(member, axis=1)
                second = tl.max(tl.where(cols[None, :] == first[:, None], _NEG_INF, member), axis=1)
                best = best + tl.where(group_size > 1, second, 0.0)
            gscores = tl.where(gcols[None, :] == g, best[:, None], gscores)
        keep = tl.zeros([BLOCK_T, BLOCK_G], tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            win = tl.argmax(gscores, axis=1)
            hit = gcols[None, :] == win[:, None]
            keep = tl.where(hit, 1, keep)
            gscores = tl.where(hit, _NEG_INF, gscores)
        # a column stays eligible when its group is kept
        kept_cols = tl.zeros([BLOCK_T, BLOCK_E], tl.int32)
        for g in tl.static_range(GROUPS):
            kept_g = tl.sum(tl.where(gcols[None, :] == g, keep, 0), axis=1)
            kept_cols = tl.where((gid == g)[None, :] & (kept_g[:, None] > 0), 1, kept_cols)
        choice = tl.where(kept_cols > 0, choice, _NEG_INF)

    kcols = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    for k in tl.static_range(TOPK):
        win = tl.argmax(choice, axis=1)
        w = _pick(scores, cols, win)
        weights = tl.where(kcols[None, :] == k, w[:, None], weights)
        ids = tl.where(kcols[None, :] == k, win[:, None].to(tl.int32), ids)
        choice = tl.where(cols[None, :] == win[:, None], _NEG_INF, choice)
    if RENORMALIZE:
        weights = weights / tl.where(row_ok, tl.sum(weights, axis=1), 1.0)[:, None]
    weights = weights * scale
    out_mask = row_ok[:, None] & (kcols < TOPK)[None, :]
    out_offs = rows.to(tl.int64)[:, None] * TOPK + kcols[None, :]
    tl.store(weights_ptr + out_offs, weights, mask=out_mask)
    tl.store(ids_ptr + out_offs, ids, mask=out_mask)


def _block_t(n_experts_padded: int) -> int:
    # about 1K scores per program at 4 warps: 8 per thread per live tile (logits, scores, choice,
    # masks); compiled for sm_90, E=256 takes 72 registers at 4 rows, spills at 16
    return max(1, min(16, 1024 // n_experts_padded))


def _launch(gating_output: torch.Tensor, topk: int, renormalize: bool, scoring_func: str,
            bias: torch.Tensor | None, scale: float, groups: int, topk_group: int) -> tuple[torch.Tensor, torch.Tensor]:
    if scoring_func not in ("softmax", "sigmoid"):
        raise ValueError(f"customop moe routing: scoring_func must be 'softmax' or 'sigmoid', got {scoring_func!r}")
    n_tokens, n_experts = gating_output.shape
    weights = torch.empty((n_tokens, topk), dtype=torch.float32, device=gating_output.device)
    ids = torch.empty((n_tokens, topk), dtype=torch.int32, device=gating_output.device)
    if n_tokens == 0:
        return weights, ids
    logits = gating_output if gating_output.stride(-1) == 1 else gating_output.contiguous()
    block_e = next_pow2(n_experts)
    block_t = _block_t(block_e)
    with device_guard(gating_output.device):
        _topk_kernel[(triton.cdiv(n_tokens, block_t),)](
            logits, bias if bias is not None else logits, weights, ids, n_tokens, n_experts, logits.stride(0),
            float(scale), TOPK=topk, BLOCK_K=next_pow2(topk), SOFTMAX=scoring_func == "softmax",
            HAS_BIAS=bias is not None, RENORMALIZE=renormalize, GROUPS=groups, TOPK_GROUP=topk_group,
            BLOCK_G=next_pow2(groups), BLOCK_T=block_t, BLOCK_E=block_e, num_warps=4)
    return weights, ids


def fused_topk(gating_output: torch.Tensor, topk: int, renormalize: bool, scoring_func: str,
               e_score_correction_bias: torch.Tensor | None, routed_scaling_factor: float):
    return _launch(gating_output, topk, renormalize, scoring_func, e_score_correction_bias, routed_scaling_factor, 1, 1)


def grouped_topk(gating_output: torch.Tensor, topk: int, renormalize: bool, num_expert_group: int, topk_group: int,
                 scoring_func: str, routed_scaling_factor: float, e_score_correction_bias: torch.Tensor | None):
    return _launch(gating_output, topk, renormalize, scoring_func, e_score_correction_bias, routed_scaling_factor,
                   num_expert_group, topk_group)


KERNELS = {
    "customop::fused_topk": fused_topk,
    "customop::grouped_topk": grouped_topk,
}
