"""Builds, caches and loads the hand-written CPU kernels (``*.c`` next to this file) with ctypes.

Nothing happens at import: the first call of ``library()`` picks the compiler flags for this CPU,
looks for a shared object built from the same sources with the same compiler and flags in the cache
directory, builds it there if missing (gcc, ~1 s: no torch headers), and loads it once for the
process. The cache: ``$CUSTOMOP_CACHE_DIR`` or ``$XDG_CACHE_HOME/customop`` (``~/.cache/customop``),
sub-folder ``native``; a file's name carries a hash of the sources, compiler and flags, so an edited
source or another CPU's flags never meet a stale build.

Two builds, by the CPU's instruction set, each with the RMSNorm and gated-RMSNorm kernels and the
same entry points: on AVX-512 CPUs ``rms_norm.c`` and ``rms_norm_gated.c``, on CPUs with AVX2 and
F16C but no AVX-512 ``rms_norm_avx2.c`` and ``rms_norm_gated_avx2.c``. ``CUSTOMOP_CPU_NATIVE``: ``0`` no kernel,
``avx2`` / ``avx512`` that build only (the AVX2 one also runs on AVX-512 CPUs: tests and
comparisons), anything else the best build the CPU has.

Where the kernels cannot run (not x86-64 Linux, neither instruction set, no C compiler, a failed
build, ``CUSTOMOP_CPU_NATIVE=0``) ``library()`` returns None, says why once in the log, and the
callers take the compiled tier as before.
"""

from __future__ import annotations

import ctypes
import dataclasses
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


@dataclasses.dataclass(frozen=True)
class Build:
    """One library: its C sources and the headers they include (both in the cache key), and the CPU
    features it needs (``/proc/cpuinfo`` flag -> compiler flag)."""

    isa: str
    sources: tuple[Path, ...]
    headers: tuple[Path, ...]
    features: dict[str, str]


#: what both builds include
_SHARED_HEADERS = (_HERE / "native_common.h", _HERE / "rms_norm_rows.h", _HERE / "rms_norm_gated_rows.h")
#: AVX-512 subsets every kernel uses (masked 16-bit loads and stores, fpclass); F16C's conversions
#: come with AVX512F in their 512-bit form
AVX512 = Build("avx512", (_HERE / "rms_norm.c", _HERE / "rms_norm_gated.c"),
               (_HERE / "avx512_common.h", *_SHARED_HEADERS),
               {"avx512f": "-mavx512f", "avx512bw": "-mavx512bw", "avx512vl": "-mavx512vl",
                "avx512dq": "-mavx512dq"})
#: 8-lane loads and integer bf16 rounding; F16C for fp16's conversions
AVX2 = Build("avx2", (_HERE / "rms_norm_avx2.c", _HERE / "rms_norm_gated_avx2.c"),
             (_HERE / "avx2_common.h", *_SHARED_HEADERS), {"avx2": "-mavx2", "f16c": "-mf16c"})
#: the builds in order of preference
BUILDS = (AVX512, AVX2)
#: the hardware fp32 -> bf16 rounding; without it the AVX-512 build has no bf16 entry point
_BF16_FEATURE = ("avx512_bf16", "-mavx512bf16")
#: -ffp-contract=off: the kernel's squares and sums are separate roundings, as in the spec (GCC
#: contracts a * b + c into an FMA by default)
_FLAGS = ["-O3", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"]

_UNSET = object()
#: _UNSET, then the loaded library or None (unavailable; logged)
_library: object = _UNSET
#: dtype names ("bf16", "fp16") the loaded library has entry points for
dtypes: frozenset[str] = frozenset()
#: the loaded library's build, or None
loaded: Build | None = None
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


def _choose(flags: set[str], wanted: str) -> Build | str:
    """The build ``wanted`` (``CUSTOMOP_CPU_NATIVE``) and the CPU's features allow, or why there is none."""
    candidates = [b for b in BUILDS if wanted in (b.isa, "1", "")] or list(BUILDS)
    for build in candidates:
        if all(f in flags for f in build.features):
            return build
    lacks = "; ".join(f"{b.isa}: {', '.join(sorted(f for f in b.features if f not in flags))}" for b in candidates)
    return f"the CPU lacks what the builds need ({lacks})"


def _plan() -> tuple[str, list[str], frozenset[str], Build] | str:
    """(compiler, flags, dtype names, build) for this machine, or why there is no kernel."""
    wanted = os.environ.get("CUSTOMOP_CPU_NATIVE", "1")
    if wanted == "0":
        return "CUSTOMOP_CPU_NATIVE=0"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"{platform.system()} {platform.machine()} is not x86-64 Linux"
    flags = cpu_flags()
    build = _choose(flags, wanted)
    if isinstance(build, str):
        return build
    cc = compiler()
    if cc is None:
        return "no C compiler (gcc, cc or $CC) on the PATH"
    march = list(build.features.values())
    names = {"fp16"}
    if build is AVX2:
        names.add("bf16")  # rounded by integer operations: no feature of its own
    elif _BF16_FEATURE[0] in flags:
        march.append(_BF16_FEATURE[1])
        names.add("bf16")
    return cc, _FLAGS + march, frozenset(names), build


def _build(cc: str, flags: list[str], sources: tuple[Path, ...], target: Path) -> None:
    """Compiles ``sources`` to ``target`` through a temporary file in the same folder (renamed into
    place, so concurrent processes never load a half-written file)."""
    global builds
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *flags, *map(str, sources), "-o", tmp], check=True, capture_output=True, text=True)
        os.replace(tmp, target)
        builds += 1
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot run (logged once); built on first use."""
    global _library, dtypes, loaded
    if _library is not _UNSET:
        return _library  # type: ignore[return-value]
    _library = None
    plan = _plan()
    if isinstance(plan, str):
        log.info("customop: no native CPU norm kernel (%s); the compiled tier runs instead", plan)
        return None
    cc, flags, names, build = plan
    try:
        code = b"".join(f.read_bytes() for f in (*build.sources, *build.headers))
        key = hashlib.sha256(code + "\0".join([cc, *flags]).encode()).hexdigest()[:20]
        target = cache_dir() / f"norms-{build.isa}-{key}.so"
        if not target.exists():
            _build(cc, flags, build.sources, target)
        lib = ctypes.CDLL(str(target))
    except subprocess.CalledProcessError as e:
        log.warning("customop: building the native CPU norm kernel failed (%s); the compiled tier runs "
                    "instead:\n%s", " ".join(e.cmd), e.stderr)
        return None
    except (OSError, RuntimeError) as e:  # RuntimeError: Path.home() without a home
        log.warning("customop: the native CPU norm kernel could not be built or loaded (%s); the "
                    "compiled tier runs instead", e)
        return None
    _library, dtypes, loaded = lib, names, build
    return lib


def reset() -> None:
    """Forgets the loaded library (tests: the next ``library()`` plans and loads again)."""
    global _library, dtypes, loaded
    _library, dtypes, loaded = _UNSET, frozenset(), None
