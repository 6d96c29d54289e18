"""Autograd of the functional norm ops, registered once in ``customop/ops/_library/layernorm.py``
for every device, on CPU tensors (main tier; the tpu tier runs it too, on torch 2.9).

The backward ops' reference bodies are written-out vector-Jacobian products of the spec; they
are checked here against finite differences of the forward ops (gradcheck) and against
``torch.autograd`` through the spec math (``customop/math/layernorm.py``). The TPU backend's
JAX vjps (the backward ops' xla kernels) are checked against the same in test_torch_xla.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import customop.ops  # noqa: F401  (defines the customop:: ops)
from customop.math import layernorm as spec
from customop.testing import assert_close

ops = torch.ops.customop


def _rand(*shape, dtype=torch.float64, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _leaves(*tensors):
    return tuple(None if t is None else t.clone().requires_grad_() for t in tensors)


# The spec upcasts with .float(), so even float64 inputs are normalised in float32: finite
# differences then carry float32 rounding (~1e-7 / eps). eps=1e-3 keeps that near 1e-4, far
# below what a wrong formula gives (O(0.1)).
GRADCHECK = dict(eps=1e-3, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("weight", [True, False])
def test_gradcheck_rms_norm(weight):
    x, w = _leaves(_rand(3, 16), _rand(16, seed=1) if weight else None)
    inputs = (x, w) if weight else (x,)
    assert torch.autograd.gradcheck(lambda x, w=None: ops.rms_norm(x, w, 1e-6), inputs, **GRADCHECK)


def test_gradcheck_gemma_rms_norm():
    x, w = _leaves(_rand(2, 3, 16), _rand(16, seed=1))
    assert torch.autograd.gradcheck(lambda x, w: ops.gemma_rms_norm(x, w, 1e-6), (x, w), **GRADCHECK)


@pytest.mark.parametrize("norm_before_gate,sigmoid,gated", list(itertools.product([False, True], repeat=3)))
def test_gradcheck_rms_norm_gated(norm_before_gate, sigmoid, gated):
    x, w, z = _leaves(_rand(3, 16), _rand(16, seed=1), _rand(3, 16, seed=2) if gated else None)

    def fn(x, w, z=None):
        return ops.rms_norm_gated(x, w, z, 1e-5, 8, norm_before_gate, sigmoid)

    assert torch.autograd.gradcheck(fn, (x, w, z) if gated else (x, w), **GRADCHECK)


CASES = {
    # name: (op, spec function, tensor inputs, trailing static arguments)
    "rms_norm": (ops.rms_norm, spec.rms_norm, ("x", "w"), (1e-6,)),
    "rms_norm-no-weight": (ops.rms_norm, spec.rms_norm, ("x", None), (1e-6,)),
    "gemma_rms_norm": (ops.gemma_rms_norm, spec.gemma_rms_norm, ("x", "w"), (1e-6,)),
    "rms_norm_gated": (ops.rms_norm_gated, spec.rms_norm_gated, ("x", "w", "z"), (1e-5, 64, False, False)),
    "rms_norm_gated-before-sigmoid": (ops.rms_norm_gated, spec.rms_norm_gated, ("x", "w", "z"),
                                      (1e-5, 128, True, True)),
    "rms_norm_gated-no-gate": (ops.rms_norm_gated, spec.rms_norm_gated, ("x", "w", None), (1e-5, 128, False, False)),
}


@pytest.mark.parametrize("dtype,weight_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("case", CASES)
def test_backward_matches_autograd_of_the_spec(case, dtype, weight_dtype):
    """Gradients through the op (its registered backward) vs torch.autograd through the spec."""
    op, fn, names, statics = CASES[case]
    values = {"x": _rand(7, 256, dtype=dtype), "w": _rand(256, dtype=weight_dtype, seed=1) * 0.5 + 1,
              "z": _rand(7, 256, dtype=dtype, seed=2)}
    grad_y = _rand(7, 256, dtype=dtype, seed=3)
    results = []
    for f in (op, fn):
        leaves = _leaves(*(values[n] if n else None for n in names))
        f(*leaves, *statics).backward(grad_y)
        results.append([t.grad for t in leaves if t is not None])
    for name, actual, expected in zip([n for n in names if n], *results):
        assert actual.dtype == expected.dtype
        assert_close(actual, expected, dtype, what=f"grad {name}")


def _backward_cases():
    f32 = torch.float32
    x, w, z, g = _rand(7, 256, dtype=f32), _rand(256, dtype=f32, seed=1), _rand(7, 256, dtype=f32, seed=2), \
        _rand(7, 256, dtype=f32, seed=3)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    return {
        "rms_norm_backward": (ops.rms_norm_backward.default, (g, x, w, 1e-6)),
        "rms_norm_backward-no-weight": (ops.rms_norm_backward.default, (g, x, None, 1e-6)),
        "gemma_rms_norm_backward": (ops.gemma_rms_norm_backward.default, (g, x, w, 1e-6)),
        "rms_norm_gated_backward": (ops.rms_norm_gated_backward.default, (g, x, w, z, 1e-5, 128, True, False)),
        "rms_norm_gated_backward-no-gate": (ops.rms_norm_gated_backward.default, (g, x, w, None, 1e-5, 64, False, True)),
        # the forward ops, now with autograd: opcheck's autograd-registration check applies
        "rms_norm": (ops.rms_norm.default, (xg, wg, 1e-6)),
        "gemma_rms_norm": (ops.gemma_rms_norm.default, (xg, wg, 1e-6)),
        "rms_norm_gated": (ops.rms_norm_gated.default, (xg, wg, z, 1e-5, 128, False, True)),
    }


@pytest.mark.parametrize("case", list(_backward_cases()))
def test_opcheck(case):
    op, args = _backward_cases()[case]
    torch.library.opcheck(op, args)


def test_backward_shapes_without_optional_inputs():
    """A None weight or gate gets an empty (0,) gradient in x's dtype (fake and reference agree)."""
    x, g = _rand(3, 64, dtype=torch.bfloat16), _rand(3, 64, dtype=torch.bfloat16, seed=1)
    grad_x, grad_w = ops.rms_norm_backward(g, x, None, 1e-6)
    assert grad_x.shape == x.shape and grad_w.shape == (0,) and grad_w.dtype == x.dtype
    _, _, grad_z = ops.rms_norm_gated_backward(g, x, torch.ones(64), None, 1e-5, 64, False, False)
    assert grad_z.shape == (0,) and grad_z.dtype == x.dtype
