"""Float64 references of the activation and norm kernels, written independently of the library's
math (customop/ops/*), shared by the interpreter tests and the GPU tests (tests/gpu)."""

from __future__ import annotations

import math

import torch

# ---- activations -----------------------------------------------------------------------


def _halves(x):
    d = x.shape[-1] // 2
    return x[..., :d], x[..., d:]


def _gelu(v, approximate):
    if approximate == "tanh":
        return 0.5 * v * (1 + torch.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3)))
    return 0.5 * v * (1 + torch.erf(v / math.sqrt(2)))


def ref_silu_and_mul(x):
    a, b = _halves(x)
    return a / (1 + torch.exp(-a)) * b


def ref_mul_and_silu(x):
    a, b = _halves(x)
    return a * (b / (1 + torch.exp(-b)))


def ref_gelu_and_mul(x, approximate):
    a, b = _halves(x)
    return _gelu(a, approximate) * b


def ref_gelu_and_mul_sparse(x, s, approximate):
    a, b = _halves(x)
    mean = a.mean(-1, keepdim=True)
    std = ((a - mean) ** 2).mean(-1, keepdim=True).sqrt()
    return _gelu((a - (mean + std * s)).clamp_min(0), approximate) * b


def ref_fatrelu_and_mul(x, threshold):
    a, b = _halves(x)
    return torch.where(a > threshold, a, torch.zeros_like(a)) * b


def ref_swigluoai_and_mul(x, alpha, limit):
    g, u = x[..., 0::2].clamp(max=limit), x[..., 1::2].clamp(-limit, limit)
    return (u + 1) * g / (1 + torch.exp(-alpha * g))


def ref_gelu_new(x):
    return _gelu(x, "tanh")


def ref_gelu_fast(x):
    return 0.5 * x * (1 + torch.tanh(0.7978845608 * x * (1 + 0.044715 * x * x)))


def ref_quick_gelu(x):
    return x / (1 + torch.exp(-1.702 * x))


def ref_relu2(x):
    return x.clamp_min(0) ** 2


def ref_xielu(x, alpha_p, alpha_n, beta, eps):
    # the spec rounds the 1-element alphas to x's dtype first (alphas here are given in x's dtype)
    ap, an = float(alpha_p), float(alpha_n)
    return torch.where(x > 0, ap * x * x + beta * x, (torch.expm1(x.clamp(max=eps)) - x) * an + beta * x)



# ---- norms (the spec's rounding points, exact arithmetic elsewhere) --------------


def _normalised(h, eps):
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def ref_rms_norm(x, weight, eps):
    y = _normalised(x.double(), eps)
    if weight is not None:  # the spec rounds to the weight's dtype, then multiplies in it
        y = y.to(weight.dtype).double() * weight.double()
    return y


def ref_gemma(x, weight, eps):
    return _normalised(x.double(), eps) * (1 + weight.double())


def ref_fused_add(x, residual, weight, eps, gemma=False):
    h = x.double() + residual.double()
    return (ref_gemma(h, weight, eps) if gemma else ref_rms_norm(h, weight, eps)), h


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
