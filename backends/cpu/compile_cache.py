"""One compiled artifact per (function, options), shared by every op instance.

Ops hand in *module-level* pure functions: compiling bound methods would guard on ``self`` and
recompile per instance.
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
    dynamic after the first recompile (torch's default) unless the caller marks them earlier."""
    key = (fn, frozenset(options.items()))
    out = _compiled.get(key)
    if out is None:
        out = _compiled[key] = torch.compile(fn, options=options or None)
    return out
