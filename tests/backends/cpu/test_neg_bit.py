"""Inputs with the lazy negation bit (``torch._neg_view``; the real view of a conjugate) through
``forward_cpu``'s compiled tier: torch.compile (2.13) reads them without the negation, so
``run_tiered`` runs the spec eagerly for them. Each case compares with the spec on the resolved
input, at a size the compiled tier takes."""

from __future__ import annotations

import pytest
import torch

from customop.ops.activation import GeluAndMul, SiluAndMul
from customop.ops.layernorm import RMSNorm
from customop.ops.quantization import QuantFP8
from customop.ops.quantization import GroupShape


def _compiling(monkeypatch, op) -> None:
    monkeypatch.setattr(op, "cpu_tiers", op.cpu_tiers.compiling_from(0))


@pytest.mark.parametrize("op_cls", [SiluAndMul, GeluAndMul], ids=lambda c: c.__name__)
def test_activation_of_a_neg_view(monkeypatch, op_cls):
    op = op_cls()
    _compiling(monkeypatch, op)
    x = torch.randn(7, 2 * 40)
    out = op.forward_cpu(torch._neg_view(x))
    # a wrong sign would miss by O(1); ATen's kernels on a neg view may differ in the last bit
    torch.testing.assert_close(out, op.forward_native(-x))


def test_rms_norm_with_a_negated_weight_and_residual(monkeypatch):
    op = RMSNorm(40, eps=1e-6)
    _compiling(monkeypatch, op)
    with torch.no_grad():
        op.weight.copy_(torch.rand(40) + 0.5)
    x = torch.randn(7, 40)
    residual = torch.randn(7, 40)
    expected, expected_res = op.forward_native(x.clone(), residual.clone())
    # the plain norm of a neg view: the norm of -x
    torch.testing.assert_close(op.forward_cpu(torch._neg_view(-x)), op.forward_native(x.clone()), rtol=0, atol=0)
    # the fused add with x as a neg view (its residual is written in place, so it stays plain)
    out, res = op.forward_cpu(torch._neg_view(-x), residual.clone())
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(res, expected_res, rtol=0, atol=0)


def test_quant_fp8_of_a_neg_view(monkeypatch):
    op = QuantFP8(static=False, group_shape=GroupShape.PER_TOKEN)
    _compiling(monkeypatch, op)
    x = torch.randn(7, 64) * 3
    q, scale = op.forward_cpu(torch._neg_view(x))
    q_ref, scale_ref = op.forward_native(-x)
    torch.testing.assert_close(scale, scale_ref, rtol=0, atol=0)
    torch.testing.assert_close(q.float(), q_ref.float(), rtol=0, atol=0)
