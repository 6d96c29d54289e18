"""Float64 references of the activation table (``customop/samples/activation.py``), written from
the formulas, not from ``customop.math``; every tier judges its path with them.

``reference(case, x, op)`` takes ``x`` already in the reference dtype (float64; the GPU tier
uses float32 above 2**27 elements) and the built op, whose constructor-level attributes
(``approximate``, ``activation_sparsity``, ``threshold``, ``alpha``, ``limit``, ``swiglu_limit``,
``beta``, ``linear_beta``, xIELU's parameters)
it reads; the std multiplier and the softplus of xIELU are computed here, not taken from the op.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

import torch

from customop.samples.activation import ActivationCase
from customop.testing import assert_close, tolerance


def _halves(x):
    d = x.shape[-1] // 2
    return x[..., :d], x[..., d:]


def _silu(v):
    return v / (1.0 + torch.exp(-v))


def _gelu(v, approximate):
    if approximate == "tanh":
        return 0.5 * v * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v**3)))
    return 0.5 * v * (1.0 + torch.erf(v / math.sqrt(2.0)))


def ref_gelu_and_mul_sparse(x, std_multiplier, approximate):
    a, b = _halves(x)
    mean = a.sum(-1, keepdim=True) / a.shape[-1]
    std = ((a - mean) ** 2).sum(-1, keepdim=True).div(a.shape[-1]).sqrt()
    return _gelu((a - (mean + std * std_multiplier)).clamp(min=0), approximate) * b


def ref_swigluoai_and_mul(x, alpha, limit):
    g, u = x[..., 0::2].clamp(max=limit), x[..., 1::2].clamp(-limit, limit)
    return (u + 1) * g / (1.0 + torch.exp(-alpha * g))


def ref_silu_and_mul_with_clamp(x, limit, alpha, beta):
    a, b = _halves(x)
    g = a.clamp(max=limit)
    return g / (1.0 + torch.exp(-alpha * g)) * (b.clamp(-limit, limit) + beta)


def ref_situ_and_mul(x, beta, linear_beta):
    a, b = _halves(x)
    up = b if linear_beta is None else linear_beta * torch.tanh(b / linear_beta)
    return beta * torch.tanh(a / beta) / (1.0 + torch.exp(-a)) * up


def ref_gelu_fast(x):
    return 0.5 * x * (1 + torch.tanh(0.7978845608 * x * (1 + 0.044715 * x * x)))


def ref_xielu(x, op):
    """xIELU with the module's parameters: softplus and ``beta + softplus`` are rounded to the
    parameter dtype, as the spec computes them there."""
    pdt = op.alpha_p.dtype
    softplus = lambda p: torch.log1p(torch.exp(p.detach().double())).to(pdt)  # noqa: E731
    ap = softplus(op.alpha_p).to(x.dtype)
    an = (op.beta.double() + softplus(op.alpha_n).double()).to(pdt).to(x.dtype)
    beta, eps = float(op.beta), float(op.eps)
    return torch.where(x > 0, ap * x * x + beta * x, an * (torch.expm1(x.clamp(max=eps)) - x) + beta * x)


#: op name -> (x, op) -> the exact result
REFERENCES: dict[str, Callable] = {
    "silu_and_mul": lambda x, op: _silu(_halves(x)[0]) * _halves(x)[1],
    "mul_and_silu": lambda x, op: _halves(x)[0] * _silu(_halves(x)[1]),
    "gelu_and_mul": lambda x, op: _gelu(_halves(x)[0], op.approximate) * _halves(x)[1],
    "gelu_and_mul_sparse": lambda x, op: ref_gelu_and_mul_sparse(
        x, statistics.NormalDist().inv_cdf(op.activation_sparsity), op.approximate),
    "fatrelu_and_mul": lambda x, op: torch.where(_halves(x)[0] > op.threshold, _halves(x)[0], 0.0) * _halves(x)[1],
    "swigluoai_and_mul": lambda x, op: ref_swigluoai_and_mul(x, op.alpha, op.limit),
    "swiglustep_and_mul": lambda x, op: _silu(_halves(x)[0]).clamp(max=op.limit) * _halves(x)[1].clamp(-op.limit, op.limit),
    "silu_and_mul_with_clamp": lambda x, op: ref_silu_and_mul_with_clamp(x, op.swiglu_limit, op.alpha, op.beta),
    "situ_and_mul": lambda x, op: ref_situ_and_mul(x, op.beta, op.linear_beta),
    "gelu": lambda x, op: _gelu(x, "none"),
    "gelu_tanh": lambda x, op: _gelu(x, "tanh"),
    "gelu_new": lambda x, op: _gelu(x, "tanh"),
    "gelu_fast": lambda x, op: ref_gelu_fast(x),
    "quick_gelu": lambda x, op: x / (1.0 + torch.exp(-1.702 * x)),
    "relu2": lambda x, op: x.clamp(min=0) ** 2,
    "xielu": ref_xielu,
}

#: Extra absolute tolerance for the spec's own roundings, on the paths that run the spec's math
#: (native, CPU): k * eps(dtype) * max|x|**power, as (k, power). The kernels compute in fp32 and
#: round once: none there. gelu_and_mul_sparse: the row mean, std and cutoff are rounded in the
#: input dtype, so the cutoff is off by a few ulps of |a|, which moves outputs by up to that much
#: times |b|. xielu: for x < 0, alpha_n (expm1(x) - x) and beta x cancel, each rounded to an ulp
#: of ~|x|.
SPEC_SLACK: dict[str, tuple[float, int]] = {"gelu_and_mul_sparse": (1, 2), "xielu": (1, 1)}


def reference(case: ActivationCase, x: torch.Tensor, op) -> torch.Tensor:
    return REFERENCES[case.op](x, op)


def spec_slack(case: ActivationCase, x: torch.Tensor) -> float:
    k, power = SPEC_SLACK.get(case.op, (0.0, 1))
    return k * torch.finfo(x.dtype).eps * float(x.abs().max()) ** power if k else 0.0


def assert_matches(case: ActivationCase, op, x: torch.Tensor, out: torch.Tensor, spec_rounding: bool = False,
                   expected: torch.Tensor | None = None) -> None:
    """``out`` (the op run on ``x``) against the float64 reference under x's dtype tolerance, plus
    ``SPEC_SLACK`` where the path runs the spec's math."""
    if expected is None:
        expected = reference(case, x.double(), op)
    atol, rtol = tolerance(x.dtype)
    if spec_rounding:
        atol += spec_slack(case, x)
    assert out.dtype == x.dtype, f"{case.label}: output dtype {out.dtype}, input {x.dtype}"
    assert_close(out, expected, x.dtype, atol=atol, rtol=rtol, what=f"{case.label} {tuple(x.shape)}")
