"""The xpu backend's imports: no op class and no other backend but the shared Triton kernels.
It reaches the ``customop::`` ops through their definitions (``customop.ops._library``) only."""

from __future__ import annotations

import ast
from pathlib import Path

import customop.backends.xpu as xpu_backend

ALLOWED_BACKENDS = ("customop.backends.xpu", "customop.backends.triton")


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _is_forbidden(name: str) -> bool:
    if name == "customop.ops" or name.startswith("customop.ops."):
        return not (name == "customop.ops._library" or name.startswith("customop.ops._library."))
    if name.startswith("customop.backends."):
        return not name.startswith(ALLOWED_BACKENDS)
    return False


def test_backend_imports_no_op_class_and_no_other_backend():
    sources = sorted(Path(xpu_backend.__file__).parent.glob("*.py"))
    assert {p.name for p in sources} >= {"__init__.py", "chain.py", "ipex_ops.py", "probe.py"}
    found = {f"{p.name}: {name}" for p in sources for name in _imported_modules(p) if _is_forbidden(name)}
    assert not found, sorted(found)


def test_the_check_sees_a_forbidden_import(tmp_path):
    source = tmp_path / "bad.py"
    source.write_text("import customop.ops._library\nfrom customop.backends import triton\n"
                      "from customop.ops.layernorm import RMSNorm\nfrom customop.backends.cpu import compiled\n")
    assert sorted(n for n in _imported_modules(source) if _is_forbidden(n)) == [
        "customop.backends.cpu", "customop.backends.cpu.compiled", "customop.ops.layernorm",
        "customop.ops.layernorm.RMSNorm"]
