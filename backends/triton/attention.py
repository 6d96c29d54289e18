"""Encoder attention over packed sequences: ``customop::mm_encoder_attn`` on CUDA, ROCm and XPU, and
``customop::varlen_attn``, the same with a ``causal`` flag (MLA's prefill: docs/mla.md).

``mm_encoder_attn(query [T, Hq, D], key/value [T, Hkv, D], cu_seqlens, max_seqlen, scale)``: one
launcher, three implementations, chosen per call from the inputs (never by timing at run time):

- one batched ``F.scaled_dot_product_attention`` call, no mask, when every segment has the same
  length, which the host knows without reading ``cu_seqlens``: no segment is longer than
  ``max_seqlen``, so ``T == segments * max_seqlen`` forces each to be exactly ``max_seqlen`` (a
  ViT's equal tiles, a single image). On the H200 (2026-12-01, torch 2.11) batched SDPA calls
  beat torch's varlen flash attention 1.5x at 16 heads of 80 and 16384 tokens in 4, 16 and 64
  segments and 1.7x on one segment of 4096. 16-bit inputs on NVIDIA GPUs; GQA through SDPA's
  ``enable_gqa``.
- torch's own varlen flash attention (``torch.nn.attention.varlen.varlen_attn``, FlashAttention-2
  inside torch) for what it takes: fp16/bf16 on an NVIDIA GPU of compute capability 8.0 or
  newer, head sizes that are multiples of 8 up to 256 (64, 72, 80, 96, 128 all are). The
  project does not rewrite it: on the H200 it measured 265 / 240 / 172 TFLOP/s at 16 heads of
  80 and 16384 tokens in 4 / 16 / 64 segments, where a loop of SDPA calls reached 288 / 72 / 3.6
  (2026-11-29; issue 13). GQA goes to it where its ``varlen_attn`` takes ``enable_gqa`` (torch
  2.11's does not: GQA with uneven segments then runs the Triton kernel).
- the Triton kernel below for everything else: fp32 (torch's flash kernels take 16-bit only),
  AMD and Intel GPUs, older NVIDIA GPUs, head sizes torch's kernel refuses (up to 256).
  Head sizes above 256 run the op's reference (the spec's segment loop) on the device.

``causal`` goes through the same three: SDPA's ``is_causal`` on the equal-segment batch (square
per segment, so its top-left mask is the segment's causal one), torch's varlen flash attention
with ``is_causal`` or, in the torch releases that replaced it, ``window_size=(-1, 0)`` (a release
with neither sends causal calls to Triton), and the kernel's ``CAUSAL`` mask.

The Triton kernel is a FlashAttention-2-style forward (``CAUSAL``: masked to keys ``<=`` the row, and
the key loop stops after the tile's last row, so a causal segment costs about half): program
``(m, segment, head)`` loads a ``[BLOCK_M, D]`` tile of the segment's queries once, streams the
segment's keys and values in ``[BLOCK_N, D]`` tiles, keeps the running max and sum of an online
softmax in fp32 (base 2: ``scale * log2(e)`` is folded into the scores), and writes the
normalised tile once. Segments are read from ``cu_seqlens`` on the device (no host sync); each is
clamped into ``[0, T]`` so that a malformed ``cu_seqlens`` cannot reach memory outside the
tensors. The head dim is padded to a power of two with masked lanes (72 and 80 compute as 128).
fp32 inputs multiply in full fp32 (``input_precision="ieee"``: tf32 would miss fp32's
tolerance by 100x); 16-bit ones feed the tensor cores and round the probabilities to the input
dtype before ``P @ V``, as FlashAttention does.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from customop.backends.triton._common import INTERPRETED, device_guard, interpreter_safe_dot, next_pow2
from customop.math import attention as _math

#: head sizes the Triton kernel takes (its padded tile must fit the registers)
MAX_HEAD_DIM = 256
_LOG2E = 1.4426950408889634


@triton.jit
def _varlen_attention_kernel(Q, K, V, O, CU, total, qk_scale,
                             stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                             stride_ot, stride_oh,
                             GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                             UPCAST: tl.constexpr, CAUSAL: tl.constexpr = False):
    block_m = tl.program_id(0)
    segment = tl.program_id(1)
    head = tl.program_id(2)
    # clamp the segment into the sequence: a malformed cu_seqlens gives wrong rows, never a wild access
    start = tl.minimum(tl.maximum(tl.load(CU + segment), 0), total)
    end = tl.minimum(tl.maximum(tl.load(CU + segment + 1), start), total)
    seqlen = end - start
    if block_m * BLOCK_M >= seqlen:
        return  # the grid covers max_seqlen; shorter segments leave programs idle
    kv_head = head // GROUP

    rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    lanes = tl.arange(0, BLOCK_D)
    row_ok = rows < seqlen
    lane_ok = lanes < HEAD_DIM
    tokens = (start + rows).to(tl.int64)
    q = tl.load(Q + tokens[:, None] * stride_qt + head * stride_qh + lanes[None, :],
                mask=row_ok[:, None] & lane_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = K + kv_head * stride_kh
    v_base = V + kv_head * stride_vh
    hi = seqlen
    if CAUSAL:
        hi = tl.minimum(seqlen, (block_m + 1) * BLOCK_M)  # no key past the tile's last row
    for n0 in range(0, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < seqlen
        if CAUSAL:
            col_ok = col_ok[None, :] & (cols[None, :] <= rows[:, None])
        else:
            col_ok = col_ok[None, :]
        key_tokens = (start + cols).to(tl.int64)
        k = tl.load(k_base + key_tokens[None, :] * stride_kt + lanes[:, None],
                    mask=lane_ok[:, None] & (cols < seqlen)[None, :], other=0.0)  # [BLOCK_D, BLOCK_N]
        s = interpreter_safe_dot(q, k, PRECISION, UPCAST) * qk_scale
        s = tl.where(col_ok, s, float("-inf"))
        # finite: the first tile holds key 0, which every row sees (causal too); a later tile
        # that a row sees none of adds exp2(-inf) = 0 and leaves its max
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + key_tokens[:, None] * stride_vt + lanes[None, :],
                    mask=(cols < seqlen)[:, None] & lane_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + interpreter_safe_dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(O + tokens[:, None] * stride_ot + head * stride_oh + lanes[None, :],
             out.to(O.dtype.element_ty), mask=row_ok[:, None] & lane_ok[None, :])


def _config(dtype: torch.dtype, block_d: int, device_type: str, causal: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages). 16-bit: 128 x 64 tiles with 8 warps up to D = 128 (the
    FlashAttention-2 shape for this head range), 64 x 32 with 4 beyond. fp32 multiplies without
    tensor cores and holds twice the bytes per tile: 64 x 32 with 8 warps, 16 x 16 with 4 beyond
    D = 128. Each compiles for sm_90 without register spills (tests/backends/triton/
    test_attention_triton.py compiles them); none is tuned on a GPU yet: the H200 serves 16-bit
    inputs with torch's kernel, and ``benchmarks/specs/attention.py``'s ``triton`` column times
    this one there. ROCm runs 64-lane wavefronts: half the warps. Causal 16-bit calls above 128
    lanes (MLA's 192-lane q/k in a 256-lane tile) take 32 x 16: compiled for sm_90 (2026-12-01,
    triton 3.7.1), 64 x 32 spills 1624 bytes there (and 1780 without the mask: the
    non-causal op keeps its tiles, unchanged), 32 x 16 none."""
    if dtype == torch.float32:
        block_m, block_n, warps = (64, 32, 8) if block_d <= 128 else (16, 16, 4)
    elif causal and block_d > 128:
        block_m, block_n, warps = 32, 16, 4
    else:
        block_m, block_n, warps = (128, 64, 8) if block_d <= 128 else (64, 32, 4)
    if device_type == "cuda" and torch.version.hip is not None:
        warps = max(1, warps // 2)
    return block_m, block_n, warps, 2


def triton_varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_seqlen: int, scale: float, block_m: int | None = None,
                            block_n: int | None = None, causal: bool = False) -> torch.Tensor:
    """The Triton kernel on packed ``[T, H, D]`` tensors (unit last stride); ``max_seqlen`` must
    bound the longest segment. ``block_m``/``block_n`` override the table (tests, sweeps)."""
    total, heads, head_dim = query.shape
    out = torch.empty((total, heads, head_dim), dtype=query.dtype, device=query.device)
    segments = cu_seqlens.shape[0] - 1
    if total == 0 or segments == 0 or max_seqlen <= 0:
        return out  # nothing to attend (a checked cu_seqlens with max_seqlen 0 has only empty segments)
    block_d = max(16, next_pow2(head_dim))
    bm, bn, warps, stages = _config(query.dtype, block_d, query.device.type, causal)
    bm, bn = block_m or bm, block_n or bn
    grid = (triton.cdiv(max_seqlen, bm), segments, heads)
    with device_guard(query.device):
        _varlen_attention_kernel[grid](
            query, key, value, out, cu_seqlens, total, scale * _LOG2E,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            out.stride(0), out.stride(1),
            GROUP=heads // key.shape[1], HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=bm, BLOCK_N=bn,
            PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
            UPCAST=query.dtype == torch.bfloat16 and INTERPRETED, CAUSAL=causal, num_warps=warps, num_stages=stages)
    return out


@functools.cache
def _torch_varlen():
    """torch's ``varlen_attn``, or None where the installed torch lacks it or its ``scale``
    keyword (the first releases that had it took none)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    if "scale" not in inspect.signature(varlen_attn).parameters:
        return None
    return varlen_attn


@functools.cache
def _torch_varlen_groups_heads() -> bool:
    """Whether ``varlen_attn`` takes ``enable_gqa`` (torch 2.11's does not: GQA then goes to Triton)."""
    fn = _torch_varlen()
    return fn is not None and "enable_gqa" in inspect.signature(fn).parameters


@functools.cache
def _torch_varlen_causal() -> dict | None:
    """The keywords that make ``varlen_attn`` causal: ``is_causal=True`` where it has that argument,
    ``window_size=(-1, 0)`` where it has a window instead (torch 2.13), else None (causal calls
    then run the Triton kernel)."""
    fn = _torch_varlen()
    params = inspect.signature(fn).parameters if fn is not None else {}
    if "is_causal" in params:
        return {"is_causal": True}
    if "window_size" in params:
        return {"window_size": (-1, 0)}
    return None


@functools.cache
def _flash_capable(device_index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index) >= (8, 0)


def _sdpa_serves(query: torch.Tensor) -> bool:
    """Whether the batched SDPA route takes these inputs: 16-bit on an NVIDIA GPU (the reach
    measured; fp32 stays with the Triton kernel, held to fp32's tolerance)."""
    return query.device.type == "cuda" and query.dtype in (torch.float16, torch.bfloat16) and torch.version.hip is None


def torch_flash_serves(query: torch.Tensor, key: torch.Tensor, causal: bool = False) -> bool:
    """Whether torch's varlen flash attention takes these inputs (see the module docstring)."""
    return (query.device.type == "cuda" and (not causal or _torch_varlen_causal() is not None) and query.dtype in (torch.float16, torch.bfloat16)
            and query.shape[-1] % 8 == 0 and query.shape[-1] <= 256 and _torch_varlen() is not None
            and (query.shape[1] == key.shape[1] or _torch_varlen_groups_heads())
            and _flash_capable(query.device.index if query.device.index is not None else torch.cuda.current_device()))


def equal_segments_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: int,
                        scale: float, causal: bool = False) -> torch.Tensor:
    """``segments`` equal-length segments as one ``[segments, H, length, D]`` SDPA batch (views of
    the packed tensors; no mask: every segment attends only to itself; ``causal``: SDPA's own)."""
    def batched(t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(0, (segments, -1)).transpose(1, 2)

    out = F.scaled_dot_product_attention(batched(query), batched(key), batched(value), scale=scale,
                                         is_causal=causal, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).reshape(query.shape)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
           op: str = "mm_encoder_attn") -> None:
    """The schema's shape contract (the op classes check more, with their own messages)."""
    if query.dim() != 3 or key.shape != value.shape or key.dim() != 3 or key.shape[0] != query.shape[0] \
            or key.shape[2] != query.shape[2] or query.shape[1] % max(key.shape[1], 1) or key.shape[1] == 0:
        raise ValueError(f"customop::{op}: query [T, Hq, D] and key/value [T, Hkv, D] with Hkv "
                         f"dividing Hq, got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(f"customop::{op}: one dtype for query, key and value, got "
                        f"{query.dtype}, {key.dtype}, {value.dtype}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.device != query.device:
        raise ValueError(f"customop::{op}: cu_seqlens must be 1-D int32 on {query.device}, got "
                         f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)} on {cu_seqlens.device}")


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _launch(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
            max_seqlen: int, scale: float, causal: bool, op: str) -> torch.Tensor:
    _check(query, key, value, cu_seqlens, op)
    total = query.shape[0]
    if max_seqlen <= 0:
        # unknown: read and check cu_seqlens (one small copy), except inside a CUDA graph capture,
        # where the whole sequence is a valid bound
        max_seqlen = total if _capturing(query.device) else max(_math.segment_lengths(cu_seqlens, total, op=op), default=0)
    if query.shape[-1] > MAX_HEAD_DIM:
        return _math.varlen_attention(query, key, value, cu_seqlens, max_seqlen, scale, causal, op).contiguous()
    query, key, value = _unit_last(query), _unit_last(key), _unit_last(value)
    segments = cu_seqlens.shape[0] - 1
    if segments > 0 and max_seqlen > 0 and total == segments * max_seqlen and _sdpa_serves(query):
        return equal_segments_sdpa(query, key, value, segments, scale, causal)
    if torch_flash_serves(query, key, causal):
        extra = {"enable_gqa": True} if query.shape[1] != key.shape[1] else {}
        if causal:
            extra.update(_torch_varlen_causal())
        return _torch_varlen()(query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale, **extra)
    return triton_varlen_attention(query, key, value, cu_seqlens, max_seqlen, scale, causal=causal)


def mm_encoder_attn(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                    max_seqlen: int, scale: float) -> torch.Tensor:
    """The ``customop::mm_encoder_attn`` kernel (schema in customop/ops/_library/attention.py)."""
    return _launch(query, key, value, cu_seqlens, max_seqlen, scale, False, "mm_encoder_attn")


def varlen_attn(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                max_seqlen: int, scale: float, causal: bool) -> torch.Tensor:
    """The ``customop::varlen_attn`` kernel: ``mm_encoder_attn``'s, causal when asked."""
    return _launch(query, key, value, cu_seqlens, max_seqlen, scale, bool(causal), "varlen_attn")


KERNELS = {"customop::mm_encoder_attn": mm_encoder_attn, "customop::varlen_attn": varlen_attn}
