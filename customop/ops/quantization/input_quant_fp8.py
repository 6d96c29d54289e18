"""QuantFP8 (``quant_fp8``): activation quantization to fp8, static or dynamic, per tensor, per
token or per group (the math is in ``customop/math/quant.py``).

Paths:

- ``forward_native``: ``quant_fp8`` below, the spec (``compile_native=True`` by default, as in
  vLLM: a disabled QuantFP8 runs compiled native).
- ``forward_cpu``: compiled native from ``QUANT_CPU_TIERS`` elements; below, the same code
  compiled for one thread (up to 32K elements) where the standalone route takes the call, else
  eager with the in-place steps of ``backends/cpu/eager.py`` (benchmarks/results/cpu_quant.md,
  cpu_decode_paths.md).
- ``forward_cuda`` / ``forward_xpu`` / ``forward_tpu``: the ``torch.ops.customop`` kernel entry points
  (``customop/ops/_library/quant.py``) on a ``[T, H]`` contiguous view. Shapes without an entry
  point run ``forward_native``: static scales with more than one element (per token, per channel,
  per group). ``num_token_padding`` and ``tma_aligned_scales`` are done in Python around the
  kernel call, at the cost of one extra copy of ``q`` (resp. the scales).
"""

from __future__ import annotations

import dataclasses
from math import prod
from typing import Any

import torch

from customop.backends.cpu import CpuTiers, eager, run_tiered
from customop.custom_op import CustomOp
from customop.math import quant as qm
from customop.math.fp8 import fp8_max, fp8_min_scale
from customop.ops.quantization.group_shape import GroupShape

#: Below 64K elements forward_cpu stays eager (benchmarks/results/cpu_quant.md). On a quiet
#: 2-core CPU compiled wins from about 4x4096 (by ~10 us), but a dynamic-shape Inductor kernel
#: always opens an OpenMP region, and on a busy machine waiting for the second thread cost
#: milliseconds per call at 2x4096-4x4096, where eager runs single-threaded. From 16x4096 up
#: both use the threads and compiled is 2-8x faster. The scales' shapes follow x's leading
#: dims, so x is not flattened to rows; its token and hidden dims are dynamic from the start.
#: Issue 18: the compiled tier runs without Dynamo (``standalone``, 2-D x). Without Dynamo's call
#: compiled beat the eager tier at every size from 1x128 on a quiet machine (25 vs 45 us at
#: 1x128, 36 vs 77 at 4x4096, load ~1), but with other work on both cores the same artifacts
#: stalled for 3-11 ms at 1x4096 (the OpenMP wait above; eager 37-56 us), so the threshold
#: stayed (benchmarks/results/cpu_quant.md, 2026-12-02). Its artifacts are dynamic in the width
#: (``dynamic_hidden``, per group traced as group size x a symbol), so ``customop.warmup``'s
#: width-256 inputs cover every width; one per width was what kept the route off before.
#: Issue 18, a small-size band below the threshold (``compiled_up_to``: every size) with artifacts
#: compiled for one thread up to 32K elements (``one_thread_up_to``: Inductor's ``cpp.threads=1``,
#: no OpenMP region; ATen's own kernels stay in one thread there too) and with the threads from 32K
#: to 64K. With both cores busy (two spinning processes) the threaded artifact and torch.compile
#: waited 10-20 ms a call at 4x4096 while the one-thread artifact took 72 us (eager 206 us). On a
#: quieter machine forward_cpu took 14-31 us against torch.compile's 20-36 per token from 1x128 to
#: 12x4096, where the eager tier ran at 0.49-1.15x torch.compile (0.49-0.62x at 8-12 x 4096); now
#: 1.10-1.73x; per group 128 (a slower compile) 1.16-3.99x -> 1.58-7.41x (2 threads, alternated
#: runs; BENCHMARKS.md, "issue 18, CPU, seventh day"). Modes the route refuses (padding, aligned scales, static
#: scales of 2 dims) keep the eager tier below 64K without asking it (``_route_takes_it``,
#: ``_static_forward_cpu``); static scales of one element or ``[H]`` take the band (``static_quant``).
QUANT_CPU_TIERS = CpuTiers(1 << 16, rows=False, standalone=True, compiled_up_to=(1 << 16) - 1,
                           one_thread_up_to=(1 << 15) - 1)
#: Static per-tensor / per-channel calls of up to this many elements skip the small-size band: their
#: eager tier (three ATen kernels, no reduction) beat the band's one-thread artifact there (1x4096
#: bf16: 15.4 vs 18.6 us, p5; torch.compile 22.0) and tied it at 10-12K elements; from 16K the
#: band wins (4x4096: 22.8 vs 24.8, compile 24.7; 8x4096: 24.8 vs 37.1, compile 28.1)
STATIC_EAGER_UP_TO = 1 << 13
#: id(tiers) -> (tiers, the same without the small-size band), for the modes the route refuses
_WITHOUT_BAND: dict[int, tuple[CpuTiers, CpuTiers]] = {}


def _without_band(tiers: CpuTiers) -> CpuTiers:
    hit = _WITHOUT_BAND.get(id(tiers))
    if hit is None or hit[0] is not tiers:
        hit = _WITHOUT_BAND[id(tiers)] = (tiers, dataclasses.replace(tiers, compiled_up_to=0))
    return hit[1]

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def current_fp8_dtype() -> torch.dtype:
    """The fp8 dtype of the current platform (``Platform.fp8_dtype()``: e4m3fnuz on MI300)."""
    from customop.platforms import current_platform

    return current_platform().fp8_dtype()


def quant_fp8(x: torch.Tensor, scale: torch.Tensor | None, scale_ub: torch.Tensor | None, *,
              group_shape: GroupShape, num_token_padding: int | None, column_major_scales: bool,
              tma_aligned_scales: bool, use_ue8m0: bool, fp8_dtype: torch.dtype, fp8_max: float,
              min_scale: float, fewer_temporaries: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole op. A given ``scale`` is static (broadcast to the group shape), else the scale is
    computed per tensor, per token or per group. ``q``'s leading dim is zero-padded to
    ``num_token_padding``. Returns ``(q, scale)``. ``fewer_temporaries`` (the CPU path's small
    inputs, never under autograd or compile) runs the quant math from ``backends/cpu/eager.py``:
    the same kernels with in-place steps, bitwise equal."""
    math = eager if fewer_temporaries and x.dtype in eager.QUANT_DTYPES else qm
    if scale is not None:
        q = static_quant(x, scale, group_shape=group_shape, fp8_dtype=fp8_dtype, fp8_max=fp8_max,
                         fewer_temporaries=fewer_temporaries)
        scale = returned_static_scale(scale, group_shape)
    elif group_shape.is_per_group():
        q, scale = math.per_token_group_fp8_quant(x, group_shape.col, column_major_scales, use_ue8m0,
                                                  fp8_dtype, fp8_max, min_scale)
        if tma_aligned_scales:
            scale = qm.tma_align_scales(scale)
    elif group_shape.is_per_token():
        q, scale = math.dynamic_per_token_scaled_fp8_quant(x, scale_ub, fp8_dtype, fp8_max, min_scale)
    elif x.numel() == 0:  # max() of no element raises; the amax of nothing is 0, as for zeros
        q, scale = empty_per_tensor_quant(x, fp8_dtype, min_scale)
    else:
        q, scale = math.dynamic_scaled_fp8_quant(x, fp8_dtype, fp8_max, min_scale)
    return qm.pad_tokens(q, num_token_padding), scale


def static_quant(x: torch.Tensor, scale: torch.Tensor, *, group_shape: GroupShape, fp8_dtype: torch.dtype,
                 fp8_max: float, fewer_temporaries: bool = False) -> torch.Tensor:
    """``q`` of a static ``quant_fp8`` call before padding: ``x`` quantized with the caller's scale
    (per group broadcast to one scale per element first). The CPU path compiles this alone, since a
    compiled graph that also returned the caller's scale could hand back a copy of it (the standalone
    route refuses such graphs); ``returned_static_scale`` gives the scale."""
    math = eager if fewer_temporaries and x.dtype in eager.QUANT_DTYPES else qm
    full = qm.static_group_scales(scale, group_shape.col, x.shape[-1]) if group_shape.is_per_group() else scale
    return math.scaled_fp8_quant(x, full, fp8_dtype, fp8_max)


def _static_quant_in_place_steps(x: torch.Tensor, scale: torch.Tensor, **math: Any) -> torch.Tensor:
    """``static_quant`` with the in-place steps of ``backends/cpu/eager.py`` (bitwise equal)."""
    return static_quant(x, scale, **math, fewer_temporaries=True)


def empty_per_tensor_quant(x: torch.Tensor, fp8_dtype: torch.dtype,
                           min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-tensor quant of a tensor with no element: an empty ``q`` and the scale of an
    all-zero tensor, ``max(0 / MAX, MIN_SCALE) = MIN_SCALE``, shape ``[1]`` (the Triton kernel
    returns the same)."""
    return x.new_empty(x.shape, dtype=fp8_dtype), torch.full((1,), min_scale, dtype=torch.float32, device=x.device)


def returned_static_scale(scale: torch.Tensor, group_shape: GroupShape) -> torch.Tensor:
    """The scale a static call returns, shaped as vLLM 0.33's ``QuantFP8`` returns it (a view of
    the caller's tensor, never a copy): per tensor as given; any other one-element scale as
    ``[1, 1]``; a 1-D per-channel ``[H]`` as ``[1, H]``; the rest as given. Downstream GEMMs tell
    per-tensor from per-channel activations by the scale's rank."""
    if scale.numel() == 1:
        return scale if group_shape.is_per_tensor() else scale.view(1, 1)
    if scale.dim() == 1 and group_shape.is_per_channel():
        return scale.unsqueeze(0)
    return scale


def _quant_fp8_in_place_steps(x: torch.Tensor, scale: torch.Tensor | None, scale_ub: torch.Tensor | None,
                              **math: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``quant_fp8`` with the in-place steps of ``backends/cpu/eager.py`` (bitwise equal)."""
    return quant_fp8(x, scale, scale_ub, **math, fewer_temporaries=True)


def _check_config(static: bool, group_shape: GroupShape, num_token_padding: int | None,
                  column_major_scales: bool, tma_aligned_scales: bool, use_ue8m0: bool) -> None:
    where = "QuantFP8"
    known = group_shape.is_per_tensor() or group_shape.is_per_token() or group_shape.is_per_group()
    if not (known or (static and group_shape.is_per_channel())):
        raise ValueError(f"{where}: group_shape {tuple(group_shape)} is not supported "
                         f"{'statically' if static else 'dynamically'}; use PER_TENSOR, PER_TOKEN, "
                         "(1, G) per group" + (", or PER_CHANNEL" if static else " (PER_CHANNEL is static only)"))
    dynamic_group = not static and group_shape.is_per_group()
    for arg, value in (("column_major_scales", column_major_scales), ("use_ue8m0", use_ue8m0),
                       ("tma_aligned_scales", tma_aligned_scales)):
        if value and not dynamic_group:
            raise ValueError(f"{where}: {arg}=True applies to dynamic per-group quantization only")
    if tma_aligned_scales and not column_major_scales:
        raise ValueError(f"{where}: tma_aligned_scales=True needs column_major_scales=True")
    if num_token_padding is not None and (isinstance(num_token_padding, bool)
                                          or not isinstance(num_token_padding, int) or num_token_padding < 0):
        raise ValueError(f"{where}: num_token_padding must be a non-negative int or None, got {num_token_padding!r}")


@CustomOp.register("quant_fp8")
class QuantFP8(CustomOp):
    """``QuantFP8(static, group_shape, ...)``; ``forward(x, scale=None, scale_ub=None) -> (q, scale)``.

    - ``static``: the caller passes ``scale`` (float32; numel 1 per tensor, ``[..., T, 1]`` per
      token, ``[H]`` or ``[1, H]`` per channel, ``[..., T, ceil(H/G)]`` per group); else it is
      computed. The returned scale is the caller's, reshaped as vLLM 0.33 does
      (``returned_static_scale``: ``[H]`` per channel comes back ``[1, H]``).
    - dynamic per-tensor on an input with no element returns an empty ``q`` and ``MIN_SCALE``.
    - ``scale_ub`` (dynamic per-token only, one element) caps each row's amax.
    - ``num_token_padding``: ``q``'s leading dim is zero-padded up to it (the scale is not).
    - per group only: ``column_major_scales``, ``tma_aligned_scales`` (the column-major storage's
      token dim rounded up to a multiple of 4), ``use_ue8m0`` (``None`` means False: there is no
      DeepGEMM to ask).
    - The fp8 dtype is the platform's (``Platform.fp8_dtype()``), fixed at construction.
    """

    cpu_tiers = QUANT_CPU_TIERS

    def __init__(self, static: bool, group_shape: GroupShape | tuple[int, int], num_token_padding: int | None = None,
                 column_major_scales: bool = False, tma_aligned_scales: bool = False,
                 use_ue8m0: bool | None = None, compile_native: bool = True) -> None:
        super().__init__(compile_native=compile_native)
        group_shape = GroupShape(*group_shape)
        use_ue8m0 = bool(use_ue8m0)
        _check_config(static, group_shape, num_token_padding, column_major_scales, tma_aligned_scales, use_ue8m0)
        self.static = static
        self.group_shape = group_shape
        self.num_token_padding = num_token_padding
        self.column_major_scales = column_major_scales
        self.tma_aligned_scales = tma_aligned_scales
        self.use_ue8m0 = use_ue8m0
        self.fp8_dtype = current_fp8_dtype()
        self.fp8_max = fp8_max(self.fp8_dtype)
        self.min_scale = fp8_min_scale(self.fp8_dtype)
        # the standalone route refuses the graphs of a static scale (returned as given: the caller's
        # tensor; forward_cpu compiles static_quant for those instead), of padding to a token count
        # and of aligned scales (both constrain the rows): those calls skip the small-size band,
        # whose eager fallback would first pay the route's ~5 us refusal (static per tensor at
        # 1x4096: 22 vs 16 us a call)
        self._route_takes_it = not static and num_token_padding is None and not tma_aligned_scales
        # static without padding: forward_cpu compiles ``static_quant`` (q alone), which the route takes
        self._static_unpadded = static and num_token_padding is None
        self._static_math: dict[str, Any] = dict(group_shape=group_shape, fp8_dtype=self.fp8_dtype,
                                                 fp8_max=self.fp8_max)
        self._math: dict[str, Any] = dict(
            group_shape=group_shape, num_token_padding=num_token_padding, column_major_scales=column_major_scales,
            tma_aligned_scales=tma_aligned_scales, use_ue8m0=use_ue8m0, fp8_dtype=self.fp8_dtype,
            fp8_max=self.fp8_max, min_scale=self.min_scale)

    @property
    def is_group_quant(self) -> bool:
        return self.group_shape.is_per_group()

    def extra_repr(self) -> str:
        return (f"static={self.static}, group_shape={tuple(self.group_shape)}, fp8_dtype={self.fp8_dtype}, "
                f"num_token_padding={self.num_token_padding}, column_major_scales={self.column_major_scales}, "
                f"use_ue8m0={self.use_ue8m0}")

    # ---- paths --------------------------------------------------------------------------------

    def forward_native(self, x: torch.Tensor, scale: torch.Tensor | None = None,
                       scale_ub: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_call(x, scale, scale_ub)  # the call contract (scale iff static), not the math
        return quant_fp8(x, scale, scale_ub, **self._math)

    def forward_cpu(self, x: torch.Tensor, scale: torch.Tensor | None = None,
                    scale_ub: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_call(x, scale, scale_ub)
        if self._static_unpadded:
            return self._static_forward_cpu(x, scale)
        tiers = self.cpu_tiers
        if tiers.compiled_up_to and not self._route_takes_it:
            tiers = _without_band(tiers)
        return run_tiered(tiers, quant_fp8, x, scale, scale_ub, eager=_quant_fp8_in_place_steps, **self._math)

    def _static_forward_cpu(self, x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A static call without padding: ``static_quant`` through the tiers, the caller's scale
        returned as the spec returns it. Compiling ``quant_fp8`` instead gave a graph that returns
        its scale input, which the standalone route refuses: Dynamo's path, 0.56-0.92x
        torch.compile at 4x4096 to 256x8192 per tensor. The small-size band (one-thread artifacts)
        applies above ``STATIC_EAGER_UP_TO`` elements where the route takes the scale: one element
        or ``[H]`` (per tensor, per channel); the eager tier ran at 0.67-0.88x torch.compile at
        4-12 x 4096 per tensor. Other static scales (``[1, H]``, per token, per group) are not x's
        rows nor ``[hidden]``: no band (the route's refusal would cost ~5 us a call), Dynamo's
        path from the threshold."""
        tiers = self.cpu_tiers
        if tiers.compiled_up_to and (x.numel() <= STATIC_EAGER_UP_TO or scale.dim() > 1 or self.is_group_quant):
            tiers = _without_band(tiers)
        q = run_tiered(tiers, static_quant, x, scale, eager=_static_quant_in_place_steps, **self._static_math)
        return q, returned_static_scale(scale, self.group_shape)

    def forward_cuda(self, x: torch.Tensor, scale: torch.Tensor | None = None,
                     scale_ub: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.forward_kernel(x, scale, scale_ub)

    forward_xpu = forward_tpu = forward_cuda

    def forward_kernel(self, x: torch.Tensor, scale: torch.Tensor | None,
                         scale_ub: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``torch.ops.customop`` call every accelerator shares: the entry point of this mode
        on a ``[T, H]`` contiguous view
        (a copy only if ``x`` is not contiguous) and restores ``x``'s leading dims."""
        self._check_call(x, scale, scale_ub, kernel=True)
        if scale is not None and scale.numel() != 1:
            return self.forward_native(x, scale, scale_ub)  # static non-scalar scales: no kernel
        ops = torch.ops.customop
        lead, hidden = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(prod(lead), hidden).contiguous()  # not -1: ambiguous when hidden is 0
        if scale is not None:
            q = ops.static_scaled_fp8_quant(x2, scale, self.fp8_dtype, self.fp8_max)
            scale = returned_static_scale(scale, self.group_shape)
        elif self.is_group_quant:
            q, scale = ops.per_token_group_fp8_quant(x2, self.group_shape.col, self.column_major_scales,
                                                     self.use_ue8m0, self.fp8_dtype, self.fp8_max, self.min_scale)
            scale = scale.view(lead + (hidden // self.group_shape.col,))
            if self.tma_aligned_scales:
                scale = qm.tma_align_scales(scale)  # an extra copy of the (small) scales
        elif self.group_shape.is_per_token():
            q, scale = ops.dynamic_per_token_scaled_fp8_quant(x2, scale_ub, self.fp8_dtype, self.fp8_max,
                                                              self.min_scale)
            scale = scale.view(lead + (1,))
        else:
            q, scale = ops.dynamic_scaled_fp8_quant(x2, self.fp8_dtype, self.fp8_max, self.min_scale)
        # Padding is an extra copy of q; a kernel writing into a padded buffer would avoid it.
        return qm.pad_tokens(q.view(x.shape), self.num_token_padding), scale

    # ---- input checks -------------------------------------------------------------------------

    def _check_call(self, x: torch.Tensor, scale: torch.Tensor | None, scale_ub: torch.Tensor | None,
                    kernel: bool = False) -> None:
        where = "QuantFP8"
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype.itemsize == 1:
            raise TypeError(f"{where}: x must be a floating-point (not fp8) tensor, got "
                            f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
        if kernel and x.dtype not in _KERNEL_DTYPES:
            raise TypeError(f"{where}: the kernels take x in float32, float16 or bfloat16, got {x.dtype}")
        if x.dim() == 0:
            raise ValueError(f"{where}: x must have at least one dimension")
        if (scale is not None) != self.static:
            raise ValueError(f"{where}: scale must be given iff static=True (static={self.static}, "
                             f"scale={'given' if scale is not None else 'None'})")
        if scale is not None:
            self._check_static_scale(x, scale, kernel)
        if scale_ub is not None:
            if self.static or not self.group_shape.is_per_token():
                raise ValueError(f"{where}: scale_ub applies to dynamic per-token quantization only "
                                 f"(static={self.static}, group_shape={tuple(self.group_shape)})")
            if scale_ub.numel() != 1 or not scale_ub.is_floating_point():
                raise ValueError(f"{where}: scale_ub must be a floating tensor with one element, "
                                 f"got {scale_ub.dtype} of shape {tuple(scale_ub.shape)}")
            if scale_ub.device != x.device:
                raise ValueError(f"{where}: scale_ub is on {scale_ub.device}, x on {x.device}")
        if self.column_major_scales and x.dim() < 2:
            raise ValueError(f"{where}: column_major_scales needs x with at least 2 dims, got {tuple(x.shape)}")
        if kernel and self.is_group_quant and not self.static and x.shape[-1] % self.group_shape.col:
            raise ValueError(f"{where}: the kernel path needs x.shape[-1] ({x.shape[-1]}) to be a multiple "
                             f"of the group size {self.group_shape.col}")

    def _check_static_scale(self, x: torch.Tensor, scale: torch.Tensor, kernel: bool) -> None:
        where = "QuantFP8"
        if not scale.is_floating_point() or (kernel and scale.dtype != torch.float32):
            raise TypeError(f"{where}: scale must be float32, got {scale.dtype}")
        if scale.device != x.device:
            raise ValueError(f"{where}: scale is on {scale.device}, x on {x.device}")
        if scale.numel() == 1 and not self.is_group_quant:
            return
        hidden, shape = x.shape[-1], tuple(scale.shape)
        if self.group_shape.is_per_tensor():
            want = "one element"
        elif self.group_shape.is_per_token():
            want = "shape x.shape[:-1] + (1,)"
            ok = shape == tuple(x.shape[:-1]) + (1,)
        elif self.group_shape.is_per_channel():
            want = f"shape ({hidden},) or (1, {hidden})"
            ok = shape in ((hidden,), (1, hidden))
        else:
            groups = -(-hidden // self.group_shape.col)
            want = f"shape x.shape[:-1] + ({groups},)"
            ok = shape == tuple(x.shape[:-1]) + (groups,)
        if self.group_shape.is_per_tensor() or not ok:
            raise ValueError(f"{where}: static {tuple(self.group_shape)} scale must have {want}, got {shape}")
