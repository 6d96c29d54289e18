"""Compiled forms of the norm specs that round to bf16 in fp32 arithmetic (issue 18).

Hugging Face Llama's RMSNorm rounds the normalised fp32 value to the weight dtype before the
weight multiply (``y.to(w.dtype) * w``). Inductor fuses that round trip away unless compiled with
``emulate_precision_casts``, and on an AVX2 CPU without bf16 instructions the emulated round trip
is ~24 vector instructions per 16 lanes (at::vec's rounding, pack, permute and unpack): bf16
``rms_norm`` ran at 0.62-0.67x of a plain ``torch.compile`` of the spec from 256x4096 rows up
(2-core EPYC, 2026-12-01). The forms here compute the same value with Veltkamp's split
(:func:`round_to_bf16`): three fp32 operations per lane, which Inductor vectorises like any other
arithmetic, so nothing is left for the emulation to do. Mamba-2's grouped gated norm
(``customop.math.mamba.mixer2_gated_rms_norm``) rounds its normalised value the same way before
the weight multiply and has a form here too.

``compiled_form(spec)`` gives the form ``CpuTiers.compiled`` compiles in place of ``spec`` (the
spec itself when it has none). Each form takes the spec's arguments and runs the spec itself for
every case but x and weight both bf16 (Dynamo traces that branch once per dtype).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import torch.nn.functional as F

from customop.math import layernorm as spec
from customop.math import mamba as mamba_spec

#: 2^16 + 1: Veltkamp's constant for splitting fp32's 24-bit significand into 8 + 16 bits.
_SPLIT = 65537.0

#: Inductor options the split depends on: no contraction of ``y * C - y`` into an FMA and no
#: algebraic simplification of ``t - (t - y)`` (both are Inductor's defaults; an environment
#: variable could change them, so the compiled forms pin them).
EXACT_ROUNDING_OPTIONS = {"cpp.enable_floating_point_contract_flag": "off", "cpp.enable_unsafe_math_opt_flag": False}


def round_to_bf16(y: torch.Tensor) -> torch.Tensor:
    """``y.to(torch.bfloat16).float()`` (round to nearest, ties to even) in fp32 arithmetic:
    ``t = y * (2^16 + 1); t - (t - y)`` keeps the high 8 significant bits of ``y``, rounded to
    nearest even. Exact for zeros and every fp32 ``y`` with ``2^-126 <= |y| < 2^111``: every value
    RMSNorm normalises (``|y| <= sqrt(hidden)``; the gated norm's ``|y| <= sqrt(group_size)``)
    unless a row's (group's) largest and smallest nonzero magnitudes lie 2^126 or more apart, where
    an fp32-subnormal ``y`` comes back unrounded (an error below 2^-133, bf16's smallest subnormal).
    NaN stays NaN; infinities (which a normalised value never is: an infinite x makes the spec's y
    NaN too) become NaN."""
    t = y * _SPLIT
    return t - (t - y)


def _normalise(xf: torch.Tensor, eps: float, variance_size: int | None) -> torch.Tensor:
    # the specs' formula (customop/math/layernorm.py, rms_norm; per group in
    # customop/math/mamba.py, mixer2_gated_rms_norm), step for step
    x_var = xf if variance_size is None else xf[..., :variance_size]
    return xf * torch.rsqrt(x_var.pow(2).mean(dim=-1, keepdim=True) + eps)


def _bf16_pair(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    return weight is not None and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             variance_size: int | None = None) -> torch.Tensor:
    """``spec.rms_norm``; for bf16 x and weight, ``y.to(bf16) * w`` as ``round_to_bf16(y) * w`` in
    fp32 (the product of two bf16 values is exact in fp32) and one rounding to bf16 at the end."""
    if not _bf16_pair(x, weight):
        return spec.rms_norm(x, weight, eps, variance_size)
    y = _normalise(x.float(), eps, variance_size)
    return (round_to_bf16(y) * weight.float()).to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float,
                       variance_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``spec.fused_add_rms_norm`` with :func:`rms_norm`'s rounding for bf16 x and weight."""
    if not _bf16_pair(x, weight):
        return spec.fused_add_rms_norm(x, residual, weight, eps, variance_size)
    h = x.float() + residual.float()
    y = _normalise(h, eps, variance_size)
    return (round_to_bf16(y) * weight.float()).to(x.dtype), h.to(x.dtype)


def mixer2_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None, eps: float,
                          group_size: int) -> torch.Tensor:
    """``mamba_spec.mixer2_gated_rms_norm``; for bf16 x and weight, the spec's steps in its order:
    the gate product ``x * silu(fp32 gate)`` in fp32, each group of ``group_size`` lanes normalised
    in fp32, ``g.to(bf16)`` as ``round_to_bf16(g)``, the weight multiply in fp32 (exact: both
    factors are bf16 values) and one rounding to bf16 at the end. Without a weight the spec has no
    intermediate rounding and runs itself."""
    if not _bf16_pair(x, weight):
        return mamba_spec.mixer2_gated_rms_norm(x, gate, weight, eps, group_size)
    g = x * F.silu(gate.float())
    g = _normalise(g.unflatten(-1, (-1, group_size)), eps, None).flatten(-2)
    return (round_to_bf16(g) * weight.float()).to(x.dtype)


_FORMS: dict[Callable[..., Any], Callable[..., Any]] = {
    spec.rms_norm: rms_norm,
    spec.fused_add_rms_norm: fused_add_rms_norm,
    mamba_spec.mixer2_gated_rms_norm: mixer2_gated_rms_norm,
}


def compiled_form(fn: Callable[..., Any]) -> Callable[..., Any]:
    """What to compile for ``fn`` under ``emulate_casts``: its exact-rounding form, or ``fn``."""
    return _FORMS.get(fn, fn)
