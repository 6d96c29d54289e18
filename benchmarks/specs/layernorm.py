"""Benchmark specs of the norms at tokens {1, 16, 256, 4096, 32768} x hidden {4096, 8192}, weights
in the activation dtype (as in a model built under that default dtype, Gemma's too). Liger peers:
rms_norm (llama casting), Gemma (offset 1, gemma casting), the fused residual add (Liger's
is out of place) and layer_norm. vLLM 0.33's layer norms (eps 1e-5, a bias; Nemotron's weight
stored as w - 1) and FusedRMSNormGated (the KDA output norm, swish gate after the norm) too."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from customop.benchmarks.specs import HIDDEN, OpSpec, Shape, liger_module, token_shapes
from customop.benchmarks.specs.activation import impls
from customop.ops import layernorm as native

EPS = 1e-6
SHAPES = token_shapes(hidden=HIDDEN)
GATED_GROUP = 1024  # Mamba2-style groups of the gated norm (hidden / 8 at 8192)


def _inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    t, h = shape.tokens, shape.hidden
    return {"x": torch.randn(t, h, device=device).to(dtype),
            "residual": torch.randn(t, h, device=device).to(dtype),
            "z": torch.randn(t, h, device=device).to(dtype),
            "weight": (1 + 0.1 * torch.randn(h, device=device)).to(dtype),
            "gemma_weight": (0.1 * torch.randn(h, device=device)).to(dtype),
            "bias": (0.1 * torch.randn(h, device=device)).to(dtype)}


def _bytes(reads: int, writes: int):
    """``reads`` + ``writes`` row-sized tensors, plus the weight once."""

    def count(shape: Shape, dtype: torch.dtype) -> int:
        return ((reads + writes) * shape.tokens + 1) * shape.hidden * dtype.itemsize

    return count


# ---- Liger peers ------------------------------------------------------------------------------


def _liger_rms(offset: float, casting: str, weight_key: str):
    def factory(i):
        mod = liger_module("rms_norm")
        if mod is None:
            return None
        x, w = i["x"], i[weight_key]
        if "row_mode" in inspect.signature(mod.rms_norm_forward).parameters:
            return lambda: mod.rms_norm_forward(x, w, EPS, offset, casting, None)[0]
        return lambda: mod.rms_norm_forward(x, w, EPS, offset, casting)[0]

    return factory


def _liger_fused_add(offset: float, casting: str, weight_key: str):
    def factory(i):
        mod = liger_module("fused_add_rms_norm")
        if mod is None:
            return None
        x, r, w = i["x"], i["residual"], i[weight_key]
        return lambda: mod.fused_add_rms_norm_forward(x, r, w, EPS, offset, casting)[:2]

    return factory


def _in_place(op: str, native_fn, args, **peers):
    """A fused add (``args(inputs)``: the op's arguments, x and residual first): the op writes x
    and residual; every implementation returns (out, new residual). ``customop_fresh`` (not a
    peer): the same kernel writing into fresh buffers, as Liger's and the compiled code do. Under
    the runner's rotating input sets those fresh buffers stay in L2 from call to call while the
    in-place op's writes go to a new set each time, so the pair separates the kernel's speed from
    where it writes (BENCHMARKS.md)."""
    library_op = getattr(torch.ops.customop, op)
    table = impls(op, native_fn, args, **peers)

    def customop(i):
        a = args(i)

        def run():
            library_op(*a)
            return a[0], a[1]

        return run

    def customop_fresh(i):
        from customop.backends.triton import layernorm as kernels

        launcher, a = getattr(kernels, op), args(i)

        def run():
            out, residual_out = torch.empty_like(a[0]), torch.empty_like(a[1])
            launcher(*a, out=out, residual_out=residual_out)
            return out, residual_out

        return run

    table["customop"] = customop
    table["customop_fresh"] = customop_fresh
    return table


def _liger_layer_norm(i):
    mod = liger_module("layer_norm")
    if mod is None or len(inspect.signature(mod.layer_norm_forward).parameters) != 4:
        return None
    x, w, b = i["x"], i["weight"], i["bias"]
    return lambda: mod.layer_norm_forward(x, w, b, LN_EPS)[0]


LN_EPS = 1e-5

SPECS = [
    OpSpec("rms_norm", "layernorm", SHAPES, _inputs, _bytes(1, 1),
           impls("rms_norm", native.rms_norm, lambda i: (i["x"], i["weight"], EPS),
                 liger=_liger_rms(0.0, "llama", "weight"))),
    OpSpec("fused_add_rms_norm", "layernorm", SHAPES, _inputs, _bytes(2, 2),
           _in_place("fused_add_rms_norm", native.fused_add_rms_norm,
                     lambda i: (i["x"], i["residual"], i["weight"], EPS), liger=_liger_fused_add(0.0, "llama", "weight")),
           mutates=("x", "residual")),
    OpSpec("gemma_rms_norm", "layernorm", SHAPES, _inputs, _bytes(1, 1),
           impls("gemma_rms_norm", native.gemma_rms_norm, lambda i: (i["x"], i["gemma_weight"], EPS),
                 liger=_liger_rms(1.0, "gemma", "gemma_weight"))),
    OpSpec("gemma_fused_add_rms_norm", "layernorm", SHAPES, _inputs, _bytes(2, 2),
           _in_place("gemma_fused_add_rms_norm", native.gemma_fused_add_rms_norm,
                     lambda i: (i["x"], i["residual"], i["gemma_weight"], EPS),
                     liger=_liger_fused_add(1.0, "gemma", "gemma_weight")),
           mutates=("x", "residual")),
    OpSpec("rms_norm_gated", "layernorm", SHAPES, _inputs, _bytes(2, 1),
           impls("rms_norm_gated", native.rms_norm_gated,
                 lambda i: (i["x"], i["weight"], i["z"], 1e-5, GATED_GROUP, False, False))),
    OpSpec("layer_norm", "layernorm", SHAPES, _inputs, _bytes(1, 1),
           impls("layer_norm", native.layer_norm, lambda i: (i["x"], i["weight"], i["bias"], LN_EPS),
                 liger=_liger_layer_norm)),
    OpSpec("nemotron_layer_norm", "layernorm", SHAPES, _inputs, _bytes(1, 1),
           impls("nemotron_layer_norm", native.nemotron_layer_norm,
                 lambda i: (i["x"], i["gemma_weight"], i["bias"], LN_EPS))),
    OpSpec("fused_add_nemotron_layer_norm", "layernorm", SHAPES, _inputs, _bytes(2, 2),
           _in_place("fused_add_nemotron_layer_norm", native.fused_add_nemotron_layer_norm,
                     lambda i: (i["x"], i["residual"], i["gemma_weight"], i["bias"], LN_EPS)),
           mutates=("x", "residual")),
    OpSpec("fused_rms_norm_gated", "layernorm", SHAPES, _inputs, _bytes(2, 1),
           impls("fused_rms_norm_gated", native.fused_rms_norm_gated,
                 lambda i: (i["x"], i["z"], i["weight"], LN_EPS, False))),
    OpSpec("fused_add_rms_norm_gated", "layernorm", SHAPES, _inputs, _bytes(3, 2),
           impls("fused_add_rms_norm_gated", native.fused_add_rms_norm_gated,
                 lambda i: (i["x"], i["z"], i["residual"], i["weight"], LN_EPS, False))),
]
