"""Patch-embedding convolutions: ``Conv2dLayer`` (``conv2d``) and ``Conv3dLayer`` (``conv3d``), with
vLLM 0.33's constructor.

Vision encoders project their image patches with a convolution whose kernel equals its stride.
That convolution is one GEMM (``customop/math/conv.py``), which vLLM's native path computes and
which beats cuDNN's 3-D convolution 26x on the H200 (issue 13: 660 against 25 TFLOP/s for
Qwen2-VL's 3x(2,14,14) -> 1280 patches). Any other convolution is ``F.conv2d``/``F.conv3d``.

Paths: ``forward_native`` is the spec (the linear form for a patch projection, the convolution
otherwise); ``forward_cuda = forward_xpu = forward_tpu`` call ``torch.ops.customop.conv2d``/
``conv3d``, whose GPU kernel gathers the patches with Triton into aligned rows for one cuBLAS GEMM
(``backends/triton/conv.py``) and whose body elsewhere is the spec; ``forward_cpu`` is the spec's
linear form too (on the CPU it measured as fast as oneDNN's convolution or much faster,
benchmarks/results/cpu_conv.md), with the patch unfold gathered by ``index_select`` where it is a
copy and half-precision GEMMs in fp32 on AVX2 CPUs. Parameters ``weight`` ``[out, in // groups, *kernel]`` and
``bias`` ``[out]`` are named and shaped as ``nn.Conv2d``/``nn.Conv3d``'s, so a regular conv
checkpoint loads as is.
"""

from __future__ import annotations

import functools
import math
from typing import Any, ClassVar

import torch
from torch import nn

from customop.custom_op import CustomOp
from customop.math.conv import conv, conv_layer, is_patch_embedding, patch_linear, patch_rows  # noqa: F401  (the spec, re-exported)
from customop.ops.linear import cpu_linear

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


def _tuple(op: str, arg: str, value: Any, n: int) -> tuple[int, ...]:
    values = (value,) * n if isinstance(value, int) else tuple(value)
    if len(values) != n or not all(isinstance(v, int) for v in values):
        raise ValueError(f"customop.{op}: {arg} must be an int or {n} ints, got {value!r}")
    return values


class ConvLayerBase(CustomOp):
    """Shared constructor and paths (vLLM's ``ConvLayerBase``).

    Args: ``in_channels``, ``out_channels``, ``kernel_size``, ``stride=1``, ``padding=0`` (ints,
    tuples, ``"valid"`` = 0 or ``"same"`` = ``kernel // 2`` per dim, as vLLM: an even kernel gives
    one more output than torch's "same"), ``dilation=1``, ``groups=1``, ``bias=True``,
    ``padding_mode="zeros"`` (also ``reflect``, ``replicate``, ``circular``: applied as
    ``nn.Conv2d`` applies them, where vLLM ignores them), ``params_dtype`` (default: torch's
    default dtype). The parameters are uninitialised, as in vLLM: they come from a checkpoint.
    """

    num_dim: ClassVar[int]

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, ...],
                 stride: int | tuple[int, ...] = 1, padding: int | tuple[int, ...] | str = 0,
                 dilation: int | tuple[int, ...] = 1, groups: int = 1, bias: bool = True,
                 padding_mode: str = "zeros", *, params_dtype: torch.dtype | None = None,
                 enforce_enable: bool = False) -> None:
        op, n = self.name, self.num_dim
        kernel = _tuple(op, "kernel_size", kernel_size, n)
        if isinstance(padding, str):
            if padding not in ("same", "valid"):
                raise ValueError(f"customop.{op}: padding must be an int, {n} ints, 'same' or 'valid', got {padding!r}")
            padding = tuple(k // 2 for k in kernel) if padding == "same" else 0
        for arg, value in (("in_channels", in_channels), ("out_channels", out_channels), ("groups", groups)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"customop.{op}: {arg} must be a positive int, got {value!r}")
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"customop.{op}: groups={groups} must divide in_channels={in_channels} "
                             f"and out_channels={out_channels}")
        if padding_mode not in _PADDING_MODES:
            raise ValueError(f"customop.{op}: padding_mode must be one of {_PADDING_MODES}, got {padding_mode!r}")
        super().__init__(enforce_enable=enforce_enable)
        self.in_channels, self.out_channels, self.groups, self.padding_mode = in_channels, out_channels, groups, padding_mode
        self.kernel_size = kernel
        self.stride = _tuple(op, "stride", stride, n)
        self.padding = _tuple(op, "padding", padding, n)
        self.dilation = _tuple(op, "dilation", dilation, n)
        if min(kernel + self.stride + self.dilation) <= 0 or min(self.padding) < 0:
            raise ValueError(f"customop.{op}: kernel_size, stride and dilation must be positive and padding "
                             f"non-negative, got {kernel}, {self.stride}, {self.dilation}, {self.padding}")
        #: vLLM's attribute; here it also requires dilation 1 (a dilated kernel == stride
        #: convolution is not a patch projection; vLLM's rule would compute it wrongly)
        self.enable_linear = is_patch_embedding(kernel, self.stride, self.padding, self.dilation, groups)
        self.input_size = in_channels * math.prod(kernel)
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels // groups, *kernel, dtype=dtype))
        self.register_parameter("bias", nn.Parameter(torch.empty(out_channels, dtype=dtype)) if bias else None)

    def check_input(self, x: Any) -> None:
        """The checks every path runs: raises ``TypeError``/``ValueError`` naming the problem."""
        op, n = self.name, self.num_dim
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"customop.{op}: x must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in _DTYPES or x.dtype != self.weight.dtype:
            raise TypeError(f"customop.{op}: x has dtype {x.dtype}, expected the weight's {self.weight.dtype} "
                            "(float32, float16 or bfloat16)")
        if x.device != self.weight.device:
            raise ValueError(f"customop.{op}: x is on {x.device} but the weight is on {self.weight.device}")
        if x.dim() != n + 2 or x.shape[1] != self.in_channels:
            raise ValueError(f"customop.{op}: x has shape {tuple(x.shape)}, expected [batch, {self.in_channels}, "
                             f"{', '.join('...' for _ in range(n))}]")
        spans = [d * (k - 1) + 1 for k, d in zip(self.kernel_size, self.dilation)]
        if any(size + 2 * p < span for size, p, span in zip(x.shape[2:], self.padding, spans)):
            raise ValueError(f"customop.{op}: x's spatial size {tuple(x.shape[2:])} (padded by {self.padding}) is "
                             f"smaller than the kernel's span {tuple(spans)}")

    def _args(self) -> tuple:
        return (self.stride, self.padding, self.dilation, self.groups, self.padding_mode)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        self.check_input(x)
        return conv_layer(x, self.weight, self.bias, *self._args())

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """The spec's linear form, with two changes. The GEMM is ``patch_gemm_cpu``: in bf16 / fp16
        on AVX2 CPUs an fp32 GEMM from a few dozen patches (their half-precision GEMMs get no
        hardware help there). And the patch unfold is done by ``index_select`` where it is a real copy
        (benchmarks/results/cpu_conv.md, one thread). The linear form beats oneDNN's 3-D
        convolution 7x in fp32 and 40-77x in bf16 on Qwen2-VL's patches (whose unfold is a free
        view), its 2-D one 2.1-2.7x in bf16, and ties with it in fp32. Where the image must be cut
        into patches (CLIP, SigLIP, video frames), ATen's copy of the spec's 6-D (8-D) permuted
        view runs one short strided loop per ``kernel[-1]``-element run and was 0.82-0.91x
        ``torch.compile(forward_native)`` in bf16 (Inductor fuses the unfold into one loop nest);
        ``index_select`` of the image viewed as ``[B, runs, kernel[-1]]`` memcpys the same runs
        into the same rows (bitwise the spec's rows, ``_unfold_runs``) in half the time. One
        thread (or autograd recording): ATen's dim-1 ``index_select`` loop (indices checked once,
        serial); more threads: dim 0 per image, which ATen splits across them (two threads, the
        bf16 unfold alone, medians: CLIP 4 x 336^2 0.38 ms against dim 1's 0.41 and the spec's
        copy 0.66-0.72; 2 x 448^2 0.28-0.30 against 0.36-0.39 and 0.54-0.57)."""
        self.check_input(x)
        if not self.enable_linear:
            return conv_layer(x, self.weight, self.bias, *self._args())
        rows = None
        if not torch.compiler.is_compiling() and x.is_contiguous() \
                and (runs := _unfold_runs(tuple(x.shape), self.kernel_size)) is not None:
            units = x.view(x.shape[0], -1, self.kernel_size[-1])
            if torch.get_num_threads() == 1 or torch.is_grad_enabled():
                rows = units.index_select(1, runs)
            else:
                rows = units.new_empty(x.shape[0], runs.numel(), self.kernel_size[-1])
                for image, out in zip(units, rows):
                    torch.index_select(image, 0, runs, out=out)
            rows = rows.view(-1, self.input_size)
        return patch_linear(x, self.weight, self.bias, rows=rows, linear=patch_gemm_cpu)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_kernel(x)

    forward_xpu = forward_tpu = forward_cuda

    def forward_kernel(self, x: torch.Tensor) -> torch.Tensor:
        """The ``torch.ops.customop`` call every accelerator shares (the op has no backward: while
        autograd records, the spec runs)."""
        self.check_input(x)
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters())):
            return self.forward_native(x)
        return getattr(torch.ops.customop, self.name)(x, self.weight, self.bias, *self._args())

    def extra_repr(self) -> str:
        return (f"in_channels={self.in_channels}, out_channels={self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, bias={self.bias is not None}")


@functools.lru_cache(maxsize=64)
def _unfold_runs(shape: tuple[int, ...], kernel: tuple[int, ...]) -> torch.Tensor | None:
    """Where the spec's unfold of a contiguous ``x`` of ``shape`` is a copy: which runs of
    ``kernel[-1]`` elements of one image (the rows of ``x[b].view(-1, kernel[-1])``) make its patch
    rows, in order (``_image_runs``); ``None`` where the unfold is a view (Qwen2-VL's patches:
    nothing to copy) or the last spatial size is not a multiple of ``kernel[-1]`` (the runs do not
    tile it: the spec's copy runs)."""
    if shape[-1] % kernel[-1]:
        return None
    with torch.inference_mode(False):  # (views of inference tensors do not record their base)
        if patch_rows(torch.empty(shape, device="meta"), kernel)._is_view():
            return None
    return _image_runs(shape[1:], kernel)


@functools.lru_cache(maxsize=16)
def _image_runs(image: tuple[int, ...], kernel: tuple[int, ...]) -> torch.Tensor:
    """The spec's own unfold (``patch_rows``) applied to the numbers of one image's runs, so that
    ``index_select`` copies exactly the spec's rows (one index per run: 194 KB for a 336-pixel RGB
    image in 14-pixel patches). Built outside inference mode, since ``index_select``'s backward
    saves it."""
    with torch.inference_mode(False), torch.no_grad():
        numbers = torch.arange(math.prod(image) // kernel[-1]).view(1, *image[:-1], image[-1] // kernel[-1])
        return patch_rows(numbers, (*kernel[:-1], 1)).reshape(-1)


def patch_gemm_cpu(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``forward_cpu``'s patch GEMM: ``cpu_linear`` without oneDNN. Half precision runs in fp32
    where ``FP32_GEMM_FROM_ROWS`` says so (AVX2 CPUs: bf16 / fp16 patch embeddings 5.5-8.7x
    ``torch.compile(forward_native)``); fp32 stays on ``F.linear``: oneDNN's linear, ``cpu_linear``'s
    fp32 choice, measured 0.85-0.96x on these short products (588-1176 inputs), BENCHMARKS.md
    "issue 18, CPU, fifteenth day"."""
    return cpu_linear(rows, weight, bias, onednn=False)


@CustomOp.register("conv2d")
class Conv2dLayer(ConvLayerBase):
    """``[B, C, H, W]`` -> ``[B, out, H', W']`` (vLLM's ``Conv2dLayer``)."""

    num_dim = 2


@CustomOp.register("conv3d")
class Conv3dLayer(ConvLayerBase):
    """``[B, C, T, H, W]`` -> ``[B, out, T', H', W']`` (vLLM's ``Conv3dLayer``)."""

    num_dim = 3
