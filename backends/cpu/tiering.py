"""The CPU path's one rule: eager below a measured size, Inductor-compiled code above it.

A compiled call has a floor of ~15-20 us on the 2-core CI machine (guards, the wrapper, an OpenMP
region), about what a whole decode-sized eager op costs; above a few thousand elements Inductor's
fused C++ is 2.5-8x faster than eager. Where the break-even lies depends on the op (how many ATen
kernels its eager form runs) and the dtype (bf16/fp16 eager pays extra cast kernels), so each op
declares its measured thresholds as class data (``cpu_tiers = CpuTiers(...)``) and its
``forward_cpu`` is one call of :func:`run_tiered`. The measurements: docs/cpu.md and
benchmarks/results/cpu_*.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from customop.backends.cpu.compile_cache import EMULATE_CASTS, compiled


@dataclasses.dataclass(frozen=True)
class CpuTiers:
    """When an op's ``forward_cpu`` compiles, and how its inputs reach the compiled code.

    Attributes:
        min_numel: inputs of at least this many elements (of the tiered tensor) run compiled.
        by_dtype: per-dtype overrides of ``min_numel`` (e.g. fp32 breaking even later).
        rows: view the tiered tensor, and every argument of its shape, as 2-D rows
            ``[-1, x.shape[-1]]`` so that one compiled graph per dtype serves every rank.
        dynamic: mark the rows' dims dynamic from the first compile (no recompile per size).
        emulate_casts: keep eager's intermediate roundings (Inductor otherwise fuses away a cast
            that the spec rounds at, e.g. RMSNorm's cast to the weight dtype).
    """

    min_numel: float
    by_dtype: Mapping[torch.dtype, float] = dataclasses.field(default_factory=dict)
    rows: bool = True
    dynamic: bool = True
    emulate_casts: bool = False

    def compile_from(self, dtype: torch.dtype) -> float:
        return self.by_dtype.get(dtype, self.min_numel)

    def compiling_from(self, numel: float) -> CpuTiers:
        """A copy that compiles from ``numel`` elements whatever the dtype (tests, experiments)."""
        return dataclasses.replace(self, min_numel=numel, by_dtype={})

    def compiled(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return compiled(fn, **EMULATE_CASTS) if self.emulate_casts else compiled(fn)


def _autograd_records(x: torch.Tensor) -> bool:
    return x.requires_grad and torch.is_grad_enabled()


def run_tiered(tiers: CpuTiers, spec: Callable[..., Any], x: torch.Tensor, *args: Any,
               eager: Callable[..., Any] | None = None, compiled_spec: Callable[..., Any] | None = None,
               prepare: Callable[[torch.Tensor], torch.Tensor] | None = None, **kwargs: Any) -> Any:
    """``spec(x, *args, **kwargs)`` on the CPU, by the cheapest route for ``x``'s size.

    - inside a caller's ``torch.compile``: ``spec`` itself (the caller's Inductor fuses it);
    - below ``tiers.compile_from(x.dtype)`` elements: ``eager(x, *args)`` (the spec's operations
      with fewer temporaries; ``None`` from it means "not covered, use the spec") while autograd
      is not recording for ``x`` (its in-place steps would overwrite saved values), else ``spec``;
    - above: the compiled ``compiled_spec`` (default ``spec``) of ``prepare(x)`` (default ``x``).
    """
    if torch.compiler.is_compiling():
        return spec(x, *args, **kwargs)
    if x.numel() < tiers.compile_from(x.dtype):
        if eager is not None and not _autograd_records(x):
            out = eager(x, *args, **kwargs)
            if out is not None:
                return out
        return spec(x, *args, **kwargs)
    fn = tiers.compiled(compiled_spec or spec)
    if prepare is not None:
        x = prepare(x)
    if not tiers.rows:
        if tiers.dynamic:
            x = x.view(x.shape)  # a fresh view, so the marks do not stick to the caller's tensor
            torch._dynamo.maybe_mark_dynamic(x, 0)
            torch._dynamo.maybe_mark_dynamic(x, x.dim() - 1)
        return fn(x, *args, **kwargs)
    return _run_on_rows(fn, tiers.dynamic, x, args, kwargs)


def _run_on_rows(fn: Callable[..., Any], dynamic: bool, x: torch.Tensor, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
    shape = x.shape
    if x.dim() == 2 and not dynamic:  # the usual [tokens, hidden]: skip the reshapes (~5 us)
        return fn(x, *args, **kwargs)
    rows = [a.reshape(-1, shape[-1]) if isinstance(a, torch.Tensor) and a.shape == shape else a
            for a in (x, *args)]
    if dynamic:
        torch._dynamo.maybe_mark_dynamic(rows[0], 0)
        torch._dynamo.maybe_mark_dynamic(rows[0], 1)
    out = fn(*rows, **kwargs)
    if isinstance(out, tuple):
        return tuple(t.view(*shape[:-1], t.shape[-1]) for t in out)
    return out.view(*shape[:-1], out.shape[-1])
