"""Attention: ``MMEncoderAttention`` (``mm_encoder_attn``), the multimodal encoder's attention with
vLLM 0.33's constructor and call; and ``RelPosAttention`` (``rel_pos_attention``, at the end), SAM's
attention with decomposed relative positions (every forward but the spec runs its blocked form).

Bidirectional attention without a KV cache over packed sequences: ``cu_seqlens`` marks the
segments (images, windows) of the sequence dim, and attention never crosses a segment (docs/attention.md).
The spec (``customop/math/attention.py``) is vLLM's SDPA path: one SDPA per segment.

Paths: ``forward_native`` runs the spec; ``forward_cpu`` the spec with runs of equal-length
segments batched into one SDPA each (bitwise the spec, measured faster: backends/cpu/attention.py);
``forward_cuda = forward_xpu = forward_tpu`` call ``forward_kernel``, which packs the tokens to
``[T, H, D]`` and calls ``torch.ops.customop.mm_encoder_attn``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from customop.backends.cpu.attention import encoder_attention_by_runs
from customop.config import get_config
from customop.custom_op import CustomOp
from customop.math.attention import encoder_attention, rel_pos_attention, segment_lengths  # noqa: F401  (the spec)
from customop.math.attention import rel_pos_attention_blocked
from customop.ops.linear import cpu_linear

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_OP = "customop.mm_encoder_attn"


def _check_tensor(arg: str, t: Any) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{_OP}: {arg} must be a torch.Tensor, got {type(t).__name__}")


def _check_cu_seqlens(cu_seqlens: Any, query: torch.Tensor) -> None:
    _check_tensor("cu_seqlens", cu_seqlens)
    if cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"{_OP}: cu_seqlens must be an integer tensor (int32), got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{_OP}: cu_seqlens must be 1-D with at least 2 entries ([0, ..., seq_len]), "
                         f"got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != query.device and cu_seqlens.device.type != "cpu":
        raise ValueError(f"{_OP}: cu_seqlens is on {cu_seqlens.device}; it must be on query's device "
                         f"({query.device}) or the CPU")


def _host_max_seqlen(max_seqlen: Any) -> int | None:
    """``max_seqlen`` as a Python int (a 0-d or 1-element tensor is read; free on the CPU), or
    None when not given or not readable (a tensor inside a trace)."""
    if max_seqlen is None:
        return None
    if isinstance(max_seqlen, torch.Tensor):
        if max_seqlen.numel() != 1 or max_seqlen.is_floating_point():
            raise ValueError(f"{_OP}: max_seqlen must be an int or a 1-element integer tensor, "
                             f"got {max_seqlen.dtype} of shape {tuple(max_seqlen.shape)}")
        return None if torch.compiler.is_compiling() else int(max_seqlen.item())
    if isinstance(max_seqlen, torch.SymInt):
        return max_seqlen
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise ValueError(f"{_OP}: max_seqlen must be a non-negative int, got {max_seqlen!r}")
    return max_seqlen


@CustomOp.register("mm_encoder_attn")
class MMEncoderAttention(CustomOp):
    """Multi-head attention without a cache, for multimodal encoders (vLLM's constructor).

    Args:
        num_heads: query heads (per tensor-parallel rank).
        head_size: lanes per head.
        scale: the softmax scale; ``head_size ** -0.5`` when None.
        num_kv_heads: key/value heads, dividing ``num_heads`` (GQA/MQA); ``num_heads`` when None.
        prefix: the layer's name, kept as ``layer_name``.

    ``forward(query, key, value, cu_seqlens=None, max_seqlen=None, sequence_lengths=None)``: query
    ``[B, S, num_heads * head_size]`` or ``[B, S, num_heads, head_size]``, key/value the same with
    ``num_kv_heads``, one float dtype; returns query's layout. ``cu_seqlens`` (int32 ``[N + 1]``,
    on the device or the CPU) splits each row's ``S`` tokens into segments that attend only among
    themselves (vLLM callers pass ``B = 1``); without it each row is one segment. ``max_seqlen``
    (int or 1-element tensor; optional) bounds the longest segment. ``sequence_lengths`` is
    vLLM's FlashInfer-only argument and is ignored.

    Like vLLM's, the op is on by default even when the base mode is ``none`` (Inductor does not
    fuse attention); unlike vLLM, ``-mm_encoder_attn`` still turns it off.
    """

    def __init__(self, num_heads: int, head_size: int, scale: float | None = None,
                 num_kv_heads: int | None = None, prefix: str = "", *, enforce_enable: bool = False) -> None:
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for arg, value in (("num_heads", num_heads), ("head_size", head_size), ("num_kv_heads", num_kv_heads)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{_OP}: {arg} must be a positive int, got {value!r}")
        if num_heads % num_kv_heads:
            raise ValueError(f"{_OP}: num_heads ({num_heads}) is not divisible by num_kv_heads ({num_kv_heads})")
        super().__init__(enforce_enable=enforce_enable)
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = head_size ** -0.5 if scale is None else float(scale)
        self.num_kv_heads = num_kv_heads
        self.num_queries_per_kv = num_heads // num_kv_heads
        self.layer_name = prefix

    @classmethod
    def enabled(cls) -> bool:
        return f"-{cls.name}" not in get_config().custom_ops

    # ---- checks (every path) ------------------------------------------------------------------

    def check_inputs(self, query: Any, key: Any, value: Any, cu_seqlens: Any = None) -> None:
        """The argument checks every path runs (out-of-tree replacements may call it too): raises
        ``TypeError``/``ValueError`` naming the argument; does not read ``cu_seqlens``'s values."""
        for arg, t in (("query", query), ("key", key), ("value", value)):
            _check_tensor(arg, t)
        if query.dtype not in _DTYPES:
            raise TypeError(f"{_OP}: query has dtype {query.dtype}; supported: float32, float16, bfloat16")
        for arg, t in (("key", key), ("value", value)):
            if t.dtype != query.dtype:
                raise TypeError(f"{_OP}: {arg} has dtype {t.dtype}, expected query's {query.dtype}")
            if t.device != query.device:
                raise ValueError(f"{_OP}: {arg} is on {t.device} but query is on {query.device}")
        for arg, t, heads in (("query", query, self.num_heads), ("key", key, self.num_kv_heads),
                              ("value", value, self.num_kv_heads)):
            expected = (heads * self.head_size,) if query.dim() == 3 else (heads, self.head_size)
            if t.dim() not in (3, 4) or t.dim() != query.dim() or tuple(t.shape[2:]) != expected:
                raise ValueError(f"{_OP}: {arg} has shape {tuple(t.shape)}, expected "
                                 f"[batch, seq_len, {', '.join(map(str, expected))}] "
                                 f"({heads} heads of {self.head_size}, the layout of query)")
            if t.shape[:2] != query.shape[:2]:
                raise ValueError(f"{_OP}: {arg} has [batch, seq_len] {tuple(t.shape[:2])}, "
                                 f"expected query's {tuple(query.shape[:2])}")
        if cu_seqlens is not None:
            _check_cu_seqlens(cu_seqlens, query)

    def _as_4d(self, t: torch.Tensor, heads: int) -> torch.Tensor:
        return t.view(*t.shape[:2], heads, self.head_size) if t.dim() == 3 else t

    def _lengths(self, query: torch.Tensor, cu_seqlens: torch.Tensor | None, max_seqlen: Any) -> list[int] | None:
        """The segment lengths, read and checked on the host (the spec's split needs them)."""
        if cu_seqlens is None:
            _host_max_seqlen(max_seqlen)  # checked, not needed
            return None
        return segment_lengths(cu_seqlens, query.shape[1], _host_max_seqlen(max_seqlen) or 0)

    def _run_spec(self, spec, query, key, value, cu_seqlens, max_seqlen) -> torch.Tensor:
        self.check_inputs(query, key, value, cu_seqlens)
        lengths = self._lengths(query, cu_seqlens, max_seqlen)
        out = spec(self._as_4d(query, self.num_heads), self._as_4d(key, self.num_kv_heads),
                   self._as_4d(value, self.num_kv_heads), lengths, self.scale)
        return out.reshape(query.shape) if query.dim() == 3 else out

    # ---- the paths ----------------------------------------------------------------------------

    def forward_native(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       cu_seqlens: torch.Tensor | None = None, max_seqlen: Any = None,
                       sequence_lengths: torch.Tensor | None = None) -> torch.Tensor:
        return self._run_spec(encoder_attention, query, key, value, cu_seqlens, max_seqlen)

    def forward_cpu(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    cu_seqlens: torch.Tensor | None = None, max_seqlen: Any = None,
                    sequence_lengths: torch.Tensor | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling() and cu_seqlens is not None:
            # reading the segment lengths would break the caller's graph: the opaque library op
            # reads them at run time instead
            return self.forward_kernel(query, key, value, cu_seqlens, max_seqlen)
        return self._run_spec(encoder_attention_by_runs, query, key, value, cu_seqlens, max_seqlen)

    def forward_cuda(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     cu_seqlens: torch.Tensor | None = None, max_seqlen: Any = None,
                     sequence_lengths: torch.Tensor | None = None) -> torch.Tensor:
        return self.forward_kernel(query, key, value, cu_seqlens, max_seqlen)

    forward_xpu = forward_tpu = forward_cuda

    def forward_kernel(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       cu_seqlens: torch.Tensor | None = None, max_seqlen: Any = None) -> torch.Tensor:
        """The ``torch.ops.customop.mm_encoder_attn`` call every accelerator shares: the batch
        rows are packed into one sequence (``[B * S, H, D]`` views) with each row's segments
        offset by ``S``. While autograd records, ``forward_native`` runs (the op has no backward).

        ``cu_seqlens`` is checked against the data here when it is on the CPU (free); on the
        device, the kernel checks it when it must read it anyway (no ``max_seqlen``) and otherwise
        trusts it, clamping every segment into the sequence so that a bad one cannot reach
        memory outside the tensors."""
        self.check_inputs(query, key, value, cu_seqlens)
        if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
            return self.forward_native(query, key, value, cu_seqlens, max_seqlen)
        batch, seq = query.shape[:2]
        bound = _host_max_seqlen(max_seqlen)
        if cu_seqlens is None:
            bound = seq
        elif cu_seqlens.device.type == "cpu" and not torch.compiler.is_compiling():
            bound = max(segment_lengths(cu_seqlens, seq, bound or 0))
        if batch * seq == 0:
            return query.new_empty(query.shape)
        out = torch.ops.customop.mm_encoder_attn(
            query.reshape(batch * seq, self.num_heads, self.head_size),
            key.reshape(batch * seq, self.num_kv_heads, self.head_size),
            value.reshape(batch * seq, self.num_kv_heads, self.head_size),
            _packed_cu_seqlens(cu_seqlens, batch, seq, query.device), bound or 0, self.scale)
        return out.view(query.shape)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, head_size={self.head_size}, scale={self.scale:.6g}, "
                f"num_kv_heads={self.num_kv_heads}")


def _packed_cu_seqlens(cu_seqlens: torch.Tensor | None, batch: int, seq: int, device: torch.device) -> torch.Tensor:
    """The int32 segment offsets of ``batch`` rows of ``seq`` tokens packed one after another:
    each row's ``cu_seqlens`` (or one segment per row), shifted by the row's start. Device ops
    only: no host read."""
    if cu_seqlens is None:
        return torch.arange(0, batch * seq + 1, seq, dtype=torch.int32, device=device)
    cu = cu_seqlens.to(device=device, dtype=torch.int32, non_blocking=True)
    if batch == 1:
        return cu
    starts = torch.arange(batch, dtype=torch.int32, device=device) * seq
    return torch.cat([(cu[:-1][None, :] + starts[:, None]).reshape(-1), cu[-1:] + starts[-1]])


@CustomOp.register("rel_pos_attention")
class RelPosAttention(CustomOp):
    """SAM/ViTDet multi-head attention with decomposed relative positions (DeepSeek-OCR's SAM
    encoder; vLLM 0.33's ``RelPosAttention`` constructor and parameter names, so its checkpoints
    load as is: ``qkv.weight/bias``, ``proj.weight/bias``, ``rel_pos_h``, ``rel_pos_w``).

    ``forward(x)``: ``[B, H, W, dim]`` -> ``[B, H, W, dim]`` (``customop.math.attention.rel_pos_attention``).
    With ``use_rel_pos`` the position tables are ``[2 * input_size[i] - 1, head_dim]`` (zeros until
    loaded); a grid of another size interpolates them. ``use_triton_attention`` and
    ``rel_pos_zero_init`` are accepted for vLLM's signature and have no effect (no fused kernel).
    ``params_dtype`` (customop's) sets the parameters' dtype.

    Paths: ``forward_native`` runs the spec; ``forward_cpu = forward_cuda = forward_xpu =
    forward_tpu`` call ``forward_kernel``, the spec's arithmetic with the bias built contiguous
    and ``bias_block[device type]`` entries at a time (``rel_pos_attention_blocked``).
    """

    #: bias entries per SDPA call of ``forward_kernel`` by device type; others build it in one block.
    #: cpu: measured, benchmarks/results/cpu_rel_pos.md (blocks of 1M-4M entries tied as the best).
    bias_block: dict[str, int] = {"cpu": 1 << 22}
    #: forward_cpu builds a bf16/fp16 bias with the queries innermost for grids narrower than this
    #: (``rel_pos_attention_blocked``'s ``narrow_add_below``): ATen's broadcast add over the grid
    #: width's 14 elements took 13 of the 46 ms of 25 x 14 x 14 bf16 (12 heads of 64), which
    #: Inductor's fused add does in ~1 ms. p5 over 0.3 s, 2 threads, three runs (the former form:
    #: the benchmark's "block 2^22" column, 2026-12-02): bf16 25x14x14 39.1-40.4 ms against
    #: torch.compile's 42.0-42.9 and the former 46.4-46.5; 1x14x14 2.0 vs 2.1-2.2 (former 2.3);
    #: 1x24x24 6.7-7.9 vs 7.9-8.4 (former 7.3-8.4); fp16 25x14x14 112.8 vs 114.2 (former 122.8),
    #: 1x24x24 19.0 vs 19.2 (former 21.9). fp32 ran slower this way (25x14x14 115 vs 107 ms), so it
    #: keeps the plain add; grids of 32 and wider were not measured with it.
    narrow_add_below: int = 32

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, use_rel_pos: bool = False,
                 use_triton_attention: bool = False, rel_pos_zero_init: bool = True,
                 input_size: tuple[int, int] | None = None, *, params_dtype: torch.dtype | None = None,
                 enforce_enable: bool = False) -> None:
        op = "customop.rel_pos_attention"
        if not isinstance(dim, int) or not isinstance(num_heads, int) or num_heads <= 0 or dim <= 0 or dim % num_heads:
            raise ValueError(f"{op}: num_heads={num_heads!r} must divide dim={dim!r} (both positive ints)")
        if use_rel_pos and (input_size is None or len(input_size) != 2 or min(input_size) <= 0):
            raise ValueError(f"{op}: use_rel_pos needs input_size=(height, width), got {input_size!r}")
        super().__init__(enforce_enable=enforce_enable)
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.use_rel_pos, self.use_triton_attention = use_rel_pos, use_triton_attention
        dtype = params_dtype or torch.get_default_dtype()
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias, dtype=dtype)
        self.proj = nn.Linear(dim, dim, dtype=dtype)
        if use_rel_pos:
            self.rel_pos_h = nn.Parameter(torch.zeros(2 * input_size[0] - 1, self.head_dim, dtype=dtype))
            self.rel_pos_w = nn.Parameter(torch.zeros(2 * input_size[1] - 1, self.head_dim, dtype=dtype))
        else:
            self.rel_pos_h = self.rel_pos_w = None

    def check_input(self, x: Any) -> None:
        op = "customop.rel_pos_attention"
        _check_tensor_named(op, "x", x)
        if x.dtype != self.qkv.weight.dtype or x.dtype not in _DTYPES:
            raise TypeError(f"{op}: x has dtype {x.dtype}, expected the weights' {self.qkv.weight.dtype}")
        if x.device != self.qkv.weight.device:
            raise ValueError(f"{op}: x is on {x.device} but the weights are on {self.qkv.weight.device}")
        if x.dim() != 4 or x.shape[-1] != self.dim:
            raise ValueError(f"{op}: x has shape {tuple(x.shape)}, expected [batch, height, width, {self.dim}]")

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        self.check_input(x)
        return rel_pos_attention(x, self.qkv.weight, self.qkv.bias, self.proj.weight, self.proj.bias, self.num_heads,
                                 self.rel_pos_h, self.rel_pos_w)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        # the projections on cpu_linear: oneDNN for fp32, fp32 GEMMs for bf16/fp16 on AVX2 CPUs
        # (SAM's qkv and output GEMMs are most of a window's time)
        return self.forward_kernel(x, narrow_add_below=self.narrow_add_below, linear=cpu_linear)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_kernel(x)

    forward_xpu = forward_tpu = forward_cuda

    def forward_kernel(self, x: torch.Tensor, narrow_add_below: int = 0,
                       linear: Callable[..., torch.Tensor] = F.linear) -> torch.Tensor:
        """What every platform's forward shares: the checks, then the blocked form (plain torch:
        it runs on any device, and autograd records through it). ``narrow_add_below``: see
        ``narrow_add_below`` (bf16 and fp16 only; fp32 ran slower that way); ``linear``: the
        projections' GEMM."""
        self.check_input(x)
        if x.dtype not in (torch.bfloat16, torch.float16):
            narrow_add_below = 0
        block = self.bias_block.get(x.device.type, x.shape[0] * self.num_heads * (x.shape[1] * x.shape[2]) ** 2)
        return rel_pos_attention_blocked(x, self.qkv.weight, self.qkv.bias, self.proj.weight, self.proj.bias,
                                         self.num_heads, self.rel_pos_h, self.rel_pos_w, block=block,
                                         narrow_add_below=narrow_add_below, linear=linear)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, use_rel_pos={self.use_rel_pos}"


def _check_tensor_named(op: str, arg: str, t: Any) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {arg} must be a torch.Tensor, got {type(t).__name__}")
