"""The TPU backend's torch side: the ``xla`` kernels of the ``torch.ops.customop`` ops.

The ops, their schemas, reference bodies, fakes and autograd are defined once, for every device,
in ``customop/ops/_library/``; this module fills some of them for XLA tensors
(``torch.library.register_kernel(op, "xla", kernel)``), as ``backends/triton`` does for "cuda".
Each kernel takes exactly its op's schema arguments and hands the XLA tensors to a JAX function
with ``torch_xla.core.xla_builder.call_jax``, which lowers it into the lazy torch_xla graph (a
``tpu_custom_call`` on a TPU; plain HLO loops in Pallas interpret mode elsewhere), so tensors
stay on the XLA device and ``torch.compile(backend="openxla")`` sees one node per op.

What runs what (docs/tpu.md has the table):

- Pallas kernels: ``rms_norm``, ``fused_add_rms_norm``, ``gemma_rms_norm``,
  ``gemma_fused_add_rms_norm``, ``rms_norm_gated``, ``layer_norm``, ``nemotron_layer_norm``,
  ``fused_add_nemotron_layer_norm``, ``fused_rms_norm_gated``, ``fused_add_rms_norm_gated``,
  ``rotary_embedding``,
  ``dynamic_per_token_scaled_fp8_quant``, ``per_token_group_fp8_quant``;
- a fused JAX function (no Pallas): ``dynamic_scaled_fp8_quant`` (the reference's whole-tensor
  amax, written ``.amax()``, came back unreduced from torch_xla 2.9) and the three norm backward
  ops (``grads.py``: ``jax.vjp`` of the spec);
- the op's reference math, functionalized (``_spec``), which XLA fuses: the gated activations
  (``silu_and_mul``, ``mul_and_silu``, ``gelu_and_mul``, ``gelu_and_mul_sparse``,
  ``fatrelu_and_mul``, ``swigluoai_and_mul``, ``swiglustep_and_mul``, ``silu_and_mul_with_clamp``,
  ``situ_and_mul``). Their default body would run too, but it slices
  ``x`` at an offset, which torch_xla lowers to a gather when it runs inside an op (see ``_spec``);
- no ``xla`` kernel, the reference body runs on the XLA device and XLA fuses it:
  ``static_scaled_fp8_quant``, ``rms_norm_dynamic_per_token_fp8_quant``, the elementwise
  activations (``gelu``, ``gelu_tanh``, ``gelu_new``, ``gelu_fast``, ``quick_gelu``, ``relu2``, ``xielu``).

Per-argument exceptions, inside the kernels: inputs whose dtype the kernels do not take (only
fp32, bf16 and fp16 do; fp64 does not) run the op's reference math (``customop/math``, through
``_spec``) on the XLA device. Every other argument value the schemas allow runs the kernel
(any ``fp8_max`` and ``min_scale``, column-major and ue8m0 scales, ``scale_ub``).

In-place ops: torch's eager functionalization (which torch_xla uses for every XLA tensor)
refuses custom ops that mutate their arguments. ``_functionalize_on_xla`` therefore gives each
in-place op a kernel for the ``AutogradXLA`` key that does for eager XLA tensors what
``torch.compile``'s functionalization (``auto_functionalized``) does for traced ones: unwrap, run
the op on fresh copies below functionalization (the ``xla`` kernel: ``x.copy_(y)`` is a graph
rebinding there), and write the copies back into the caller's tensors. Traced tensors (fake or
functional tensor subclasses) take the ordinary route, unchanged.

``call_jax`` caches its lowering by the function's identity plus the shapes and the non-tensor
arguments, so the JAX functions passed here are module-level and every static choice (eps,
flags, dtypes, the interpret mode) travels as an argument. This module imports torch and jax
only; ``torch_xla`` and ``torchax`` are imported on the first kernel call (``_call_jax``), where a
missing one raises an error naming ``pip install customop[tpu]``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from customop.backends.tpu import grads, layernorm, quant, rotary, tiling
from customop.math import activation as act_math
from customop.math import layernorm as norm_math
from customop.math import quant as quant_math
from customop.math import rotary as rotary_math
from customop.ops._library import activation as _library_activation
from customop.ops._library import layernorm as norm_vjp  # the reference backward math

Tensor = torch.Tensor
#: The dtypes the kernels take for their float inputs (other dtypes run the reference math).
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: fp8 outputs the kernels write (torch_xla 2.9 has no fnuz types at all).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: Modules the bridge needs beyond torch and jax: ``call_jax`` fails without torchax, which
#: torch_xla does not declare; torchax 0.0.13 imports flax at import time without declaring it.
BRIDGE_MODULES = ("torch_xla", "torchax", "flax")


@functools.cache
def _call_jax() -> Callable[..., Any]:
    try:
        from torch_xla.core import xla_builder
        import torchax  # noqa: F401, I001  (call_jax raises "Jax is required" without it)
    except ModuleNotFoundError as err:
        missing = (err.name or "").split(".")[0]
        if missing in BRIDGE_MODULES:
            raise ImportError(f"customop's TPU backend needs {missing!r} for torch tensors: "
                              "pip install customop[tpu]") from err
        raise
    return xla_builder.call_jax


def _jax(fn: Callable[..., Any], *args: Any, **statics: Any) -> Any:
    """``fn(*args, **statics)`` through ``call_jax``.

    torch_xla 2.9 keeps ONE output tree structure per cached function (set when a shape is first
    traced, reused for every later call), so a function whose output structure depends on which
    arguments are None gets one cache entry per None-pattern through ``override_hash``."""
    variant = (fn.__module__, fn.__qualname__, tuple(a is None for a in args))
    return _call_jax()(fn, args, statics, override_hash=variant)


def _pallas(fn: Callable[..., Any], *args: Any, **statics: Any) -> Any:
    """A Pallas kernel through ``call_jax``; the interpret mode is resolved here, per call."""
    return _jax(fn, *args, **statics, interpret=tiling.use_interpret(torch_xla_device=True))


def _takes(*tensors: Tensor | None) -> bool:
    """Whether the kernels take these float inputs (None: absent, fine)."""
    return all(t is None or t.dtype in KERNEL_DTYPES for t in tensors)


def _spec(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, an op's reference math, on the raw XLA tensors an ``xla`` kernel receives.

    Functionalized with views replaced by copies: on raw XLA tensors (below functionalization,
    where every op kernel runs, eager or under openxla) torch_xla 2.9 lowers a view at an offset
    such as ``x[..., d:]`` to a gather with an int64 index built on the host, and replaying the
    views (``torch.func.functionalize``'s default) computed wrong values; as ``slice_copy`` and
    friends they are XLA slices, and XLA fuses the whole function.

    A kernel called from a Python dispatch mode's handler (opcheck's schema check, debugging
    modes) runs with functorch's transforms switched off: there the spec runs as it is."""
    if torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.FuncTorchDynamicLayerFrontMode):
        return fn(*args)
    return torch.func.functionalize(fn, remove="mutations_and_views")(*args)


# ---- norms -----------------------------------------------------------------------------------------


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    if not _takes(x, weight):
        return _spec(norm_math.rms_norm, x, weight, eps)
    return _pallas(layernorm.rms_norm, x, weight, eps)


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float) -> None:
    if _takes(x, residual, weight):
        y, h = _pallas(layernorm.rms_norm, x, weight, eps, residual)
    else:
        y, h = _spec(norm_math.fused_add_rms_norm, x, residual, weight, eps)
    residual.copy_(h)
    x.copy_(y)


def gemma_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if not _takes(x, weight):
        return _spec(norm_math.gemma_rms_norm, x, weight, eps)
    return _pallas(layernorm.gemma_rms_norm, x, weight, eps)


def gemma_fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    if _takes(x, residual, weight):
        y, h = _pallas(layernorm.gemma_rms_norm, x, weight, eps, residual)
    else:
        y, h = _spec(norm_math.gemma_fused_add_rms_norm, x, residual, weight, eps)
    residual.copy_(h)
    x.copy_(y)


def rms_norm_gated(x: Tensor, weight: Tensor, z: Tensor | None, eps: float, group_size: int,
                   norm_before_gate: bool, sigmoid: bool) -> Tensor:
    if not _takes(x, weight, z):
        return _spec(norm_math.rms_norm_gated, x, weight, z, eps, group_size, norm_before_gate, sigmoid)
    return _pallas(layernorm.rms_norm_gated, x, weight, z, eps, group_size=group_size,
                   norm_before_gate=norm_before_gate, activation="sigmoid" if sigmoid else "silu")


def layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
    if not _takes(x, weight, bias):
        return _spec(norm_math.layer_norm, x, weight, bias, eps)
    return _pallas(layernorm.layer_norm, x, weight, bias, eps)


def nemotron_layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    if not _takes(x, weight, bias):
        return _spec(norm_math.nemotron_layer_norm, x, weight, bias, eps)
    return _pallas(layernorm.nemotron_layer_norm, x, weight, bias, eps)


def fused_add_nemotron_layer_norm(x: Tensor, residual: Tensor, weight: Tensor, bias: Tensor | None,
                                  eps: float) -> None:
    if _takes(x, residual, weight, bias):
        y, h = _pallas(layernorm.nemotron_layer_norm, x, weight, bias, eps, residual)
    else:
        y, h = _spec(norm_math.fused_add_nemotron_layer_norm, x, residual, weight, bias, eps)
    residual.copy_(h)
    x.copy_(y)


def fused_rms_norm_gated(x: Tensor, g: Tensor, weight: Tensor | None, eps: float, sigmoid: bool) -> Tensor:
    if not _takes(x, g, weight):
        return _spec(norm_math.fused_rms_norm_gated, x, g, weight, eps, sigmoid)
    return _pallas(layernorm.fused_rms_norm_gated, x, g, weight, eps, activation="sigmoid" if sigmoid else "silu")


def fused_add_rms_norm_gated(x: Tensor, g: Tensor, residual: Tensor, weight: Tensor | None, eps: float,
                             sigmoid: bool) -> tuple[Tensor, Tensor]:
    if not _takes(x, g, residual, weight):
        return _spec(norm_math.fused_add_rms_norm_gated, x, g, residual, weight, eps, sigmoid)
    return tuple(_pallas(layernorm.fused_rms_norm_gated, x, g, weight, eps, residual,
                         activation="sigmoid" if sigmoid else "silu"))


def rms_norm_backward(grad_y: Tensor, x: Tensor, weight: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    if not _takes(grad_y, x, weight):
        return _spec(norm_vjp.rms_norm_vjp, grad_y, x, weight, eps)
    return tuple(_jax(grads.rms_norm_vjp, grad_y, None, x, None, weight, eps=eps))


def gemma_rms_norm_backward(grad_y: Tensor, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    if not _takes(grad_y, x, weight):
        return _spec(norm_vjp.gemma_rms_norm_vjp, grad_y, x, weight, eps)
    return tuple(_jax(grads.rms_norm_vjp, grad_y, None, x, None, weight, eps=eps, gemma=True))


def rms_norm_gated_backward(grad_y: Tensor, x: Tensor, weight: Tensor, z: Tensor | None, eps: float,
                            group_size: int, norm_before_gate: bool, sigmoid: bool) -> tuple[Tensor, Tensor, Tensor]:
    if not _takes(grad_y, x, weight, z):
        return _spec(norm_vjp.rms_norm_gated_vjp, grad_y, x, weight, z, eps, group_size, norm_before_gate, sigmoid)
    return tuple(_jax(grads.rms_norm_gated_vjp, grad_y, x, weight, z, eps=eps, group_size=group_size,
                      norm_before_gate=norm_before_gate, sigmoid=sigmoid))


# ---- rotary embedding --------------------------------------------------------------------------------


def _rotate(positions, x, cos_sin_cache, *, head_size, is_neox, interpret):
    """One tensor through the rotary kernel (``call_jax`` needs a module-level function)."""
    return rotary.rotary_embedding(positions, x, None, head_size, cos_sin_cache, is_neox, interpret=interpret)[0]


def rotary_embedding(positions: Tensor, query: Tensor, key: Tensor | None, head_size: int,
                     cos_sin_cache: Tensor, is_neox: bool) -> None:
    if not _takes(query, key, cos_sin_cache):
        new_query, new_key = _spec(rotary_math.rotary_embedding, positions, query, key, head_size, cos_sin_cache,
                                   is_neox)
    else:
        # JAX traces without x64: an int64 argument would meet an s32 parameter in the lowered call.
        positions = positions.to(torch.int32)
        new_query = _pallas(_rotate, positions, query, cos_sin_cache, head_size=head_size, is_neox=is_neox)
        new_key = None if key is None else _pallas(_rotate, positions, key, cos_sin_cache, head_size=head_size,
                                                   is_neox=is_neox)
    query.copy_(new_query)
    if key is not None:
        key.copy_(new_key)


# ---- fp8 quant ---------------------------------------------------------------------------------------


def _quant_takes(x: Tensor, out_dtype: torch.dtype) -> bool:
    return x.dtype in KERNEL_DTYPES and x.dim() > 0 and out_dtype in FP8_DTYPES


def dynamic_scaled_fp8_quant(x: Tensor, out_dtype: torch.dtype, fp8_max: float,
                             min_scale: float) -> tuple[Tensor, Tensor]:
    if not _quant_takes(x, out_dtype):
        q, scale = _spec(quant_math.dynamic_scaled_fp8_quant, x, out_dtype, fp8_max, min_scale)
        return q.contiguous(), scale
    return tuple(_jax(quant.per_tensor_quant_fp8, x, fp8_dtype=out_dtype, fp8_max=fp8_max, min_scale=min_scale))


def dynamic_per_token_scaled_fp8_quant(x: Tensor, scale_ub: Tensor | None, out_dtype: torch.dtype, fp8_max: float,
                                       min_scale: float) -> tuple[Tensor, Tensor]:
    if scale_ub is not None and scale_ub.numel() != 1:
        raise ValueError("customop::dynamic_per_token_scaled_fp8_quant: scale_ub must have one element, got shape "
                         f"{tuple(scale_ub.shape)}")
    if not _quant_takes(x, out_dtype):
        q, scale = _spec(quant_math.dynamic_per_token_scaled_fp8_quant, x, scale_ub, out_dtype, fp8_max, min_scale)
        return q.contiguous(), scale.contiguous()
    return tuple(_pallas(quant.per_token_quant_fp8, x, scale_ub, fp8_dtype=out_dtype, fp8_max=fp8_max,
                         min_scale=min_scale))


def per_token_group_fp8_quant(x: Tensor, group_size: int, column_major_scales: bool, use_ue8m0: bool,
                              out_dtype: torch.dtype, fp8_max: float, min_scale: float) -> tuple[Tensor, Tensor]:
    if group_size < 1 or x.dim() < 2 or x.shape[-1] % group_size:
        raise ValueError(f"customop::per_token_group_fp8_quant: x of shape {tuple(x.shape)} must be [T, H] "
                         f"with H a multiple of group_size={group_size}")
    if not _quant_takes(x, out_dtype):
        q, scales = _spec(quant_math.per_token_group_fp8_quant, x, group_size, column_major_scales, use_ue8m0,
                          out_dtype, fp8_max, min_scale)
        return q.contiguous(), scales
    q, scales = _pallas(quant.per_group_quant_fp8, x, group_size=group_size, use_ue8m0=use_ue8m0,
                        fp8_dtype=out_dtype, fp8_max=fp8_max, min_scale=min_scale)
    if column_major_scales:  # the schema's layout: a [..., H/G, T] contiguous tensor, transposed
        scales = scales.transpose(-2, -1).contiguous().transpose(-2, -1)
    return q, scales


# ---- gated activations ---------------------------------------------------------------------------


def _gated_activation(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """The xla kernel of a ``*_and_mul`` op: its spec, functionalized (``_spec``)."""

    def kernel(x: Tensor, *args: Any) -> Tensor:
        return _spec(fn, x, *args).contiguous()

    kernel.__name__ = kernel.__qualname__ = fn.__name__
    return kernel


#: every gated op the library defines: a new one is served here with no edit (its spec, by name)
GATED_ACTIVATIONS = tuple(_library_activation.GATED)

#: op name -> xla kernel
KERNELS: dict[str, Callable[..., Any]] = {
    **{name: _gated_activation(getattr(act_math, name)) for name in GATED_ACTIVATIONS},
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "gemma_rms_norm": gemma_rms_norm,
    "gemma_fused_add_rms_norm": gemma_fused_add_rms_norm,
    "rms_norm_gated": rms_norm_gated,
    "layer_norm": layer_norm,
    "nemotron_layer_norm": nemotron_layer_norm,
    "fused_add_nemotron_layer_norm": fused_add_nemotron_layer_norm,
    "fused_rms_norm_gated": fused_rms_norm_gated,
    "fused_add_rms_norm_gated": fused_add_rms_norm_gated,
    "rms_norm_backward": rms_norm_backward,
    "gemma_rms_norm_backward": gemma_rms_norm_backward,
    "rms_norm_gated_backward": rms_norm_gated_backward,
    "rotary_embedding": rotary_embedding,
    "dynamic_scaled_fp8_quant": dynamic_scaled_fp8_quant,
    "dynamic_per_token_scaled_fp8_quant": dynamic_per_token_scaled_fp8_quant,
    "per_token_group_fp8_quant": per_token_group_fp8_quant,
}
#: The ops that mutate their arguments (see the module docstring).
IN_PLACE = ("fused_add_rms_norm", "gemma_fused_add_rms_norm", "fused_add_nemotron_layer_norm", "rotary_embedding")


# ---- registration ------------------------------------------------------------------------------------


def _functionalize_on_xla(library: torch.library.Library, name: str) -> None:
    """Registers the ``AutogradXLA`` kernel of the in-place op ``customop::<name>`` that makes it
    callable on eager (functionalized) XLA tensors; see the module docstring."""
    from torch._subclasses.functional_tensor import CppFunctionalizeAPI

    op = getattr(torch.ops.customop, name).default
    arg_names = [a.name for a in op._schema.arguments]
    mutated = [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    below_autograd = torch._C._after_autograd_keyset

    def kernel(keyset, *args):
        kwargs = dict(zip(arg_names, args))
        targets = [kwargs[n] for n in mutated if kwargs[n] is not None]
        if not all(torch._is_functional_tensor(t) for t in targets):
            # raw XLA tensors, or tensor subclasses of a trace (fake, functional: functionalized
            # by torch.compile itself): what torch would have done without this kernel.
            return op.redispatch(keyset & below_autograd, *args)
        if torch.is_grad_enabled() and any(t.requires_grad for t in targets):
            raise RuntimeError(f"customop::{name} writes into tensors that require grad and has no autograd "
                               "formula (it is in place); call the op's forward_native while autograd records")
        ctx = CppFunctionalizeAPI()
        inner = ctx.unwrap_tensors(kwargs)
        with ctx.redispatch_to_next():
            fresh = {n: (t.clone() if n in mutated and t is not None else t) for n, t in inner.items()}
            result = op(**fresh)
        for n in mutated:
            if kwargs[n] is not None:
                ctx.replace(kwargs[n], fresh[n])
                ctx.commit_update(kwargs[n])
                ctx.sync(kwargs[n])
                torch.autograd.graph.increment_version(kwargs[n])
        return ctx.wrap_tensors(result)  # an op that also returns a tensor (the state-space ops)

    library.impl(name, kernel, "AutogradXLA", with_keyset=True)


_libraries: dict[str, torch.library.Library] = {}


def register_table(owner: str, kernels: dict, in_place: tuple[str, ...] = ()) -> None:
    """Registers ``kernels`` (op name -> kernel) for XLA tensors, and the ``AutogradXLA``
    functionalization of the ``in_place`` ops, once per ``owner`` (the module holding the table).
    Needs torch only: registering does not import torch_xla; the kernels do, when first called."""
    if owner in _libraries:
        return
    import customop.ops  # noqa: F401  (defines the customop:: ops)

    for name, kernel in kernels.items():
        torch.library.register_kernel(f"customop::{name}", "xla", kernel)
    library = torch.library.Library("customop", "IMPL")
    for name in in_place:
        _functionalize_on_xla(library, name)
    _libraries[owner] = library


def register() -> None:
    """Registers this module's kernels (the elementwise, norm, rotary and quant families)."""
    register_table(__name__, KERNELS, IN_PLACE)
