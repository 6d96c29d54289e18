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

_compiled: dict[Callable[..., Any], Callable[..., Any]] = {}


def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile(fn)``, built once per function. Shapes become dynamic after the first
    recompile (torch's default), so a serving loop with varying token counts does not recompile
    per shape."""
    out = _compiled.get(fn)
    if out is None:
        out = _compiled[fn] = torch.compile(fn)
    return out
