"""Shared by the rotary tests: op construction, the compile-off fixture and the independent
float64 reference of the rotation (complex multiplication)."""

from __future__ import annotations

import pytest
import torch

import customop
from customop.ops.rotary_embedding import apply_rotary as apply_module, base as rope_base, clear_rope_cache
from customop.testing import tolerance

EPS32 = torch.finfo(torch.float32).eps
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


# ---- the independent float64 reference ------------------------------------------------------


def rope_reference(x, cos, sin, head_size, is_neox):
    """``x`` [T, ...] as heads of ``head_size``; pair (a, b) -> (a + ib) * (cos + i sin).
    Returns (rotated x in float64, |a| + |b| of each lane's pair in the same layout)."""
    shape, x = x.shape, x.double().reshape(cos.shape[0], -1, head_size)
    half = cos.shape[-1]
    rot = x[..., : 2 * half]
    a, b = (rot[..., :half], rot[..., half:]) if is_neox else (rot[..., 0::2], rot[..., 1::2])
    z = torch.complex(a, b) * torch.complex(cos.double(), sin.double())[:, None, :]
    mag = a.abs() + b.abs()
    if is_neox:
        out, mag = torch.cat((z.real, z.imag), -1), torch.cat((mag, mag), -1)
    else:
        out, mag = torch.stack((z.real, z.imag), -1).flatten(-2), mag.repeat_interleave(2, -1)
    passthrough = x[..., 2 * half:]
    out = torch.cat((out, passthrough), -1).reshape(shape)
    return out, torch.cat((mag, torch.zeros_like(passthrough)), -1).reshape(shape)


def assert_rotated(got, want, mag, dtype, extra=0.0, what="output"):
    """The dtype's tolerance plus one rounding of each product (eager rounds ``a*cos`` and
    ``b*sin`` to the dtype: at most eps/2 * (|a| + |b|) together) plus ``extra`` relative error
    of cos/sin (for references built from exact angles)."""
    atol, rtol = tolerance(dtype)
    err = (got.double() - want).abs()
    bound = atol + rtol * want.abs() + (torch.finfo(dtype).eps + extra) * mag
    bad = ~(err <= bound)
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {err.numel()} lanes off; worst err "
                           f"{float(err.max()):.3g} at {tuple(int(i) for i in torch.nonzero(bad)[0])}")


def inv_freq64(base, d):
    return torch.tensor([base ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)
