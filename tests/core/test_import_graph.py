"""The import graph the architecture promises (docs/design.md, "Layers"), read from the source:

- the core (dispatcher, config, platforms, backend table, plugins, distributed) and the math
  (``customop/math``) import no op module and no backend;
- a backend imports no op class: from ``customop.ops`` only the ``_library`` entry points, and
  no other backend except the shared Triton kernels (``customop.backends.triton``);
- the math imports nothing of customop but other math modules.

Static on purpose: an import inside a function counts as much as one at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ["custom_op.py", "config.py", "platforms.py", "backend_loader.py", "plugins.py", "distributed.py"]


def imported_modules(source: str) -> set[str]:
    """Every absolute module a source file imports (``from a.b import c`` gives ``a.b`` and
    ``a.b.c``: c may be a submodule)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def backend_violations(backend: str, source: str) -> list[str]:
    bad = []
    for module in imported_modules(source):
        if module.startswith("customop.ops") and not module.startswith("customop.ops._library"):
            if module != "customop.ops":  # "from customop.ops import _library" names the package
                bad.append(module)
        if module.startswith("customop.backends."):
            other = module.split(".")[2]
            if other not in (backend, "triton"):
                bad.append(module)
    return sorted(bad)


def core_violations(source: str) -> list[str]:
    return sorted(m for m in imported_modules(source) if m.startswith(("customop.ops", "customop.backends")))


def math_violations(source: str) -> list[str]:
    return [m for m in imported_modules(source)
            if m.startswith("customop") and not m.startswith("customop.math")]


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", _files(ROOT / "backends"), ids=lambda p: str(p.relative_to(ROOT)))
def test_backends_import_no_op_class_and_no_other_backend(path):
    backend = path.relative_to(ROOT / "backends").parts[0]
    assert backend_violations(backend, path.read_text()) == []


@pytest.mark.parametrize("name", CORE)
def test_core_imports_no_op_and_no_backend(name):
    assert core_violations((ROOT / "customop" / name).read_text()) == []


@pytest.mark.parametrize("path", _files(ROOT / "customop" / "math"), ids=lambda p: p.name)
def test_math_imports_only_math(path):
    assert math_violations(path.read_text()) == []


def test_the_checks_catch_violations():
    """The rules fail on the imports they forbid (so the tests above can fail)."""
    assert backend_violations("tpu", "from customop.ops.layernorm import RMSNorm") == ["customop.ops.layernorm",
                                                                                    "customop.ops.layernorm.RMSNorm"]
    assert backend_violations("tpu", "def f():\n    import customop.backends.cpu") == ["customop.backends.cpu"]
    assert backend_violations("xpu", "from customop.ops import _library\nfrom customop.backends import triton") == []
    assert core_violations("from customop.ops import activation") != []
    assert math_violations("from customop.platforms import current_platform") != []
    assert math_violations("from customop.math.layernorm import rms_norm") == []
