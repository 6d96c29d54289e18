"""Float64 references of the norms table (``customop/samples/layernorm.py``): the spec's rounding
points where they are observable (vLLM's order), exact arithmetic elsewhere; written from the
formulas, not from ``customop.math``. Every tier judges its path with them.
"""

from __future__ import annotations

import torch

from customop.samples.layernorm import NormCase
from customop.testing import assert_close


def _normalised(h, eps, var_size=None):
    v = h if var_size is None else h[..., :var_size]
    return h * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)


def ref_rms_norm(x, weight, eps, var_size=None):
    """Llama's RMSNorm in float64; the normalised value is rounded to the weight's dtype before
    the multiply (HF Llama), the product itself is exact."""
    y = _normalised(x.double(), eps, var_size)
    if weight is not None:
        y = y.to(weight.dtype).double() * weight.double()
    return y


def ref_gemma(x, weight, eps):
    return _normalised(x.double(), eps) * (1 + weight.double())


def ref_fused_add(x, residual, weight, eps, gemma=False, var_size=None):
    """(normalised output, new residual), both float64."""
    h = x.double() + residual.double()
    return (ref_gemma(h, weight, eps) if gemma else ref_rms_norm(h, weight, eps, var_size)), h


def ref_gated(x, weight, z, eps, group_size, norm_before_gate, sigmoid):
    x = x.double()
    gate = None
    if z is not None:
        z = z.double()
        gate = 1 / (1 + torch.exp(-z)) if sigmoid else z / (1 + torch.exp(-z))
        if not norm_before_gate:
            x = x * gate
    y = _normalised(x.unflatten(-1, (-1, group_size)), eps).flatten(-2) * weight.double()
    return y * gate if gate is not None and norm_before_gate else y


def reference(case: NormCase, op, x: torch.Tensor, other: torch.Tensor | None = None):
    """(float64 output, float64 new residual or None) of ``case``'s op (built by ``case.build``)
    on ``x`` and the call's second tensor (residual or z)."""
    if case.op == "rms_norm_gated":
        return ref_gated(x, op.weight, other, op.eps, op.group_size, op.norm_before_gate,
                         op.activation == "sigmoid"), None
    gemma = case.op == "gemma_rms_norm"
    if case.residual:
        return ref_fused_add(x, other, op.weight, op.eps, gemma)
    return (ref_gemma(x, op.weight, op.eps) if gemma else ref_rms_norm(x, op.weight, op.eps)), None


def assert_matches(got, expected, dtype: torch.dtype, exact_residual: bool = False, what: str = "") -> None:
    """``got`` (an output, or ``(output, new residual)``) against ``reference``'s pair, under the
    dtype's tolerance. ``exact_residual``: the new residual must be bit-exact (the native and CPU
    paths round the fp32 sum once; a kernel under the interpreter truncates instead)."""
    expected_out, expected_residual = expected
    if expected_residual is None:
        assert got.dtype == dtype, f"{what}: output dtype {got.dtype}, expected {dtype}"
        assert_close(got, expected_out, dtype, what=f"{what} out")
        return
    out, residual = got
    assert out.dtype == residual.dtype == dtype
    assert_close(out, expected_out, dtype, what=f"{what} out")
    if exact_residual:
        assert_close(residual, expected_residual.to(dtype), dtype, atol=0, rtol=0, what=f"{what} residual")
    else:
        assert_close(residual, expected_residual, dtype, what=f"{what} residual")
