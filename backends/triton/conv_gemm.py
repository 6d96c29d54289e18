"""Patch-embedding convolutions as one implicit GEMM (issue 13): the patch rows are never written.

``backends/triton/conv.py`` has two ways to compute a patch projection (kernel == stride, no
padding, dilation 1, one group) on a GPU: gather the patches into aligned rows with Triton and run
one cuBLAS GEMM (an extra read and write of the input), or, when every sample is one contiguous
patch, the spec's free view straight into cuBLAS. This module adds the third: one Triton GEMM whose
A tile ``[BLOCK_M patches, BLOCK_K]`` is loaded from the image itself. A column ``k`` of a patch
row is ``(c, kd, kh, kw)`` of the weight's order, a row ``m`` is ``(b, gd, gh, gw)`` of the output
grid (2-D inputs are depth-1 clips, as in conv.py), so the element's address is a row part
(computed once per tile, int64) plus a column part (per K step; the launcher checks that one
patch spans < 2^31 elements, so the column part is int32). With ``ROWS`` (each sample one
contiguous patch, Qwen2-VL's pixel values) the column part is ``k`` itself. ``K = C * prod(kernel)``
(588 for 3x14x14) need not be a multiple of ``BLOCK_K``: the tail is masked. fp32 accumulate,
bias added in fp32 in the epilogue, output in the input dtype, as the ``[patches, out]`` rows the
op's layout views channels-first. Tiles run in group-M order (``GROUP_M`` row blocks share the
weight's column blocks while they are in L2).

B, the weight ``[out, C, *kernel]``, is read through strides, in one of two layouts
(``ConvGemmConfig.weight_kn``):
- ``False``: the weight itself, ``[N, K]`` with K contiguous (no copy; its rows are only 8-byte
  aligned when K = 588);
- ``True``: a ``[K, N]`` copy with N contiguous (16-byte rows for every N here), made once per
  weight version and cached (``prepared_weight``): keyed by the tensor's address, shape, dtype and
  version counter, and only hit by the same tensor object (a weak reference), so an in-place
  update (``weight.copy_``: a new version) or a new tensor at a freed address re-prepares it.
  Inference-mode tensors have no version counter: they are prepared on every call (a
  ``[K, N]`` copy, ~1 MB). A CUDA graph captured after the copy replays the cached copy: load the
  weights before capturing, as vLLM does.

Choice of path per shape: ``TABLE`` (plain data, keyed by device type, kernel, in channels, out
channels and dtype; rows by patch count) names ``"implicit"`` (with its config), ``"gather"`` or
``"view"``; shapes not in it keep conv.py's previous rule (the free view when the rows are one,
the gather otherwise). ``override`` forces a route and config (the sweep, the tests). No autotune
on the request path: ``python3 -m customop.benchmarks.specs.conv --sweep`` times the candidates on
a GPU and prints table rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from collections import OrderedDict
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from customop.backends.triton._common import INTERPRETED, device_guard, interpreter_safe_dot


@dataclasses.dataclass(frozen=True)
class ConvGemmConfig:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    #: B from a cached ``[K, N]`` copy (N contiguous) instead of the weight's own ``[N, K]``
    weight_kn: bool = False


DEFAULT = ConvGemmConfig()

#: what the sweep times per shape (``--sweep``); the first is ``DEFAULT``
CANDIDATES = (
    DEFAULT,
    ConvGemmConfig(128, 128, 64, 8, 8, 4),
    ConvGemmConfig(128, 64, 64, 8, 8, 4),
    ConvGemmConfig(64, 128, 64, 8, 8, 4),
    ConvGemmConfig(128, 128, 32, 8, 8, 4),
    ConvGemmConfig(64, 64, 64, 8, 4, 4),
    ConvGemmConfig(128, 128, 64, 8, 8, 3, weight_kn=True),
    ConvGemmConfig(64, 128, 64, 8, 4, 4, weight_kn=True),
)
# (compiled for sm_90 at 3 stages: 128-row and 64 x 128 tiles at 4 warps, and 128 x 256 tiles, spill)

ROUTES = ("implicit", "gather", "view")

#: (device type, kernel, in channels, out channels, dtype name) -> ((max patches, route, config), ...):
#: the first row whose max patches >= the call's patch count. Filled from ``--sweep`` on the H200;
#: empty until then (the previous rule applies: ``view`` or ``gather``).
TABLE: dict[tuple, tuple[tuple[int, str, ConvGemmConfig | None], ...]] = {}

_override: list[tuple[str, ConvGemmConfig | None]] = []


@contextlib.contextmanager
def override(route: str, cfg: ConvGemmConfig | None = None) -> Iterator[None]:
    """Every patch projection inside the block takes ``route`` (``implicit`` with ``cfg`` or
    ``DEFAULT``; ``gather``; ``view``, which falls back to ``gather`` where the rows are not a view)."""
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    _override.append((route, cfg))
    try:
        yield
    finally:
        _override.pop()


def span_fits_int32(x: torch.Tensor, kernel: tuple[int, ...]) -> bool:
    """Whether one patch's offsets (the kernel's column part) fit in int32."""
    span = (x.shape[1] - 1) * x.stride(1) + sum((k - 1) * s for k, s in zip(kernel, x.stride()[2:]))
    return span < 2 ** 31


def choose(x: torch.Tensor, weight: torch.Tensor, rows_are_a_view: bool) -> tuple[str, ConvGemmConfig]:
    """``(route, config)`` for one call: the override, else the table, else the previous rule."""
    kernel = tuple(weight.shape[2:])
    if _override:
        route, cfg = _override[-1]
    else:
        route, cfg = ("view" if rows_are_a_view else "gather"), None
        patches = x.shape[0] * math.prod(s // k for s, k in zip(x.shape[2:], kernel))
        key = (x.device.type, kernel, x.shape[1], weight.shape[0], str(x.dtype).removeprefix("torch."))
        for max_patches, r, c in TABLE.get(key, ()):
            if patches <= max_patches:
                route, cfg = r, c
                break
    if route == "view" and not rows_are_a_view:
        route = "gather"
    if route == "implicit" and not span_fits_int32(x, kernel):
        route = "gather"
    return route, cfg or DEFAULT


_PREPARED: OrderedDict = OrderedDict()
_PREPARED_MAX = 32


def prepared_weight(weight: torch.Tensor) -> torch.Tensor:
    """The ``[K, N]`` (N contiguous) copy of ``weight`` ``[N, C, *kernel]``, cached per weight version."""
    try:
        version = weight._version
    except RuntimeError:  # an inference tensor: no version counter, so no safe cache key
        return weight.reshape(weight.shape[0], -1).t().contiguous()
    key = (weight.data_ptr(), tuple(weight.shape), tuple(weight.stride()), weight.dtype, weight.device, version)
    hit = _PREPARED.get(key)
    if hit is not None and hit[0]() is weight:
        _PREPARED.move_to_end(key)
        return hit[1]
    kn = weight.reshape(weight.shape[0], -1).t().contiguous()
    _PREPARED[key] = (weakref.ref(weight), kn)
    while len(_PREPARED) > _PREPARED_MAX:
        _PREPARED.popitem(last=False)
    return kn


@triton.jit
def _patch_gemm_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, GD, GH, GW,
                       sx_b, sx_c, sx_d, sx_h, sx_w, sw_k, sw_n, so_m,
                       KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, ROWS: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
                       UPCAST: tl.constexpr):
    # group-M tile order: GROUP_M row blocks sweep the column blocks together
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    if ROWS:  # each sample is one contiguous patch: row m starts at m * sx_b
        row = offs_m.to(tl.int64) * sx_b
    else:  # the patch's corner in the input
        gw = offs_m % GW
        gh = (offs_m // GW) % GH
        gd = (offs_m // (GW * GH)) % GD
        b = offs_m // (GW * GH * GD)
        row = (b.to(tl.int64) * sx_b + (gd * KD).to(tl.int64) * sx_d + (gh * KH).to(tl.int64) * sx_h
               + (gw * KW).to(tl.int64) * sx_w)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        if ROWS:
            col = k
        else:  # the column's (c, kd, kh, kw) in the weight's order, as an offset inside the patch
            kw = k % KW
            kh = (k // KW) % KH
            kd = (k // (KW * KH)) % KD
            c = k // (KW * KH * KD)
            col = c * sx_c + kd * sx_d + kh * sx_h + kw * sx_w
        a = tl.load(x_ptr + (row[:, None] + col[None, :]), mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        bt = tl.load(w_ptr + k[:, None] * sw_k + offs_n[None, :] * sw_n, mask=k_ok[:, None] & n_ok[None, :],
                     other=0.0)
        acc += interpreter_safe_dot(a, bt, PRECISION, UPCAST)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    dst = out_ptr + offs_m.to(tl.int64)[:, None] * so_m + offs_n[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def launch_args(x: torch.Tensor, kernel: tuple[int, ...]) -> tuple:
    """``(x as 5-D, (kd, kh, kw), (gd, gh, gw), patches, K, rows)`` for a 4-D or 5-D input."""
    if x.dim() == 4:
        x, kernel = x.unsqueeze(2), (1, *kernel)
    grid = tuple(size // k for size, k in zip(x.shape[2:], kernel))
    patches = x.shape[0] * math.prod(grid)
    rows = tuple(x.shape[2:]) == tuple(kernel) and x[0].is_contiguous()
    return x, tuple(kernel), grid, patches, x.shape[1] * math.prod(kernel), rows


def patch_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               cfg: ConvGemmConfig = DEFAULT) -> torch.Tensor:
    """``[patches, out]`` = the patch rows of ``x`` ``[B, C, *spatial]`` (2 or 3 spatial dims) times
    ``weight`` ``[out, C, *kernel]`` transposed, plus ``bias``; in ``x``'s dtype."""
    x5, (kd, kh, kw), (gd, gh, gw), M, K, rows = launch_args(x, tuple(weight.shape[2:]))
    N = weight.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if cfg.weight_kn:
        w = prepared_weight(weight)
        sw_k, sw_n = w.stride()
    else:
        w = weight.reshape(N, K)
        sw_n, sw_k = w.stride()
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    with device_guard(x.device):
        _patch_gemm_kernel[grid](
            x5, w, bias if bias is not None else out, out, M, N, K, gd, gh, gw, *x5.stride(), sw_k, sw_n, out.stride(0),
            KD=kd, KH=kh, KW=kw, ROWS=rows, HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            UPCAST=INTERPRETED, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
