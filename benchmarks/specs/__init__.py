"""What the GPU runner times: one ``OpSpec`` per op (or op variant), collected from the
``SPECS`` list of every module in this package. The interface is documented in
benchmarks/README.md ("Adding a spec"); this module holds the types and shared helpers only.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import importlib
import importlib.util
import os
import pkgutil
import sys
import tempfile
import zipfile
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

import torch

#: issue 4's token counts; 1 and 16 are decode sizes (timed inside CUDA graphs)
TOKENS = (1, 16, 256, 4096, 32768)
QUICK_TOKENS = (1, 4096)
HIDDEN = (4096, 8192)
INTERMEDIATE = 14336  # the *_and_mul ops' d (the input is [tokens, 2 * d])

#: an implementation factory: inputs dict -> zero-argument callable (or None: not applicable)
ImplFactory = Callable[[dict[str, Any]], "Callable[[], Any] | None"]


@dataclasses.dataclass(frozen=True)
class Shape:
    tokens: int
    hidden: int
    label: str = ""
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: kept by --quick
    quick: bool = False

    def __post_init__(self) -> None:
        if not self.label:
            object.__setattr__(self, "label", f"{self.tokens}x{self.hidden}")


@dataclasses.dataclass(frozen=True)
class OpSpec:
    name: str
    family: str
    shapes: tuple[Shape, ...]
    make_inputs: Callable[[Shape, torch.dtype, torch.device], dict[str, Any]]
    bytes_moved: Callable[[Shape, torch.dtype], int]
    impls: Mapping[str, ImplFactory]
    mutates: tuple[str, ...] = ()
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
    #: (got, want) -> error; default: normwise relative error over every output tensor
    compare: Callable[[Any, Any], float] | None = None
    #: the largest error that passes; default by dtype (runner.DEFAULT_TOLERANCE)
    tolerance: float | None = None

    def __post_init__(self) -> None:
        if "eager" not in self.impls:
            raise ValueError(f"OpSpec {self.name}: impls needs an 'eager' reference; has {sorted(self.impls)}")
        object.__setattr__(self, "shapes", tuple(self.shapes))
        object.__setattr__(self, "mutates", tuple(self.mutates))


def token_shapes(hidden: Sequence[int] = HIDDEN, tokens: Sequence[int] = TOKENS,
                 label_fn: Callable[[int, int], str] | None = None,
                 extra: Mapping[str, Any] | None = None) -> tuple[Shape, ...]:
    """tokens x hidden; --quick keeps tokens {1, 4096} at the largest hidden."""
    largest = max(hidden)
    return tuple(
        Shape(t, h, label_fn(t, h) if label_fn else "", dict(extra or {}),
              quick=(h == largest and t in QUICK_TOKENS))
        for h in hidden for t in tokens)


# ---- baselines --------------------------------------------------------------------------------


@functools.cache
def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile(fn)`` specialised per shape (the strongest Inductor baseline), cached per
    function so every shape of one spec shares one compiled callable."""
    return torch.compile(fn, dynamic=False, fullgraph=True)


_LIGER_SEARCHED = False


def use_liger_wheel(path: str | None) -> None:
    """Makes ``liger_kernel`` importable from a pure-Python wheel when it is not installed: the
    wheel is unpacked (a wheel is a zip) into a temporary folder put on ``sys.path``. Triton reads
    kernel source files, so the package must be unpacked, not imported from the zip."""
    global _LIGER_SEARCHED
    _LIGER_SEARCHED = True
    if importlib.util.find_spec("liger_kernel") is not None:
        return
    candidates = [path] if path else sorted(glob.glob(os.path.join(os.getcwd(), ".whl", "liger_kernel-*.whl")))
    for wheel in candidates:
        if wheel and os.path.isfile(wheel):
            target = tempfile.mkdtemp(prefix="customop-liger-")
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(target)
            sys.path.insert(0, target)
            importlib.invalidate_caches()
            return


@functools.cache
def liger_module(name: str) -> ModuleType | None:
    """``liger_kernel.ops.<name>``, or None when Liger is absent or fails to import."""
    if not _LIGER_SEARCHED:
        use_liger_wheel(None)
    try:
        return importlib.import_module(f"liger_kernel.ops.{name}")
    except Exception as err:  # any import failure means "no Liger column", reported once
        print(f"[bench] liger_kernel.ops.{name} unavailable: {type(err).__name__}: {err}", file=sys.stderr)
        return None


# ---- collection -------------------------------------------------------------------------------


def load_specs() -> list[OpSpec]:
    """Every spec of every module in this package, in module then list order."""
    specs: list[OpSpec] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        specs.extend(getattr(module, "SPECS", ()))
    names = [s.name for s in specs]
    if dups := {n for n in names if names.count(n) > 1}:
        raise RuntimeError(f"benchmark specs: duplicate names {sorted(dups)}")
    return specs
