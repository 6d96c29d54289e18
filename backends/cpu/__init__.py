"""CPUs: Inductor-compiled native code (2.5-8x faster than eager for memory-bound ops on this
CPU, DESIGN.md section 4), oneDNN through PyTorch where it wins, IPEX's CPU kernels when present.

Ops call ``compiled(fn)`` with a *module-level* pure function: one compiled artifact per function,
shared by every instance (compiling bound methods would guard on ``self`` and recompile per
instance).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_compiled: dict[tuple[Callable[..., Any], frozenset], Callable[..., Any]] = {}

#: Keeps eager's intermediate roundings (e.g. RMSNorm's cast to the weight dtype before the
#: multiply); without it Inductor fuses the casts away and ~1% of bf16 outputs move by one ulp.
EMULATE_CASTS = {"emulate_precision_casts": True}


def compiled(fn: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """``torch.compile(fn, options=options)``, built once per (function, options). Shapes become
    dynamic after the first recompile (torch's default), so a serving loop with varying token
    counts does not recompile per shape."""
    key = (fn, frozenset(options.items()))
    out = _compiled.get(key)
    if out is None:
        out = _compiled[key] = torch.compile(fn, options=options or None)
    return out
