"""Plain-torch stand-ins for IPEX's two builds, written from IPEX's documented signatures and the
behaviour measured on the CPU build (argument order, which tensor ``add_back`` writes, rotation in
place). The main tier (no IPEX) checks the mappings against them; the xpu tier runs the same
tests against the real CPU build, which keeps these honest for the functions both builds share.
The XPU-only functions (``silu_and_mul``, ``gelu_and_mul``, ``gelu_quick``,
``rotary_embedding_batched``) follow IPEX's XPU-branch source and were never run for real.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F


class FakeFunctional(SimpleNamespace):
    """``ipex.llm.functional``; ``calls`` records the names called, in order."""


def _rms(s: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def _common(calls: list[str]) -> dict:
    def rms_norm(hidden_states, weight, eps):
        calls.append("rms_norm")
        return _rms(hidden_states.float(), weight, eps).to(hidden_states.dtype)

    def add_rms_norm(residual, x, weight, bias, eps, add_back=False):
        calls.append("add_rms_norm")
        total = x.float() + residual.float()
        if add_back:
            residual.copy_(total)
        return _rms(total, weight, eps).to(x.dtype)

    def silu_mul(x, y, out=None):
        calls.append("silu_mul")
        out.copy_(F.silu(x.float()) * y.float())
        return out

    def gelu_mul(x, y, out=None, approximate="none"):
        calls.append("gelu_mul")
        out.copy_(F.gelu(x.float(), approximate=approximate) * y.float())
        return out

    def rotary_embedding(query, key, sin, cos, rotary_dim, rotary_half, position_ids=None):
        calls.append("rotary_embedding")
        assert sin.shape[-1] in (query.shape[-1], query.shape[-1] // 2), "like IPEX: full or half head dim"
        for t in (query, key):
            _rotate(t, cos[:, None, : rotary_dim // 2].float(), sin[:, None, : rotary_dim // 2].float(),
                    rotary_dim, rotary_half)
        return query, key

    return dict(rms_norm=rms_norm, add_rms_norm=add_rms_norm, silu_mul=silu_mul, gelu_mul=gelu_mul,
                rotary_embedding=rotary_embedding)


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, neox: bool) -> None:
    """In place on ``t [T, heads, D]``; ``cos``/``sin`` broadcast as ``[T, 1, rotary_dim / 2]``."""
    rot = t[..., :rotary_dim].float()
    x1, x2 = (rot.chunk(2, dim=-1) if neox else (rot[..., ::2], rot[..., 1::2]))
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    out = torch.cat((o1, o2), -1) if neox else torch.stack((o1, o2), -1).flatten(-2)
    t[..., :rotary_dim] = out.to(t.dtype)


def cpu_build() -> SimpleNamespace:
    """``intel_extension_for_pytorch`` as PyPI's 2.8.0+cpu shows it (the functions mapped here)."""
    calls: list[str] = []
    functional = FakeFunctional(calls=calls, **_common(calls))
    return SimpleNamespace(__version__="2.8.0+cpu", llm=SimpleNamespace(functional=functional))


def xpu_build() -> SimpleNamespace:
    """``intel_extension_for_pytorch`` as the 2.8.10+xpu build shows it."""
    calls: list[str] = []
    common = _common(calls)

    def silu_and_mul(x, out=None):
        calls.append("silu_and_mul")
        d = x.shape[-1] // 2
        out.copy_(F.silu(x[..., :d].float()) * x[..., d:].float())
        return out

    def gelu_and_mul(x, out=None, approximate="none"):
        calls.append("gelu_and_mul")
        d = x.shape[-1] // 2
        out.copy_(F.gelu(x[..., :d].float(), approximate=approximate) * x[..., d:].float())
        return out

    def gelu_quick(x, out=None):
        calls.append("gelu_quick")
        out.copy_(x.float() * torch.sigmoid(1.702 * x.float()))
        return out

    def rotary_embedding_batched(positions, query, key, head_dim, cos_sin_cache, is_nexo_style, rotary_dim,
                                 offsets=None):
        calls.append("rotary_embedding_batched")
        cos, sin = cos_sin_cache.index_select(0, positions).float().chunk(2, dim=-1)
        for t in (query, key):
            _rotate(t.view(positions.numel(), -1, head_dim), cos[:, None], sin[:, None], rotary_dim, is_nexo_style)
        return query, key

    functional = FakeFunctional(calls=calls, silu_and_mul=silu_and_mul, gelu_and_mul=gelu_and_mul,
                                gelu_quick=gelu_quick, rotary_embedding_batched=rotary_embedding_batched,
                                **common)
    return SimpleNamespace(__version__="2.8.10+xpu", llm=SimpleNamespace(functional=functional))
