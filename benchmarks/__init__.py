"""Benchmarks: one runner (``customop bench``) over per-family specs; results in BENCHMARKS.md."""
