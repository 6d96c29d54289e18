"""The torch side of the TPU backend: ``torch.ops.customop_tpu.*`` over ``torch_xla``'s ``call_jax``.

Each op's body hands XLA tensors to the pure-JAX kernel with
``torch_xla.core.xla_builder.call_jax``, which lowers the JAX function into the lazy torch_xla
graph (a ``tpu_custom_call`` on a TPU, plain HLO loops in interpret mode), so tensors stay on
the XLA device. ``call_jax`` caches its lowering by the function's identity plus the shapes and
the non-tensor arguments, so the kernels passed here are module-level functions and every static
choice (eps, flags, the interpret mode) travels as a keyword argument.

Each op has a fake (shapes only), so ``torch.compile(backend="openxla", fullgraph=True)`` sees
one opaque node; the norms and the rotary embedding register a backward (``call_jax`` output
carries no autograd). The functions at the bottom are what the op classes' ``forward_tpu`` call.
They return new tensors (never in place; callers use the returned tensors anyway).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch_xla  # noqa: F401  (a missing torch_xla surfaces as "pip install customop[tpu]")
import torchax  # noqa: F401  (call_jax raises "Jax is required" without it)
from torch_xla.core import xla_builder

from customop.backends.tpu import activation, grads, norms, rotary, tiling
from customop.backends.tpu import quant_fp8 as fp8_kernels

Tensor = torch.Tensor
_NS = "customop_tpu"
#: The dtypes the kernels take for x (fp8 and fp64 inputs go native).
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _jax_plain(fn: Callable[..., Any], *args: Any, **statics: Any) -> Any:
    """``fn(*args, **statics)`` through ``call_jax``.

    torch_xla 2.9 keeps ONE output tree structure per cached function (``out_spec`` is set when
    a shape is first traced and reused for every later call), so a function whose output
    structure depends on which arguments are None (``rms_norm`` returns a pair with a residual)
    gets one cache entry per None-pattern through ``override_hash``."""
    variant = (fn.__module__, fn.__qualname__, tuple(a is None for a in args))
    return xla_builder.call_jax(fn, args, statics, override_hash=variant)


def _jax(fn: Callable[..., Any], *args: Any, **statics: Any) -> Any:
    """A Pallas kernel through ``call_jax``; the interpret mode is resolved here, per call."""
    return _jax_plain(fn, *args, **statics, interpret=tiling.use_interpret(torch_xla_device=True))


def _require_xla(op: str, **tensors: Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.device.type != "xla":
            raise ValueError(f"customop.backends.tpu.{op}: {name} is on {t.device}; the TPU backend takes XLA "
                             "tensors (torch_xla.device())")


# ---- norms ---------------------------------------------------------------------------------------


@torch.library.custom_op(f"{_NS}::rms_norm", mutates_args=())
def _rms_norm_op(x: Tensor, weight: Tensor | None, eps: float, variance_size: int | None, gemma: bool) -> Tensor:
    if gemma:
        return _jax(norms.gemma_rms_norm, x, weight, eps)
    return _jax(norms.rms_norm, x, weight, eps, variance_size=variance_size)


@torch.library.custom_op(f"{_NS}::fused_add_rms_norm", mutates_args=())
def _fused_add_rms_norm_op(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float,
                           variance_size: int | None, gemma: bool) -> tuple[Tensor, Tensor]:
    if gemma:
        return tuple(_jax(norms.gemma_rms_norm, x, weight, eps, residual))
    return tuple(_jax(norms.rms_norm, x, weight, eps, residual, variance_size=variance_size))


@torch.library.custom_op(f"{_NS}::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(grad_y: Tensor, grad_residual: Tensor | None, x: Tensor, residual: Tensor | None,
                          weight: Tensor | None, eps: float, variance_size: int | None,
                          gemma: bool) -> tuple[Tensor, Tensor]:
    return tuple(_jax_plain(grads.rms_norm_vjp, grad_y, grad_residual, x, residual, weight, eps=eps,
                            variance_size=variance_size, gemma=gemma))


@_rms_norm_op.register_fake
def _(x, weight, eps, variance_size, gemma):
    return torch.empty_like(x)


@_fused_add_rms_norm_op.register_fake
def _(x, residual, weight, eps, variance_size, gemma):
    return torch.empty_like(x), torch.empty_like(x)


@_rms_norm_backward_op.register_fake
def _(grad_y, grad_residual, x, residual, weight, eps, variance_size, gemma):
    return torch.empty_like(x), (x.new_empty(0) if weight is None else torch.empty_like(weight))


def _save_norm_inputs(ctx, inputs, output) -> None:
    x, weight, *statics = inputs
    ctx.save_for_backward(x, None, weight)
    ctx.statics = statics


def _save_fused_norm_inputs(ctx, inputs, output) -> None:
    x, residual, weight, *statics = inputs
    ctx.save_for_backward(x, residual, weight)
    ctx.statics = statics


def _rms_norm_grads(ctx, grad_y, grad_residual=None):
    x, residual, weight = ctx.saved_tensors
    grad_x, grad_w = _rms_norm_backward_op(grad_y, grad_residual, x, residual, weight, *ctx.statics)
    return grad_x, (None if weight is None else grad_w)


def _rms_norm_backward(ctx, grad_y):
    grad_x, grad_w = _rms_norm_grads(ctx, grad_y)
    return grad_x, grad_w, None, None, None


def _fused_add_rms_norm_backward(ctx, grad_y, grad_residual):
    grad_x, grad_w = _rms_norm_grads(ctx, grad_y, grad_residual)
    return grad_x, grad_x, grad_w, None, None, None  # h = x + residual: both get dL/dh


_rms_norm_op.register_autograd(_rms_norm_backward, setup_context=_save_norm_inputs)
_fused_add_rms_norm_op.register_autograd(_fused_add_rms_norm_backward, setup_context=_save_fused_norm_inputs)


@torch.library.custom_op(f"{_NS}::rms_norm_gated", mutates_args=())
def _rms_norm_gated_op(x: Tensor, weight: Tensor, z: Tensor | None, eps: float, group_size: int,
                       norm_before_gate: bool, sigmoid: bool) -> Tensor:
    return _jax(norms.rms_norm_gated, x, weight, z, eps, group_size=group_size,
                norm_before_gate=norm_before_gate, activation="sigmoid" if sigmoid else "silu")


@torch.library.custom_op(f"{_NS}::rms_norm_gated_backward", mutates_args=())
def _rms_norm_gated_backward_op(grad_y: Tensor, x: Tensor, weight: Tensor, z: Tensor | None, eps: float,
                                group_size: int, norm_before_gate: bool,
                                sigmoid: bool) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(_jax_plain(grads.rms_norm_gated_vjp, grad_y, x, weight, z, eps=eps, group_size=group_size,
                            norm_before_gate=norm_before_gate, sigmoid=sigmoid))


@_rms_norm_gated_op.register_fake
def _(x, weight, z, eps, group_size, norm_before_gate, sigmoid):
    return torch.empty_like(x)


@_rms_norm_gated_backward_op.register_fake
def _(grad_y, x, weight, z, eps, group_size, norm_before_gate, sigmoid):
    return torch.empty_like(x), torch.empty_like(weight), (x.new_empty(0) if z is None else torch.empty_like(z))


def _save_gated_inputs(ctx, inputs, output) -> None:
    x, weight, z, *statics = inputs
    ctx.save_for_backward(x, weight, z)
    ctx.statics = statics


def _rms_norm_gated_backward(ctx, grad_y):
    x, weight, z = ctx.saved_tensors
    grad_x, grad_w, grad_z = _rms_norm_gated_backward_op(grad_y, x, weight, z, *ctx.statics)
    return grad_x, grad_w, (None if z is None else grad_z), None, None, None, None


_rms_norm_gated_op.register_autograd(_rms_norm_gated_backward, setup_context=_save_gated_inputs)


# ---- rotary embedding ------------------------------------------------------------------------------


def _rotate_one(positions, x, cos_sin_cache, head_size, is_neox_style, inverse, interpret):
    """One tensor through the rotary kernel (``call_jax`` needs a module-level function)."""
    return rotary.rotary_embedding(positions, x, None, head_size, cos_sin_cache, is_neox_style,
                                   inverse=inverse, interpret=interpret)[0]


@torch.library.custom_op(f"{_NS}::rotary_embedding", mutates_args=())
def _rotary_op(positions: Tensor, x: Tensor, cos_sin_cache: Tensor, head_size: int, is_neox_style: bool,
               inverse: bool) -> Tensor:
    # JAX traces without x64, so an int64 argument would meet an s32 parameter in the lowered call.
    return _jax(_rotate_one, positions.to(torch.int32), x, cos_sin_cache, head_size, is_neox_style, inverse)


@_rotary_op.register_fake
def _(positions, x, cos_sin_cache, head_size, is_neox_style, inverse):
    return torch.empty_like(x)


def _save_rotary_inputs(ctx, inputs, output) -> None:
    positions, _, cos_sin_cache, *statics = inputs
    ctx.save_for_backward(positions, cos_sin_cache)
    ctx.statics = statics


def _rotary_backward(ctx, grad):
    # The rotation is orthogonal: its transpose rotates by the negative angle (same kernel).
    positions, cos_sin_cache = ctx.saved_tensors
    head_size, is_neox_style, inverse = ctx.statics
    return None, _rotary_op(positions, grad, cos_sin_cache, head_size, is_neox_style, not inverse), None, None, None, None


_rotary_op.register_autograd(_rotary_backward, setup_context=_save_rotary_inputs)


# ---- gated activations (no backward: forward_tpu uses XLA's fusion, see activation.py) -------------


@torch.library.custom_op(f"{_NS}::act_and_mul", mutates_args=())
def _act_and_mul_op(x: Tensor, activation_name: str, threshold: float, limit: float) -> Tensor:
    return _jax(activation.act_and_mul, x, activation_name, threshold=threshold, limit=limit)


@_act_and_mul_op.register_fake
def _(x, activation_name, threshold, limit):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


# ---- fp8 quant ---------------------------------------------------------------------------------------


@torch.library.custom_op(f"{_NS}::per_token_quant_fp8", mutates_args=())
def _per_token_quant_op(x: Tensor, scale_ub: Tensor | None, fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return tuple(_jax(fp8_kernels.per_token_quant_fp8, x, scale_ub, fp8_dtype=fp8_dtype))


@torch.library.custom_op(f"{_NS}::per_group_quant_fp8", mutates_args=())
def _per_group_quant_op(x: Tensor, group_size: int, use_ue8m0: bool, fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return tuple(_jax(fp8_kernels.per_group_quant_fp8, x, group_size, use_ue8m0=use_ue8m0, fp8_dtype=fp8_dtype))


@torch.library.custom_op(f"{_NS}::per_tensor_quant_fp8", mutates_args=())
def _per_tensor_quant_op(x: Tensor, fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    # Not the native path: torch_xla 2.9 returns x unreduced from ``x.amax()`` (dim=()).
    return tuple(_jax_plain(fp8_kernels.per_tensor_quant_fp8, x, fp8_dtype=fp8_dtype))


@_per_tensor_quant_op.register_fake
def _(x, fp8_dtype):
    return x.new_empty(x.shape, dtype=fp8_dtype), x.new_empty((1,), dtype=torch.float32)


@_per_token_quant_op.register_fake
def _(x, scale_ub, fp8_dtype):
    return x.new_empty(x.shape, dtype=fp8_dtype), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@_per_group_quant_op.register_fake
def _(x, group_size, use_ue8m0, fp8_dtype):
    groups = x.shape[-1] // group_size
    return x.new_empty(x.shape, dtype=fp8_dtype), x.new_empty((*x.shape[:-1], groups), dtype=torch.float32)


# ---- what forward_tpu calls -----------------------------------------------------------------------


def rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor | None, eps: float,
             variance_size: int | None = None):
    """RMSNorm.forward_tpu: ``rms_norm(x)``, or ``(rms_norm(x + residual), x + residual)``."""
    _require_xla("rms_norm", x=x, residual=residual, weight=weight)
    if residual is None:
        return _rms_norm_op(x, weight, eps, variance_size, False)
    return _fused_add_rms_norm_op(x, residual, weight, eps, variance_size, False)


def gemma_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float):
    """GemmaRMSNorm.forward_tpu (``1 + weight``, fp32), with the optional fused residual add."""
    _require_xla("gemma_rms_norm", x=x, residual=residual, weight=weight)
    if residual is None:
        return _rms_norm_op(x, weight, eps, None, True)
    return _fused_add_rms_norm_op(x, residual, weight, eps, None, True)


def rms_norm_gated(x: Tensor, weight: Tensor, z: Tensor | None, eps: float, group_size: int,
                   norm_before_gate: bool, sigmoid: bool) -> Tensor:
    """RMSNormGated.forward_tpu (the argument order of ``customop.ops.layernorm.rms_norm_gated``)."""
    _require_xla("rms_norm_gated", x=x, weight=weight, z=z)
    return _rms_norm_gated_op(x, weight, z, eps, group_size, norm_before_gate, sigmoid)


def rotary_embedding(positions: Tensor, query: Tensor, key: Tensor | None, head_size: int,
                     cos_sin_cache: Tensor, is_neox_style: bool) -> tuple[Tensor, Tensor | None]:
    """RotaryEmbedding.forward_tpu: new rotated ``(query, key)``; ``key`` may be None."""
    _require_xla("rotary_embedding", positions=positions, query=query, key=key, cos_sin_cache=cos_sin_cache)
    query = _rotary_op(positions, query, cos_sin_cache, head_size, is_neox_style, False)
    if key is not None:
        key = _rotary_op(positions, key, cos_sin_cache, head_size, is_neox_style, False)
    return query, key


def act_and_mul(x: Tensor, activation_name: str = "silu", threshold: float = 0.0, limit: float = 7.0) -> Tensor:
    """The Pallas ``*_and_mul`` kernel on XLA tensors (opt-in: the op classes use XLA's fusion)."""
    _require_xla("act_and_mul", x=x)
    return _act_and_mul_op(x, activation_name, float(threshold), float(limit))


def quant_fp8(x: Tensor, scale: Tensor | None, scale_ub: Tensor | None, *, static: bool,
              native: Callable[..., tuple[Tensor, Tensor]], group_shape, num_token_padding: int | None,
              column_major_scales: bool, tma_aligned_scales: bool, use_ue8m0: bool, fp8_dtype: torch.dtype,
              fp8_max: float, min_scale: float) -> tuple[Tensor, Tensor]:
    """QuantFP8.forward_tpu: dynamic per-token and per-group quant run the Pallas kernels,
    dynamic per-tensor a fused XLA function; the other modes (static scales, column-major
    scales, other dtypes) run ``native`` (``forward_native``, elementwise: XLA fuses it)."""
    per_group = group_shape.is_per_group()
    kernel = (not static and scale is None and x.dtype in KERNEL_DTYPES and x.dim() > 0
              and fp8_max == _kernel_fp8_max(fp8_dtype)
              and (scale_ub is None or group_shape.is_per_token())  # else native raises the error
              and (group_shape.is_per_token() or group_shape.is_per_tensor()
                   or (per_group and not column_major_scales and x.shape[-1] % group_shape.col == 0)))
    if not kernel:
        return native(x, scale, scale_ub)
    _require_xla("quant_fp8", x=x, scale_ub=scale_ub)
    if group_shape.is_per_tensor():
        q, scale = _per_tensor_quant_op(x, fp8_dtype)
    elif per_group:
        q, scale = _per_group_quant_op(x, group_shape.col, use_ue8m0, fp8_dtype)
    else:
        if scale_ub is not None and scale_ub.numel() != 1:
            raise ValueError(f"customop.backends.tpu.quant_fp8: scale_ub must have one element, got {tuple(scale_ub.shape)}")
        q, scale = _per_token_quant_op(x, scale_ub, fp8_dtype)
    if num_token_padding is not None and q.shape[0] < num_token_padding:
        q = torch.cat([q, q.new_zeros((num_token_padding - q.shape[0], *q.shape[1:]))])
    return q, scale


def _kernel_fp8_max(fp8_dtype: torch.dtype) -> float:
    """The clamp bound the kernels use (``quant_fp8.fp8_max``), from torch so Dynamo can fold it."""
    return 224.0 if fp8_dtype == torch.float8_e4m3fnuz else float(torch.finfo(fp8_dtype).max)
