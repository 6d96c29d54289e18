"""Builds, caches and loads the hand-written CPU kernels (``*.c`` next to this file) with ctypes.

Nothing happens at import: the first call of ``library()`` picks the compiler flags for this CPU,
looks for a shared object built from the same sources with the same compiler and flags in the cache
directory, builds it there if missing (gcc, ~1 s: no torch headers), and loads it once for the
process. The cache: ``$CUSTOMOP_CACHE_DIR`` or ``$XDG_CACHE_HOME/customop`` (``~/.cache/customop``),
sub-folder ``native``; a file's name carries a hash of the sources, compiler and flags, so an edited
source or another CPU's flags never meet a stale build.

Where the kernels cannot run (not x86-64 Linux, no AVX-512, no C compiler, a failed build,
``CUSTOMOP_CPU_NATIVE=0``) ``library()`` returns None, says why once in the log, and the callers
take the compiled tier as before.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
#: the kernels' C sources, built into one library, and the header they share (in the cache key too)
SOURCES = (_HERE / "rms_norm.c", _HERE / "rms_norm_gated.c")
HEADERS = (_HERE / "avx512_common.h",)

#: AVX-512 subsets every kernel uses (masked 16-bit loads and stores, fpclass); F16C's conversions
#: come with AVX512F in their 512-bit form
_BASE_FEATURES = {"avx512f": "-mavx512f", "avx512bw": "-mavx512bw", "avx512vl": "-mavx512vl",
                  "avx512dq": "-mavx512dq"}
#: the hardware fp32 -> bf16 rounding; without it the bf16 entry point is not built
_BF16_FEATURE = ("avx512_bf16", "-mavx512bf16")
#: -ffp-contract=off: the kernel's squares and sums are separate roundings, as in the spec (GCC
#: contracts a * b + c into an FMA by default)
_FLAGS = ["-O3", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"]

_UNSET = object()
#: _UNSET, then the loaded library or None (unavailable; logged)
_library: object = _UNSET
#: dtype names ("bf16", "fp16") the loaded library has entry points for
dtypes: frozenset[str] = frozenset()
#: builds run by this process (tests count them)
builds = 0


def cpu_flags() -> set[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def compiler() -> str | None:
    """``$CC``, else gcc, else cc, on the PATH."""
    cc = os.environ.get("CC")
    return shutil.which(cc) if cc else (shutil.which("gcc") or shutil.which("cc"))


def cache_dir() -> Path:
    root = os.environ.get("CUSTOMOP_CACHE_DIR")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "customop")
    return Path(root) / "native"


def _plan() -> tuple[str, list[str], frozenset[str]] | str:
    """(compiler, flags, dtype names) for this machine, or why there is no kernel."""
    if os.environ.get("CUSTOMOP_CPU_NATIVE", "1") == "0":
        return "CUSTOMOP_CPU_NATIVE=0"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"{platform.system()} {platform.machine()} is not x86-64 Linux"
    flags = cpu_flags()
    missing = sorted(f for f in _BASE_FEATURES if f not in flags)
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    cc = compiler()
    if cc is None:
        return "no C compiler (gcc, cc or $CC) on the PATH"
    march = list(_BASE_FEATURES.values())
    names = {"fp16"}
    if _BF16_FEATURE[0] in flags:
        march.append(_BF16_FEATURE[1])
        names.add("bf16")
    return cc, _FLAGS + march, frozenset(names)


def _build(cc: str, flags: list[str], target: Path) -> None:
    """Compiles ``SOURCES`` to ``target`` through a temporary file in the same folder (renamed into
    place, so concurrent processes never load a half-written file)."""
    global builds
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *flags, *map(str, SOURCES), "-o", tmp], check=True, capture_output=True, text=True)
        os.replace(tmp, target)
        builds += 1
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot run (logged once); built on first use."""
    global _library, dtypes
    if _library is not _UNSET:
        return _library  # type: ignore[return-value]
    _library = None
    plan = _plan()
    if isinstance(plan, str):
        log.info("customop: no native CPU norm kernel (%s); the compiled tier runs instead", plan)
        return None
    cc, flags, names = plan
    try:
        code = b"".join(f.read_bytes() for f in (*SOURCES, *HEADERS))
        key = hashlib.sha256(code + "\0".join([cc, *flags]).encode()).hexdigest()[:20]
        target = cache_dir() / f"norms-{key}.so"
        if not target.exists():
            _build(cc, flags, target)
        lib = ctypes.CDLL(str(target))
    except subprocess.CalledProcessError as e:
        log.warning("customop: building the native CPU norm kernel failed (%s); the compiled tier runs "
                    "instead:\n%s", " ".join(e.cmd), e.stderr)
        return None
    except (OSError, RuntimeError) as e:  # RuntimeError: Path.home() without a home
        log.warning("customop: the native CPU norm kernel could not be built or loaded (%s); the "
                    "compiled tier runs instead", e)
        return None
    _library, dtypes = lib, names
    return lib


def reset() -> None:
    """Forgets the loaded library (tests: the next ``library()`` plans and loads again)."""
    global _library, dtypes
    _library, dtypes = _UNSET, frozenset()
