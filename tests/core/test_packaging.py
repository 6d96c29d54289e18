"""Packaging as users get it: the wheel's layout (setup.py maps backends/ and benchmarks/ into
customop) and the extras declared in pyproject.toml."""

import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from customop.backend_loader import BACKENDS

ROOT = Path(__file__).resolve().parents[2]
#: source folder -> where its modules land in the wheel
LAYOUT = {"customop": "customop", "backends": "customop/backends", "benchmarks": "customop/benchmarks"}
#: source folders kept out of the wheel on purpose: scripts run from a checkout, never imported by the library
NOT_SHIPPED = ("benchmarks/experiments/",)


def _extras() -> dict[str, list[Requirement]]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {name: [Requirement(r) for r in reqs] for name, reqs in project["optional-dependencies"].items()}


def _modules(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*.py") if "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory) -> set[str]:
    """Builds the wheel from a copy of the sources (a checkout's stale build/ folder would leak
    deleted modules into it) with this environment's setuptools, as `pip wheel .` does."""
    try:  # metadata only: importing setuptools here would replace the distutils already imported
        setuptools = Version(importlib.metadata.version("setuptools"))
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("setuptools is not installed")
    if setuptools < Version("70.1") and importlib.util.find_spec("wheel") is None:  # 70.1 builds wheels itself
        pytest.skip("building a wheel with this setuptools needs the wheel package")
    try:  # metadata again: find_spec("pip") makes setuptools' distutils shim stand down for the whole
        # process (its hook for pip), and a later `import setuptools` (Inductor's C++ builds) then fails
        importlib.metadata.version("pip")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("pip is not installed")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in LAYOUT:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "results"))
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(dist), str(src)], check=True, timeout=300)
    (wheel,) = dist.glob("customop-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


def test_wheel_maps_backends_and_benchmarks_into_customop(wheel_files):
    for path in ("customop/backends/cuda/__init__.py", "customop/backends/tpu/__init__.py",
                 "customop/backends/triton/__init__.py", "customop/benchmarks/runner.py",
                 "customop/benchmarks/specs/__init__.py", "customop/__main__.py"):
        assert path in wheel_files
    assert not {f for f in wheel_files if f.startswith(("backends/", "benchmarks/", "tests/"))}
    assert not {f for f in wheel_files if f.startswith("customop/benchmarks/experiments/")}


def test_wheel_has_every_module_of_the_sources(wheel_files):
    """A folder without __init__.py is skipped by find_packages (setup.py): its modules would be
    importable from a checkout and missing from every install."""
    for folder, target in LAYOUT.items():
        missing = sorted(f"{folder}/{m}" for m in _modules(ROOT / folder)
                         if f"{target}/{m}" not in wheel_files and not f"{folder}/{m}".startswith(NOT_SHIPPED))
        assert not missing, f"not in the wheel (a folder without __init__.py?): {missing}"


def test_wheel_has_the_native_kernels_sources_and_headers(wheel_files):
    """The hand-written CPU kernels are compiled from their C files on first use (package-data, not
    modules: the check above does not see them); a missing header fails every build there."""
    from customop.backends.cpu.native import loader

    files = {p.name for build in loader.BUILDS for p in (*build.sources, *build.headers)}
    missing = sorted(f for f in files if f"customop/backends/cpu/native/{f}" not in wheel_files)
    assert not missing, f"not in the wheel (pyproject.toml's package-data?): {missing}"


def test_console_script_is_declared(wheel_files):
    assert any(f.endswith(".dist-info/entry_points.txt") for f in wheel_files)


def test_rocm_extra_brings_no_second_triton():
    """ROCm's torch wheels bring pytorch-triton-rocm; PyPI's triton is the CUDA build."""
    assert not [r for r in _extras()["rocm"] if "triton" in r.name.lower()]


def test_cuda_triton_range_admits_the_tested_pins():
    (triton,) = [r for r in _extras()["cuda"] if r.name == "triton"]
    (tested,) = [r for r in _extras()["test"] if r.name == "triton"]
    pinned = next(s.version for s in tested.specifier if s.operator == "==")
    for version in (pinned, "3.4.0", "3.6.0"):  # the tests' pin; torch 2.8's; the H200 run's
        assert triton.specifier.contains(version), (version, str(triton))
    assert not triton.specifier.contains("4.0.0")


def test_every_backend_extra_is_declared():
    extras = _extras()
    assert {spec.extra for spec in BACKENDS.values() if spec.extra} <= set(extras)
