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


def ref_layer_norm(x, weight, bias, eps, one_plus=False):
    """(x - mean) / sqrt(var + eps) * w + b in float64 (biased variance). ``one_plus``
    (Nemotron): the weight is ``1 + w`` rounded to w's dtype, as vLLM forms it there."""
    x = x.double()
    centred = x - x.mean(-1, keepdim=True)
    y = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * ((weight + 1).double() if one_plus else weight.double())
    return y if bias is None else y + bias.double()


def ref_fused_add_nemotron(x, residual, weight, bias, eps):
    """(output, new residual): the sum is rounded to x's dtype (vLLM adds in it) before the norm."""
    h = (x.double() + residual.double()).to(x.dtype)
    return ref_layer_norm(h, weight, bias, eps, one_plus=True), h.double()


def ref_fused_gated(x, g, weight, eps, sigmoid, residual=None):
    """(output, fp64 sum or None) of FusedRMSNormGated: rms(s) * w, then * g * sigmoid(g)
    (swish) or * sigmoid(g), with ``s = x + residual`` (no rounding of the sum)."""
    s = x.double() if residual is None else x.double() + residual.double()
    y = _normalised(s, eps)
    if weight is not None:
        y = y * weight.double()
    g = g.double()
    sig = 1 / (1 + torch.exp(-g))
    return y * (sig if sigmoid else g * sig), (None if residual is None else s)


def reference(case: NormCase, op, x: torch.Tensor, other: torch.Tensor | None = None,
              third: torch.Tensor | None = None):
    """(float64 output, float64 new residual or None) of ``case``'s op (built by ``case.build``)
    on ``x`` and the call's other tensors (residual or z; for FusedRMSNormGated g and the
    residual, whose pair is ``(y, residual_out)`` under ``prenorm`` and ``(y, None)`` without)."""
    if case.op == "layer_norm":
        return ref_layer_norm(x, op.weight, op.bias, op.eps), None
    if case.op == "nemotron_layer_norm":
        if case.residual:
            return ref_fused_add_nemotron(x, other, op.weight, op.bias, op.eps)
        return ref_layer_norm(x, op.weight, op.bias, op.eps, one_plus=True), None
    if case.op == "fused_rms_norm_gated":
        y, s = ref_fused_gated(x, other, op.weight, op.eps, op.activation == "sigmoid", third)
        if case.call_kwargs.get("prenorm"):
            if s is None:
                s = x.double().float().double() if case.call_kwargs.get("residual_in_fp32") else x.double()
            return y, s
        return y, None
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
