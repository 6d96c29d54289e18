"""Hugging Face's ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` on customop's
``ApplyRotaryEmb`` op.

Hugging Face's rotary classes build ``cos``/``sin`` as ``[B, S, D]`` from ``cat(freqs, freqs)``,
so both halves of the last dim hold the same values; ``q``/``k`` are ``[B, H, S, D]`` views of
``[B, S, H, D]`` projections. ``q * cos + rotate_half(q) * sin`` is then exactly NeoX-style RoPE
with the first half of ``cos``/``sin``, in q's dtype: ``ApplyRotaryEmb`` with
``enable_fp32_compute=False`` computes the same products and sums (``x1*c - x2*s`` equals
``x1*c + (-x2)*s`` bit for bit). Its ``cos``/``sin`` are ``[S, R/2]`` shared by the batch, so
per-row positions (``cos`` with a batch dim > 1) are passed as ``B*S`` rows of one sequence.
A call outside these conditions (other dtypes or shapes) runs the original function.

The attention modules call the function as a global of their modeling module, so that global is
what gets replaced: for every model of the architecture in the process, while at least one
patched model holds it (``install``/``release`` count the holders). A per-instance forward with
other globals was tried and dropped: ``torch.compile`` resolves a function's globals through its
module's name and guards on the module's real global.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

Tensor = torch.Tensor


def _servable(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int, partial: bool) -> bool:
    if not all(isinstance(t, Tensor) for t in (q, k, cos, sin)):
        return False
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape or unsqueeze_dim not in (1, 2):
        return False
    if not (q.dtype == k.dtype == cos.dtype == sin.dtype) or not q.is_floating_point():
        return False
    seq = 2 if unsqueeze_dim == 1 else 1
    rotary, head = cos.shape[-1], q.shape[-1]
    if k.shape[-1] != head or rotary % 2 or not (rotary == head or (partial and rotary < head)):
        return False
    return (q.shape[0] == k.shape[0] and cos.shape[0] in (1, q.shape[0])
            and cos.shape[1] == q.shape[seq] == k.shape[seq])


def _rotate(op: Callable, x: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int) -> Tensor:
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    xs = x.transpose(1, 2) if unsqueeze_dim == 1 else x  # [B, S, H, D]: a view of the projection
    batch, seq, heads, head = xs.shape
    if cos.shape[0] == 1:
        out = op(xs, cos[0], sin[0])
    else:
        rows = batch * seq
        out = op(xs.reshape(rows, heads, head), cos.reshape(rows, half), sin.reshape(rows, half))
        out = out.view(batch, seq, heads, head)
    return out.transpose(1, 2) if unsqueeze_dim == 1 else out


def make_apply_rotary(op: Callable, original: Callable, partial: bool) -> Callable:
    """Hugging Face's signature on ``op`` (an ``ApplyRotaryEmb``); ``partial``: the original
    rotates the first ``cos.shape[-1]`` lanes and passes the rest (Phi-3), else it rotates all."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if not _servable(q, k, cos, sin, unsqueeze_dim, partial):
            return original(q, k, cos, sin, unsqueeze_dim)
        return _rotate(op, q, cos, sin, unsqueeze_dim), _rotate(op, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.__customop_original__ = original
    return apply_rotary_pos_emb


@dataclass
class _Installed:
    original: Callable
    replacement: Callable
    op: Callable
    holders: set = field(default_factory=set)


_installed: dict[str, _Installed] = {}
_lock = threading.Lock()


def install(modeling: str, partial: bool, make_op: Callable[[], Callable]) -> tuple[Callable, object]:
    """Puts the replacement into ``sys.modules[modeling].apply_rotary_pos_emb`` (once per module;
    later calls add a holder). Returns (the op, a holder token for ``release``). Raises
    ``LookupError`` when the module has no such function."""
    module = sys.modules[modeling]
    with _lock:
        state = _installed.get(modeling)
        if state is None or getattr(module, "apply_rotary_pos_emb", None) is not state.replacement:
            original = getattr(module, "apply_rotary_pos_emb", None)
            if not callable(original):
                raise LookupError(f"{modeling} has no apply_rotary_pos_emb")
            op = make_op()
            state = _Installed(original, make_apply_rotary(op, original, partial), op)
            _installed[modeling] = state
            module.apply_rotary_pos_emb = state.replacement
        token = object()
        state.holders.add(token)
        return state.op, token


def release(modeling: str, token: object) -> bool:
    """Drops a holder; the last one puts the original function back. False for an unknown token."""
    with _lock:
        state = _installed.get(modeling)
        if state is None or token not in state.holders:
            return False
        state.holders.discard(token)
        if not state.holders:
            module = sys.modules.get(modeling)
            if module is not None and getattr(module, "apply_rotary_pos_emb", None) is state.replacement:
                module.apply_rotary_pos_emb = state.original
            del _installed[modeling]
        return True
