"""Shared by the rotary tests: op construction and the compile-off fixture. The float64
references are in tests/cases/rotary.py."""

from __future__ import annotations

import pytest

import customop
from customop.ops.rotary_embedding import apply_rotary as apply_module, base as rope_base, clear_rope_cache

#: head size and base of the small ropes the tests build
D, BASE = 64, 10000.0


def build(cls, *args, config=customop.Config(custom_ops=["all"]), **kwargs):
    with customop.use_config(config):
        return cls(*args, **kwargs)


def dtype_id(dtype):
    return str(dtype).removeprefix("torch.")


def compile_from(monkeypatch, op_cls, numel: float) -> None:
    """``op_cls.forward_cpu`` compiles from ``numel`` elements (for the rotary op: tokens)."""
    monkeypatch.setattr(op_cls, "cpu_tiers", op_cls.cpu_tiers.compiling_from(numel))


@pytest.fixture(autouse=True)
def _compile_off_and_fresh_rope_cache(monkeypatch):
    """CPU paths run eager unless a test turns compiling on: each compile costs seconds."""
    compile_from(monkeypatch, rope_base.RotaryEmbedding, 1 << 30)
    compile_from(monkeypatch, apply_module.ApplyRotaryEmb, 1 << 30)
    clear_rope_cache()
    yield
    clear_rope_cache()
