"""One compiled artifact per (function, options), shared by every op instance.

Ops hand in *module-level* pure functions: compiling bound methods would guard on ``self`` and
recompile per instance.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from customop.backends.cpu import standalone

_compiled: dict[tuple[Callable[..., Any], frozenset], Callable[..., Any]] = {}

#: Bumped by ``reset()``: caches of what ``compiled`` returned (``CpuTiers``' per-function one)
#: hold the generation they were filled in and are stale once it changes.
generation = 0

#: Keeps eager's intermediate roundings (e.g. RMSNorm's cast to the weight dtype before the
#: multiply); without it Inductor fuses the casts away and ~1% of bf16 outputs move by one ulp.
EMULATE_CASTS = {"emulate_precision_casts": True}


def compiled(fn: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """``torch.compile(fn, options=options)``, built once per (function, options). Shapes become
    dynamic after the first recompile (torch's default) unless the caller marks them earlier
    (``run_tiered`` does, so the first compile is already the graph for every size)."""
    key = (fn, frozenset(options.items()))
    out = _compiled.get(key)
    if out is None:
        out = _compiled[key] = torch.compile(fn, options=options or None)
    return out


#: Shape classes (compiled function, dtype, rank, static hidden size or None) whose graph dynamic in
#: the token dims exists: their calls need no dynamic marks any more (a dynamic graph's guards
#: accept unmarked tensors of any size), which saves the marks' fresh views, ~1-5 us a call.
_dynamic_ready: set[tuple[Any, ...]] = set()


def dynamic_ready(key: tuple[Any, ...]) -> bool:
    return key in _dynamic_ready


def mark_dynamic_ready(key: tuple[Any, ...]) -> None:
    _dynamic_ready.add(key)


def reset() -> None:
    """Forgets every compiled graph (``torch._dynamo.reset()``) and what this module knows of them:
    the next call of each tier compiles again, as in a fresh process (tests, benchmarks)."""
    global generation
    generation += 1
    standalone.reset()
    _dynamic_ready.clear()
    _compiled.clear()
    torch._dynamo.reset()
