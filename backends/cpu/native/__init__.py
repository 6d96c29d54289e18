"""Hand-written CPU kernels for the few specs where Inductor's code cannot reach an instruction the
op needs (issue 18): RMSNorm's exact bf16/fp16 roundings, with vcvtne2ps2bf16 / vcvtps2ph (the
same kernel serves Gemma's RMSNorm, whose one rounding at the end is the same conversion); and
Mamba-2's grouped gated RMSNorm (``rms_norm_gated``), whose Inductor code keeps an fp32 buffer of
the whole input between three passes: the kernel makes two passes over each row group, in cache
(and serves the KDA output norm, ``fused_rms_norm_gated``, the same math over whole rows).

``kernel_for(spec)`` gives the kernel standing in for a spec function (None: the spec has none);
``CpuTiers.native_from`` says from which size an op's ``run_tiered`` tries it. A kernel returns
the spec's result, or None for a call it does not take (dtype, layout, CPU features, autograd),
which then runs the compiled tier. The C sources are built into one library and loaded on first
use (``loader.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from customop.backends.cpu.native import rms_norm as _rms_norm
from customop.backends.cpu.native import rms_norm_gated as _rms_norm_gated
from customop.math import layernorm as _spec

_KERNELS: dict[Callable[..., Any], Callable[..., Any]] = {
    _spec.rms_norm: _rms_norm.rms_norm,
    _spec.fused_add_rms_norm: _rms_norm.fused_add_rms_norm,
    _spec.gemma_rms_norm: _rms_norm.gemma_rms_norm,
    _spec.gemma_fused_add_rms_norm: _rms_norm.gemma_fused_add_rms_norm,
    _spec.rms_norm_gated: _rms_norm_gated.rms_norm_gated,
    _spec.fused_rms_norm_gated: _rms_norm_gated.fused_rms_norm_gated,
}
#: each kernel's module, whose ``entries()`` builds and loads it
_LOADERS = {**dict.fromkeys(_KERNELS, _rms_norm), _spec.rms_norm_gated: _rms_norm_gated,
            _spec.fused_rms_norm_gated: _rms_norm_gated}


def kernel_for(spec: Callable[..., Any]) -> Callable[..., Any] | None:
    return _KERNELS.get(spec)


def prepare(spec: Callable[..., Any]) -> None:
    """Builds and loads ``spec``'s kernel now (warm-up), not on the first call that takes it."""
    if spec in _LOADERS:
        _LOADERS[spec].entries()
