"""The compile-for-the-GPUs check shared by the kernel test modules that list their own
ahead-of-time cases (``_aot_cases()``: label, kernel, pointer types, constexprs, warps).

The test process runs Triton's interpreter, so each check compiles in a subprocess with
``TRITON_INTERPRET=0`` (``python -m <test module> <target>`` prints ``report``'s JSON) and
asserts: every case compiles, and on CUDA none uses local memory or spills. Nothing here imports
triton at module level (``aot_check`` does, and must not be imported under the interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable

import pytest


def report(cases: Iterable, target: str, aligned: tuple[str, ...] = ()) -> dict:
    """Compiles every case for ``target`` (in the subprocess): ``{label: stats or {"error": ...}}``."""
    from tests.backends.triton.aot_check import compile_one

    out = {}
    for label, kernel, types, const, warps in cases:
        sig = {a: types.get(a, "i32") for a in kernel.arg_names if a not in const}
        try:
            out[label] = compile_one(kernel, sig, const, warps, aligned, target)
        except Exception as err:  # reported per kernel
            out[label] = {"error": f"{type(err).__name__}: {str(err)[:2000]}"}
    return out


def main(cases: Iterable, aligned: tuple[str, ...] = ()) -> None:
    """The test module's ``__main__``: prints the report for ``argv[1]`` (default cuda:90)."""
    print(json.dumps(report(cases, sys.argv[1] if len(sys.argv) > 1 else "cuda:90", aligned)))


def assert_compiles_for(module: str, target: str, n_cases: int, spill_ok: dict[str, int] | None = None) -> None:
    """Runs ``python -m module target`` without the interpreter and checks its report: no errors
    and no spills, except up to ``spill_ok[label]`` bytes where a sweep measured the spilling
    shape fastest (the caller says why)."""
    from tests.backends.triton.test_aot_compile import ROOT, _nvidia_backend_present

    if target.startswith("cuda") and not _nvidia_backend_present():
        pytest.skip("triton's NVIDIA backend (ptxas, cuobjdump) is not installed")
    proc = subprocess.run([sys.executable, "-m", module, target], cwd=ROOT,
                          env=dict(os.environ, TRITON_INTERPRET="0"), capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stderr[-4000:]
    got = json.loads(lines[-1])
    assert len(got) == n_cases
    problems = [f"{label}: {info['error']}" for label, info in got.items() if "error" in info]
    if target.startswith("cuda"):
        problems += [f"{label}: spills {info}" for label, info in got.items()
                     if "error" not in info and (info["local_bytes"] or info["spill_bytes"])
                     and (info["spill_bytes"] or 0) > (spill_ok or {}).get(label, 0)]
    assert not problems, "\n".join(problems)
