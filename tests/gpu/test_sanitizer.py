"""compute-sanitizer memcheck over one launch of every kernel variant (sanitize_kernels.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cuda

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _sanitizer() -> str | None:
    return shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.path.exists(p)), None)


@pytest.mark.skipif(_sanitizer() is None, reason="compute-sanitizer is not installed")
def test_memcheck_clean():
    proc = subprocess.run([_sanitizer(), "--tool", "memcheck", "--error-exitcode", "1",
                           sys.executable, "-m", "tests.gpu.sanitize_kernels"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, TRITON_INTERPRET="0"))
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0 and "ERROR SUMMARY: 0 errors" in proc.stdout + proc.stderr, tail
