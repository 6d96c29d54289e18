"""Package discovery: the top-level backends/ and benchmarks/ folders install as
customop.backends and customop.benchmarks (so `customop bench` works from an install).

Kept in setup.py (not a hand-kept list in pyproject.toml) so that a new op or backend
subpackage needs no packaging edit. Everything else is in pyproject.toml.
"""

from setuptools import find_packages, setup

packages = ["customop", *(f"customop.{p}" for p in find_packages("customop"))]
packages += ["customop.backends", *(f"customop.backends.{p}" for p in find_packages("backends"))]
packages += ["customop.benchmarks", *(f"customop.benchmarks.{p}" for p in find_packages("benchmarks"))]

setup(packages=packages, package_dir={"customop": "customop", "customop.backends": "backends", "customop.benchmarks": "benchmarks"})
