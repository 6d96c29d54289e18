"""Kernel entry points of the norms family: ``torch.ops.customop.{rms_norm, fused_add_rms_norm,
gemma_rms_norm, gemma_fused_add_rms_norm, rms_norm_gated, layer_norm, nemotron_layer_norm,
fused_add_nemotron_layer_norm, fused_rms_norm_gated, fused_add_rms_norm_gated}`` and the backward
ops of the functional ones (``rms_norm_backward``, ``gemma_rms_norm_backward``,
``rms_norm_gated_backward``, ``layer_norm_backward``, ``nemotron_layer_norm_backward``;
``fused_rms_norm_gated`` reuses ``rms_norm_gated_backward``, its math being that op's with the
gate after the norm over whole rows).

The schemas are a contract with the backends (Triton, XPU, TPU) that register device kernels for
them; do not change them. ``x`` is ``[..., hidden]``; kernels may require a unit-stride last dim
(the op classes make it so). The bodies below are the reference, which runs on any device; the
in-place ops compute out of place and write back with ``copy_``. The fakes give shapes only.

Autograd is registered here, once, for every device: the functional norms' backward calls the
backward op, whose reference body is the vector-Jacobian product of the spec math
(``customop/math/layernorm.py``) in plain torch, and which a backend may fill with its own kernel
(the TPU backend registers its JAX vjps). The in-place ops get no autograd formula (torch refuses
one on a mutating op); the op classes run ``forward_native`` for them while autograd records.

The backward ops return one gradient per tensor input, in that input's dtype; a ``Tensor?``
input that is None gets an empty ``(0,)`` tensor of x's dtype in its place.
"""

from __future__ import annotations

import torch

from customop.math import layernorm as _math

Tensor = torch.Tensor

#: Written out rather than inferred so that the contract reads exactly as the backends see it
#: (inference would spell ``int`` as ``SymInt`` and the alias sets as ``a0!``/``a1!``).
SCHEMAS = {
    "rms_norm": "(Tensor x, Tensor? weight, float eps) -> Tensor",
    "fused_add_rms_norm": "(Tensor(a!) x, Tensor(b!) residual, Tensor? weight, float eps) -> ()",
    "gemma_rms_norm": "(Tensor x, Tensor weight, float eps) -> Tensor",
    "gemma_fused_add_rms_norm": "(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()",
    "rms_norm_gated": "(Tensor x, Tensor weight, Tensor? z, float eps, int group_size, "
                      "bool norm_before_gate, bool sigmoid) -> Tensor",
    # -> (grad_x, grad_weight)
    "rms_norm_backward": "(Tensor grad_y, Tensor x, Tensor? weight, float eps) -> (Tensor, Tensor)",
    "gemma_rms_norm_backward": "(Tensor grad_y, Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)",
    # -> (grad_x, grad_weight, grad_z)
    "rms_norm_gated_backward": "(Tensor grad_y, Tensor x, Tensor weight, Tensor? z, float eps, int group_size, "
                               "bool norm_before_gate, bool sigmoid) -> (Tensor, Tensor, Tensor)",
    "layer_norm": "(Tensor x, Tensor? weight, Tensor? bias, float eps) -> Tensor",
    "nemotron_layer_norm": "(Tensor x, Tensor weight, Tensor? bias, float eps) -> Tensor",
    "fused_add_nemotron_layer_norm": "(Tensor(a!) x, Tensor(b!) residual, Tensor weight, Tensor? bias, "
                                     "float eps) -> ()",
    "fused_rms_norm_gated": "(Tensor x, Tensor g, Tensor? weight, float eps, bool sigmoid) -> Tensor",
    # -> (y, residual_out): functional (vLLM's kernel returns a new residual_out too)
    "fused_add_rms_norm_gated": "(Tensor x, Tensor g, Tensor residual, Tensor? weight, float eps, "
                                "bool sigmoid) -> (Tensor, Tensor)",
    # -> (grad_x, grad_weight, grad_bias); absent parameters get (0,) tensors
    "layer_norm_backward": "(Tensor grad_y, Tensor x, Tensor? weight, Tensor? bias, float eps) "
                           "-> (Tensor, Tensor, Tensor)",
    "nemotron_layer_norm_backward": "(Tensor grad_y, Tensor x, Tensor weight, Tensor? bias, float eps) "
                                    "-> (Tensor, Tensor, Tensor)",
}


@torch.library.custom_op("customop::rms_norm", mutates_args=(), schema=SCHEMAS["rms_norm"])
def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """RMSNorm of each row of x; the weight multiply happens in the weight's dtype."""
    return _math.rms_norm(x, weight, eps)


@rms_norm.register_fake
def _(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("customop::fused_add_rms_norm", mutates_args=("x", "residual"),
                         schema=SCHEMAS["fused_add_rms_norm"])
def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float) -> None:
    """In place: ``residual <- x + residual`` (added in fp32, stored in x's dtype),
    ``x <- rms_norm(x + residual)``."""
    out, new_residual = _math.fused_add_rms_norm(x, residual, weight, eps)
    residual.copy_(new_residual)
    x.copy_(out)


@fused_add_rms_norm.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float) -> None:
    return None


@torch.library.custom_op("customop::gemma_rms_norm", mutates_args=(), schema=SCHEMAS["gemma_rms_norm"])
def gemma_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Gemma RMSNorm: ``rms(x) * (1 + w)`` in fp32, cast to x's dtype."""
    return _math.gemma_rms_norm(x, weight, eps)


@gemma_rms_norm.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("customop::gemma_fused_add_rms_norm", mutates_args=("x", "residual"),
                         schema=SCHEMAS["gemma_fused_add_rms_norm"])
def gemma_fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    """In place: ``residual <- x + residual`` (fp32 add, stored in x's dtype),
    ``x <- gemma_rms_norm(x + residual)``."""
    out, new_residual = _math.gemma_fused_add_rms_norm(x, residual, weight, eps)
    residual.copy_(new_residual)
    x.copy_(out)


@gemma_fused_add_rms_norm.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    return None


@torch.library.custom_op("customop::rms_norm_gated", mutates_args=(), schema=SCHEMAS["rms_norm_gated"])
def rms_norm_gated(x: Tensor, weight: Tensor, z: Tensor | None, eps: float, group_size: int,
                   norm_before_gate: bool, sigmoid: bool) -> Tensor:
    """Gated RMSNorm over chunks of ``group_size`` lanes, all in fp32 (see the math module)."""
    return _math.rms_norm_gated(x, weight, z, eps, group_size, norm_before_gate, sigmoid)


@rms_norm_gated.register_fake
def _(x: Tensor, weight: Tensor, z: Tensor | None, eps: float, group_size: int,
      norm_before_gate: bool, sigmoid: bool) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("customop::layer_norm", mutates_args=(), schema=SCHEMAS["layer_norm"])
def layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
    """vLLM's LayerNorm over the last dim, computed in ``promote(x, w)``, returned in x's dtype."""
    return _math.layer_norm(x, weight, bias, eps)


@layer_norm.register_fake
def _(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("customop::nemotron_layer_norm", mutates_args=(), schema=SCHEMAS["nemotron_layer_norm"])
def nemotron_layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    """Nemotron's LayerNorm1P: the weight applied as ``1 + w`` (formed in w's dtype)."""
    return _math.nemotron_layer_norm(x, weight, bias, eps)


@nemotron_layer_norm.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("customop::fused_add_nemotron_layer_norm", mutates_args=("x", "residual"),
                         schema=SCHEMAS["fused_add_nemotron_layer_norm"])
def fused_add_nemotron_layer_norm(x: Tensor, residual: Tensor, weight: Tensor, bias: Tensor | None,
                                  eps: float) -> None:
    """In place: ``residual <- x + residual`` (added in x's dtype),
    ``x <- nemotron_layer_norm(x + residual)``."""
    out, new_residual = _math.fused_add_nemotron_layer_norm(x, residual, weight, bias, eps)
    residual.copy_(new_residual)
    x.copy_(out)


@fused_add_nemotron_layer_norm.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> None:
    return None


@torch.library.custom_op("customop::fused_rms_norm_gated", mutates_args=(), schema=SCHEMAS["fused_rms_norm_gated"])
def fused_rms_norm_gated(x: Tensor, g: Tensor, weight: Tensor | None, eps: float, sigmoid: bool) -> Tensor:
    """``rms(x) * w * act(g)`` in fp32, returned in x's dtype (see the math module)."""
    return _math.fused_rms_norm_gated(x, g, weight, eps, sigmoid)


@fused_rms_norm_gated.register_fake
def _(x: Tensor, g: Tensor, weight: Tensor | None, eps: float, sigmoid: bool) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("customop::fused_add_rms_norm_gated", mutates_args=(),
                         schema=SCHEMAS["fused_add_rms_norm_gated"])
def fused_add_rms_norm_gated(x: Tensor, g: Tensor, residual: Tensor, weight: Tensor | None, eps: float,
                             sigmoid: bool) -> tuple[Tensor, Tensor]:
    """``s = fp32(x) + fp32(residual)``; ``(fused_rms_norm_gated(s) in x's dtype, s in residual's dtype)``."""
    return _math.fused_add_rms_norm_gated(x, g, residual, weight, eps, sigmoid)


@fused_add_rms_norm_gated.register_fake
def _(x: Tensor, g: Tensor, residual: Tensor, weight: Tensor | None, eps: float,
      sigmoid: bool) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(residual)


# ---- backward: the vector-Jacobian products of the spec ----------------------------------------
#
# Written out rather than taken from torch.autograd: an op's body runs below the Autograd dispatch
# keys, where nothing records. Each is the exact derivative of the function in
# customop/math/layernorm.py, in fp32 (fp64 for fp64 inputs); the casts of the forward pass the
# gradient through unchanged. tests/backends/tpu/test_norm_autograd.py checks them against
# finite differences (gradcheck) and against torch.autograd of the spec math.


def _compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _sum_rows(t: Tensor) -> Tensor:
    """Sums over every leading dim: ``[..., H] -> [H]`` (a weight's gradient)."""
    return t.reshape(-1, t.shape[-1]).sum(0)


def _rms_vjp(g: Tensor, n: Tensor, r: Tensor) -> Tensor:
    """dL/dh of ``n = h * r``, ``r = rsqrt(mean(h^2) + eps)`` over the last dim, given ``g = dL/dn``:
    ``r * (g - n * mean(g * n))``."""
    return r * (g - n * (g * n).mean(dim=-1, keepdim=True))


def rms_norm_vjp(grad_y: Tensor, x: Tensor, weight: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    """``(grad_x, grad_weight)`` of ``_math.rms_norm(x, weight, eps)``; grad_weight is ``(0,)``
    without a weight."""
    ct = _compute_dtype(x, weight)
    xf = x.to(ct)
    r = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    n = xf * r
    g = grad_y.to(ct)
    if weight is None:
        return _rms_vjp(g, n, r).to(x.dtype), x.new_empty(0)
    # y = n.to(w.dtype) * w: dy/dw is n rounded to the weight dtype, as the forward multiplies it.
    grad_w = _sum_rows(g * n.to(weight.dtype).to(ct)).to(weight.dtype)
    return _rms_vjp(g * weight.to(ct), n, r).to(x.dtype), grad_w


def gemma_rms_norm_vjp(grad_y: Tensor, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(grad_x, grad_weight)`` of ``_math.gemma_rms_norm(x, weight, eps)`` (``y = n * (1 + w)``)."""
    ct = _compute_dtype(x, weight)
    xf = x.to(ct)
    r = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    n = xf * r
    g = grad_y.to(ct)
    grad_w = _sum_rows(g * n).to(weight.dtype)
    return _rms_vjp(g * (1.0 + weight.to(ct)), n, r).to(x.dtype), grad_w


def rms_norm_gated_vjp(grad_y: Tensor, x: Tensor, weight: Tensor, z: Tensor | None, eps: float, group_size: int,
                       norm_before_gate: bool, sigmoid: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(grad_x, grad_weight, grad_z)`` of ``_math.rms_norm_gated``; grad_z is ``(0,)`` without z."""
    ct = _compute_dtype(x, weight, z)
    xf, w, g = x.to(ct), weight.to(ct), grad_y.to(ct)
    gate = s = zf = None
    if z is not None:
        zf = z.to(ct)
        s = torch.sigmoid(zf)
        gate = s if sigmoid else zf * s
    u = xf * gate if gate is not None and not norm_before_gate else xf
    groups = u.unflatten(-1, (-1, group_size))
    r = torch.rsqrt(groups.pow(2).mean(dim=-1, keepdim=True) + eps)
    n = groups * r
    flat_n = n.flatten(-2)
    grad_gate = None
    if gate is not None and norm_before_gate:  # y = n * w * gate
        grad_gate = g * flat_n * w
        g = g * gate
    grad_w = _sum_rows(g * flat_n).to(weight.dtype)
    grad_u = _rms_vjp((g * w).unflatten(-1, (-1, group_size)), n, r).flatten(-2)
    if gate is not None and not norm_before_gate:  # u = x * gate
        grad_gate = grad_u * xf
        grad_u = grad_u * gate
    if z is None:
        return grad_u.to(x.dtype), grad_w, x.new_empty(0)
    # d gate / dz: sigmoid' = s (1 - s); silu' = s (1 + z (1 - s))
    d_gate = s * (1.0 - s) if sigmoid else s * (1.0 + zf * (1.0 - s))
    return grad_u.to(x.dtype), grad_w, (grad_gate * d_gate).to(z.dtype)


def layer_norm_vjp(grad_y: Tensor, x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                   one_plus: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """``(grad_x, grad_weight, grad_bias)`` of ``_math.layer_norm`` (``one_plus``: of
    ``_math.nemotron_layer_norm``, whose weight enters as ``1 + w``; the rounding of ``1 + w`` to
    w's dtype passes the gradient through). Absent parameters get ``(0,)`` tensors."""
    ct = _compute_dtype(x, weight, bias)
    xf, g = x.to(ct), grad_y.to(ct)
    mean = xf.mean(dim=-1, keepdim=True)
    centred = xf - mean
    r = torch.rsqrt(centred.pow(2).mean(dim=-1, keepdim=True) + eps)
    n = centred * r
    grad_b = x.new_empty(0) if bias is None else _sum_rows(g).to(bias.dtype)
    if weight is None:
        grad_w = x.new_empty(0)
    else:
        grad_w = _sum_rows(g * n).to(weight.dtype)
        w = (weight + 1).to(ct) if one_plus else weight.to(ct)
        g = g * w
    # d n / d x: r * (g - mean(g) - n * mean(g * n))
    grad_x = r * (g - g.mean(dim=-1, keepdim=True) - n * (g * n).mean(dim=-1, keepdim=True))
    return grad_x.to(x.dtype), grad_w, grad_b


@torch.library.custom_op("customop::rms_norm_backward", mutates_args=(), schema=SCHEMAS["rms_norm_backward"])
def rms_norm_backward(grad_y: Tensor, x: Tensor, weight: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    """The gradients of ``customop::rms_norm`` w.r.t. x and weight."""
    return rms_norm_vjp(grad_y, x, weight, eps)


@rms_norm_backward.register_fake
def _(grad_y: Tensor, x: Tensor, weight: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), (x.new_empty(0) if weight is None else torch.empty_like(weight))


@torch.library.custom_op("customop::gemma_rms_norm_backward", mutates_args=(),
                         schema=SCHEMAS["gemma_rms_norm_backward"])
def gemma_rms_norm_backward(grad_y: Tensor, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The gradients of ``customop::gemma_rms_norm`` w.r.t. x and weight."""
    return gemma_rms_norm_vjp(grad_y, x, weight, eps)


@gemma_rms_norm_backward.register_fake
def _(grad_y: Tensor, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(weight)


@torch.library.custom_op("customop::rms_norm_gated_backward", mutates_args=(),
                         schema=SCHEMAS["rms_norm_gated_backward"])
def rms_norm_gated_backward(grad_y: Tensor, x: Tensor, weight: Tensor, z: Tensor | None, eps: float,
                            group_size: int, norm_before_gate: bool, sigmoid: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of ``customop::rms_norm_gated`` w.r.t. x, weight and z."""
    return rms_norm_gated_vjp(grad_y, x, weight, z, eps, group_size, norm_before_gate, sigmoid)


@rms_norm_gated_backward.register_fake
def _(grad_y: Tensor, x: Tensor, weight: Tensor, z: Tensor | None, eps: float, group_size: int,
      norm_before_gate: bool, sigmoid: bool) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(weight), (x.new_empty(0) if z is None else torch.empty_like(z))


def _layer_norm_backward_fake(grad_y: Tensor, x: Tensor, weight: Tensor | None, bias: Tensor | None,
                              eps: float) -> tuple[Tensor, Tensor, Tensor]:
    return (torch.empty_like(x), x.new_empty(0) if weight is None else torch.empty_like(weight),
            x.new_empty(0) if bias is None else torch.empty_like(bias))


@torch.library.custom_op("customop::layer_norm_backward", mutates_args=(), schema=SCHEMAS["layer_norm_backward"])
def layer_norm_backward(grad_y: Tensor, x: Tensor, weight: Tensor | None, bias: Tensor | None,
                        eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of ``customop::layer_norm`` w.r.t. x, weight and bias."""
    return layer_norm_vjp(grad_y, x, weight, bias, eps)


@torch.library.custom_op("customop::nemotron_layer_norm_backward", mutates_args=(),
                         schema=SCHEMAS["nemotron_layer_norm_backward"])
def nemotron_layer_norm_backward(grad_y: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None,
                                 eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of ``customop::nemotron_layer_norm`` w.r.t. x, weight and bias."""
    return layer_norm_vjp(grad_y, x, weight, bias, eps, one_plus=True)


layer_norm_backward.register_fake(_layer_norm_backward_fake)
nemotron_layer_norm_backward.register_fake(_layer_norm_backward_fake)


# ---- autograd of the functional ops --------------------------------------------------------------


def _save_tensors_and_statics(ctx, inputs, output) -> None:
    """Saves the tensor inputs (None included) and keeps the rest as they are."""
    ctx.save_for_backward(*(a for a in inputs if a is None or isinstance(a, Tensor)))
    ctx.statics = tuple(a for a in inputs if a is not None and not isinstance(a, Tensor))


def _rms_norm_grads(ctx, grad_y):
    x, weight = ctx.saved_tensors
    grad_x, grad_w = torch.ops.customop.rms_norm_backward(grad_y, x, weight, *ctx.statics)
    return grad_x, (None if weight is None else grad_w), None


def _gemma_rms_norm_grads(ctx, grad_y):
    x, weight = ctx.saved_tensors
    grad_x, grad_w = torch.ops.customop.gemma_rms_norm_backward(grad_y, x, weight, *ctx.statics)
    return grad_x, grad_w, None


def _rms_norm_gated_grads(ctx, grad_y):
    x, weight, z = ctx.saved_tensors
    grad_x, grad_w, grad_z = torch.ops.customop.rms_norm_gated_backward(grad_y, x, weight, z, *ctx.statics)
    return grad_x, grad_w, (None if z is None else grad_z), None, None, None, None


rms_norm.register_autograd(_rms_norm_grads, setup_context=_save_tensors_and_statics)
gemma_rms_norm.register_autograd(_gemma_rms_norm_grads, setup_context=_save_tensors_and_statics)
rms_norm_gated.register_autograd(_rms_norm_gated_grads, setup_context=_save_tensors_and_statics)


def _layer_norm_grads(backward_op):
    def grads(ctx, grad_y):
        x, weight, bias = ctx.saved_tensors
        grad_x, grad_w, grad_b = backward_op(grad_y, x, weight, bias, *ctx.statics)
        return grad_x, (None if weight is None else grad_w), (None if bias is None else grad_b), None

    return grads


def _fused_rms_norm_gated_grads(ctx, grad_y):
    """Through ``rms_norm_gated_backward`` (norm before the gate, one group per row); a missing
    weight is a ones vector there, whose gradient is dropped."""
    x, g, weight = ctx.saved_tensors
    eps, sigmoid = ctx.statics
    w = weight if weight is not None else x.new_ones(x.shape[-1], dtype=torch.float32)
    grad_x, grad_w, grad_g = torch.ops.customop.rms_norm_gated_backward(grad_y, x, w, g, eps, x.shape[-1], True,
                                                                        sigmoid)
    return grad_x, grad_g, (None if weight is None else grad_w), None, None


layer_norm.register_autograd(_layer_norm_grads(torch.ops.customop.layer_norm_backward),
                             setup_context=_save_tensors_and_statics)
nemotron_layer_norm.register_autograd(_layer_norm_grads(torch.ops.customop.nemotron_layer_norm_backward),
                                      setup_context=_save_tensors_and_statics)
fused_rms_norm_gated.register_autograd(_fused_rms_norm_gated_grads, setup_context=_save_tensors_and_statics)
