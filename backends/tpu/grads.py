"""Backward passes of the norms, in pure JAX.

``pallas_call`` is not differentiable (``jax.grad`` of a kernel fails with "Linearization failed
to produce known values"), so the gradients are separate functions: each is the ``jax.vjp`` of
the forward spec written with ``jnp`` (fp32 math, the same casts as the forward), which XLA
fuses. The torch side registers them as the ``xla`` kernels of ``customop::rms_norm_backward``,
``gemma_rms_norm_backward`` and ``rms_norm_gated_backward`` (``xla_kernels.py``). The backward of
the rotary embedding needs no function here: it is the forward kernel rotating by the negative
angle (``rotary_embedding(..., inverse=True)``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


def _rms_norm_math(h, weight, *, eps: float, variance_size: int | None, gemma: bool, out_dtype):
    """The forward spec on fp32 ``h``: normalise, then Llama or Gemma (``1 + w``) weighting,
    returned in ``out_dtype``. The Llama multiply happens in fp32 on ``y`` rounded to the weight
    dtype (the spec's value up to the product's rounding): the weight's gradient then sums its
    rows in fp32, not in the weight dtype, and the rounding passes the gradient through."""
    h_var = h if variance_size is None else h[..., :variance_size]
    y = h * lax.rsqrt(jnp.mean(h_var * h_var, axis=-1, keepdims=True) + eps)
    if weight is None:
        return y.astype(out_dtype)
    if gemma:
        return (y * (1.0 + weight.astype(jnp.float32))).astype(out_dtype)
    y_rounded = y + lax.stop_gradient(y.astype(weight.dtype).astype(jnp.float32) - y)
    return (y_rounded * weight.astype(jnp.float32)).astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("eps", "variance_size", "gemma"))
def rms_norm_vjp(grad_y, grad_residual, x, residual, weight, *, eps: float, variance_size: int | None = None,
                 gemma: bool = False):
    """Gradients of ``rms_norm`` / ``gemma_rms_norm`` (optionally with the fused residual add).

    ``grad_residual`` is the cotangent of the returned residual ``h`` (None without the add).
    Returns ``(grad_x, grad_weight)``: ``grad_x`` in ``x.dtype`` is also the residual's gradient
    (``h = x + residual``); ``grad_weight`` is a ``(0,)`` array when ``weight`` is None.
    """
    has_weight = weight is not None

    def forward(x, residual, weight):
        h = x.astype(jnp.float32)
        if residual is not None:
            h = h + residual.astype(jnp.float32)
        return _rms_norm_math(h, weight if has_weight else None, eps=eps, variance_size=variance_size,
                              gemma=gemma, out_dtype=x.dtype), h.astype(x.dtype)

    weight_in = weight if has_weight else jnp.zeros((0,), x.dtype)
    _, vjp = jax.vjp(forward, x, residual, weight_in)
    grad_h = jnp.zeros_like(x) if grad_residual is None else grad_residual.astype(x.dtype)
    grad_x, _, grad_w = vjp((grad_y.astype(x.dtype), grad_h))
    return grad_x, grad_w


def _rms_norm_gated_math(x, weight, z, *, eps: float, group_size: int, norm_before_gate: bool, sigmoid: bool):
    xf = x.astype(jnp.float32)
    gate = None
    if z is not None:
        zf = z.astype(jnp.float32)
        gate = jax.nn.sigmoid(zf) if sigmoid else zf * jax.nn.sigmoid(zf)
        if not norm_before_gate:
            xf = xf * gate
    groups = xf.reshape(*xf.shape[:-1], -1, group_size)
    y = groups * lax.rsqrt(jnp.mean(groups * groups, axis=-1, keepdims=True) + eps)
    y = y.reshape(xf.shape) * weight.astype(jnp.float32)
    if gate is not None and norm_before_gate:
        y = y * gate
    return y.astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "group_size", "norm_before_gate", "sigmoid"))
def rms_norm_gated_vjp(grad_y, x, weight, z, *, eps: float, group_size: int, norm_before_gate: bool,
                       sigmoid: bool):
    """Gradients of ``rms_norm_gated``: ``(grad_x, grad_weight, grad_z)``; ``grad_z`` is a
    ``(0,)`` array when ``z`` is None."""
    math = functools.partial(_rms_norm_gated_math, eps=eps, group_size=group_size,
                             norm_before_gate=norm_before_gate, sigmoid=sigmoid)
    if z is None:
        _, vjp = jax.vjp(lambda x, w: math(x, w, None), x, weight)
        grad_x, grad_w = vjp(grad_y.astype(x.dtype))
        return grad_x, grad_w, jnp.zeros((0,), x.dtype)
    _, vjp = jax.vjp(math, x, weight, z)
    return vjp(grad_y.astype(x.dtype))
