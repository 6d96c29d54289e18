"""Benchmark specs of the activations: the gated ops at d = 14336 (input [tokens, 2 x 14336]),
the elementwise ones at hidden {4096, 8192}; Liger where it has the op (silu_and_mul on the fused
gate-up tensor, gelu_and_mul tanh and relu2)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from customop.benchmarks.specs import HIDDEN, INTERMEDIATE, OpSpec, Shape, compiled, liger_module, token_shapes
from customop.ops import activation as native

GATED_SHAPES = token_shapes(hidden=(INTERMEDIATE,), label_fn=lambda t, d: f"{t}x2x{d}")
UNARY_SHAPES = token_shapes(hidden=HIDDEN)


def _gated_inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    return {"x": torch.randn(shape.tokens, 2 * shape.hidden, device=device).to(dtype)}


def _unary_inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    x = {"x": torch.randn(shape.tokens, shape.hidden, device=device).to(dtype)}
    # xIELU's effective alphas (softplus already applied), as the op class passes them
    x["alpha_p"] = torch.tensor([0.8], device=device, dtype=dtype)
    x["alpha_n"] = torch.tensor([1.3], device=device, dtype=dtype)
    return x


def _gated_bytes(shape: Shape, dtype: torch.dtype) -> int:
    return 3 * shape.tokens * shape.hidden * dtype.itemsize  # read 2d, write d


def _unary_bytes(shape: Shape, dtype: torch.dtype) -> int:
    return 2 * shape.tokens * shape.hidden * dtype.itemsize


def impls(op: str, native_fn: Callable[..., Any], args: Callable[[dict], tuple],
          **peers: Callable[[dict], Any]) -> dict[str, Callable[[dict], Any]]:
    """customop / eager / compile factories calling ``op`` and ``native_fn`` with ``args(inputs)``."""
    library_op = getattr(torch.ops.customop, op)

    def customop(i):
        a = args(i)
        return lambda: library_op(*a)

    def eager(i):
        a = args(i)
        return lambda: native_fn(*a)

    def compile_(i):
        f, a = compiled(native_fn), args(i)
        return lambda: f(*a)

    return {"customop": customop, "eager": eager, "compile": compile_, **peers}


# ---- Liger peers (forward functions, no autograd) ---------------------------------------------


def _liger_silu_and_mul(i):
    swiglu = liger_module("swiglu")
    if swiglu is None:
        return None
    x = i["x"]
    if hasattr(swiglu, "swiglu_fused_gate_up_forward"):  # reads the fused [.., 2d] tensor itself
        return lambda: swiglu.swiglu_fused_gate_up_forward(x)[1]
    d = x.shape[-1] // 2
    a, b = x[..., :d].contiguous(), x[..., d:].contiguous()  # two inputs, split outside the timing
    return lambda: swiglu.swiglu_forward(a, b)[2]


def _liger_geglu_tanh(i):
    geglu = liger_module("geglu")
    if geglu is None:
        return None
    d = i["x"].shape[-1] // 2
    a, b = i["x"][..., :d].contiguous(), i["x"][..., d:].contiguous()  # Liger takes two tensors
    return lambda: geglu.geglu_forward(a, b)[2]


def _liger_relu2(i):
    relu_squared = liger_module("relu_squared")
    if relu_squared is None:
        return None
    x = i["x"]
    return lambda: relu_squared.relu_squared_forward(x)


def _gated(name: str, native_fn, extra: tuple = (), **peers) -> OpSpec:
    op = name.split("[")[0]
    return OpSpec(name=name, family="activation", shapes=GATED_SHAPES, make_inputs=_gated_inputs,
                  bytes_moved=_gated_bytes, impls=impls(op, native_fn, lambda i: (i["x"], *extra), **peers))


def _unary(name: str, native_fn, args=lambda i: (i["x"],), **peers) -> OpSpec:
    return OpSpec(name=name, family="activation", shapes=UNARY_SHAPES, make_inputs=_unary_inputs,
                  bytes_moved=_unary_bytes, impls=impls(name, native_fn, args, **peers))


SPECS = [
    _gated("silu_and_mul", native.silu_and_mul, liger=_liger_silu_and_mul),
    _gated("mul_and_silu", native.mul_and_silu),
    _gated("gelu_and_mul[none]", native.gelu_and_mul, ("none",)),
    _gated("gelu_and_mul[tanh]", native.gelu_and_mul, ("tanh",), liger=_liger_geglu_tanh),
    # std_multiplier 1.6449 = Phi^-1(0.95), Gemma-3n's activation sparsity
    _gated("gelu_and_mul_sparse", native.gelu_and_mul_sparse, (1.6449, "tanh")),
    _gated("fatrelu_and_mul", native.fatrelu_and_mul, (0.1,)),
    _gated("swigluoai_and_mul", native.swigluoai_and_mul, (1.702, 7.0)),
    _gated("swiglustep_and_mul", native.swiglustep_and_mul, (7.0,)),
    # MiniMax-M3's (limit, alpha, beta); Kimi K3's (beta, linear_beta)
    _gated("silu_and_mul_with_clamp", native.silu_and_mul_with_clamp, (7.0, 1.702, 1.0)),
    _gated("situ_and_mul", native.situ_and_mul, (4.0, 25.0)),
    _unary("gelu", native.gelu),
    _unary("gelu_tanh", native.gelu_tanh),
    _unary("gelu_new", native.gelu_new),
    _unary("gelu_fast", native.gelu_fast),
    _unary("quick_gelu", native.quick_gelu),
    _unary("relu2", native.relu2, liger=_liger_relu2),
    _unary("xielu", native.xielu, args=lambda i: (i["x"], i["alpha_p"], i["alpha_n"], 0.5, -1e-6)),
]
