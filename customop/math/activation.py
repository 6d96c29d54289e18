"""The activations' math: the spec that each activation op's ``forward_native`` runs (vLLM's
native paths), in the input dtype. ``customop.ops.activation``
re-exports every function here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: ``silu(a) * b``."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def mul_and_silu(x: torch.Tensor) -> torch.Tensor:
    """``a * silu(b)``: the gate is the *second* half."""
    d = x.shape[-1] // 2
    return x[..., :d] * F.silu(x[..., d:])


def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GeGLU: ``gelu(a, approximate) * b`` with ``approximate`` in {"none", "tanh"}."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate=approximate) * x[..., d:]


def gelu_and_mul_sparse(x: torch.Tensor, std_multiplier: float, approximate: str = "none") -> torch.Tensor:
    """Gemma-3n: ``gelu(relu(a - (mean(a) + std(a) * s)), approximate) * b``, row statistics over
    the last dim (population std), ``s`` the normal quantile of the target sparsity."""
    d = x.shape[-1] // 2
    a = x[..., :d]
    cutoff = a.mean(dim=-1, keepdim=True) + a.std(dim=-1, keepdim=True, correction=0) * std_multiplier
    return F.gelu(F.relu(a - cutoff), approximate=approximate) * x[..., d:]


def fatrelu_and_mul(x: torch.Tensor, threshold: float = 0.0) -> torch.Tensor:
    """FATReLU: ``(a if a > threshold else 0) * b``."""
    d = x.shape[-1] // 2
    return F.threshold(x[..., :d], threshold, 0.0) * x[..., d:]


def swigluoai_and_mul(x: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """GPT-OSS SwiGLU on *interleaved* lanes ``g = x[..., 0::2]``, ``u = x[..., 1::2]``:
    ``g = min(g, limit)``, ``u = clamp(u, -limit, limit)``, result ``(u + 1) * g * sigmoid(alpha * g)``."""
    return _clamped_swiglu(x[..., ::2], x[..., 1::2], alpha, limit)


def _clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def swigluoai_on_halves(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """swigluoai_and_mul on an input already de-interleaved to ``[gates | ups]`` (the CPU path)."""
    d = x.shape[-1] // 2
    return _clamped_swiglu(x[..., :d], x[..., d:], alpha, limit)


def swiglustep_and_mul(x: torch.Tensor, limit: float = 7.0) -> torch.Tensor:
    """SwiGLU with the activation clamped after silu: ``min(silu(a), limit) * clamp(b, -limit, limit)``
    (halves, not interleaved; the clamp on the gate comes *after* silu, unlike swigluoai)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).clamp(max=limit) * up.clamp(min=-limit, max=limit)


def silu_and_mul_with_clamp(x: torch.Tensor, swiglu_limit: float, alpha: float = 1.0,
                            beta: float = 0.0) -> torch.Tensor:
    """SwiGLU with the inputs clamped *before* the activation (vLLM 0.33): ``g = min(a, L)``,
    ``u = clamp(b, -L, L)``, result ``g * sigmoid(alpha * g) * (u + beta)``, in the input dtype.
    Halves, not interleaved: with ``alpha=1.702, beta=1.0`` it is swigluoai's formula on halves."""
    d = x.shape[-1] // 2
    gate = torch.clamp(x[..., :d], max=swiglu_limit)
    up = torch.clamp(x[..., d:], min=-swiglu_limit, max=swiglu_limit)
    return gate * torch.sigmoid(alpha * gate) * (up + beta)


def situ_and_mul(x: torch.Tensor, beta: float = 1.0, linear_beta: float | None = None) -> torch.Tensor:
    """Kimi's SiTU GLU, in fp32 whatever the input dtype (as vLLM; fp64 inputs too), rounded once:
    ``beta * tanh(a / beta) * sigmoid(a)`` times ``b``, or times ``linear_beta * tanh(b / linear_beta)``
    when ``linear_beta`` is given."""
    d = x.shape[-1] // 2
    gate = x[..., :d].to(torch.float32)
    up = x[..., d:].to(torch.float32)
    gate = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    if linear_beta is not None:
        up = linear_beta * torch.tanh(up / linear_beta)
    return (gate * up).to(x.dtype)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """The erf GELU, elementwise: ``F.gelu(x)``."""
    return F.gelu(x, approximate="none")


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """The tanh GELU, elementwise: ``F.gelu(x, approximate="tanh")`` (torch's kernel; the same
    formula as gelu_new, rounded once instead of at every step)."""
    return F.gelu(x, approximate="tanh")


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's GELU: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""
    c = math.sqrt(2.0 / math.pi)
    return 0.5 * x * (1.0 + torch.tanh(c * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_fast(x: torch.Tensor) -> torch.Tensor:
    """``0.5 x (1 + tanh(0.7978845608 x (1 + 0.044715 x^2)))``: gelu_new with the constant inlined."""
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(1.702 x)``."""
    return x * torch.sigmoid(1.702 * x)


def relu2(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU: ``relu(x)^2``."""
    return torch.square(F.relu(x))


def xielu(x: torch.Tensor, alpha_p: torch.Tensor, alpha_n: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    """xIELU (arXiv 2411.13010): ``alpha_p x^2 + beta x`` for ``x > 0``, else
    ``alpha_n (expm1(min(x, eps)) - x) + beta x``. ``alpha_p``/``alpha_n`` are 1-element tensors
    (so no host sync), cast to ``x``'s dtype: the output is always in ``x``'s dtype."""
    alpha_p, alpha_n = alpha_p.to(x.dtype).reshape(()), alpha_n.to(x.dtype).reshape(())
    positive = alpha_p * x * x + beta * x
    negative = (torch.expm1(torch.clamp(x, max=eps)) - x) * alpha_n + beta * x
    return torch.where(x > 0, positive, negative)
