"""forward_cpu's eager paths for small inputs (backends/cpu/eager.py): the spec's operations with
in-place temporaries (activations: bitwise the spec) or ATen's fused RMSNorm (norms: the spec's
formula, to one ulp of the output dtype), and the spec itself wherever those do not apply."""

from __future__ import annotations

import pytest
import torch

from customop.backends.cpu import eager
from customop.ops import activation as act
from customop.ops import layernorm as ln
from customop.testing import randn

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SHAPES = ((1, 14), (7, 2 * 4231), (3, 5, 128), (0, 8), (2, 0))

ACTIVATIONS = [
    ("silu_and_mul", ()), ("mul_and_silu", ()), ("gelu_and_mul", ("none",)), ("gelu_and_mul", ("tanh",)),
    ("fatrelu_and_mul", (0.25,)), ("swigluoai_and_mul", (1.702, 7.0)), ("swigluoai_and_mul", (1.0, 2.0)),
    ("gelu_new", ()), ("gelu_fast", ()), ("quick_gelu", ()), ("relu2", ()),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name,args", ACTIVATIONS, ids=lambda v: str(v))
def test_activation_eager_is_bitwise_the_spec(name, args, shape, dtype):
    x = randn(*shape, dtype=dtype, scale=3.0)
    expected = getattr(act, name)(x, *args)
    got = getattr(eager, name)(x, *args)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    mismatched = (got != expected) & ~(got.isnan() & expected.isnan())
    assert not mismatched.any(), f"{name}: {int(mismatched.sum())} elements differ from the spec"


def _ulps_apart(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest |got - expected| in units of the output dtype's spacing at |expected|."""
    spacing = torch.finfo(expected.dtype).eps * expected.double().abs().clamp_min(torch.finfo(expected.dtype).tiny)
    return float(((got.double() - expected.double()).abs() / spacing).max())


NORMS = [
    ("rms_norm", torch.float32), ("rms_norm", None), ("fused_add_rms_norm", torch.float32),
    ("fused_add_rms_norm", None), ("gemma_rms_norm", torch.float32), ("gemma_rms_norm", torch.bfloat16),
    ("gemma_fused_add_rms_norm", torch.float32), ("gemma_fused_add_rms_norm", torch.bfloat16),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ((1, 7), (7, 4231), (3, 5, 128)), ids=str)
@pytest.mark.parametrize("name,w_dtype", NORMS, ids=str)
def test_norm_eager_matches_the_spec(name, w_dtype, shape, dtype):
    x = randn(*shape, dtype=dtype, scale=3.0)
    weight = None if w_dtype is None else randn(shape[-1], dtype=w_dtype)
    args = (x, randn(*shape, dtype=dtype)) if "fused" in name else (x,)
    expected = getattr(ln, name)(*args, weight, 1e-6)
    got = getattr(eager, name)(*args, weight, 1e-6)
    for g, e in zip(*((got, expected) if isinstance(got, tuple) else ((got,), (expected,)))):
        assert g.dtype == e.dtype and g.shape == e.shape
        assert _ulps_apart(g, e) <= 1.0


@pytest.mark.parametrize("name", ["rms_norm", "fused_add_rms_norm"])
def test_norm_eager_declines_what_the_fused_kernel_rounds_differently(name):
    x = randn(4, 64, dtype=torch.bfloat16)
    args = (x, randn(4, 64, dtype=torch.bfloat16)) if "fused" in name else (x,)
    bf16_weight = randn(64, dtype=torch.bfloat16)  # the spec rounds before this multiply
    assert getattr(eager, name)(*args, bf16_weight, 1e-6) is None
    assert getattr(eager, name)(*args, None, 1e-6, 32) is None  # variance over part of the row


def test_forward_cpu_takes_the_eager_path_only_without_autograd(monkeypatch):
    op = act.SiluAndMul()
    calls = []
    monkeypatch.setattr(act.SiluAndMul, "eager_fn", staticmethod(lambda x: calls.append(1) or eager.silu_and_mul(x)))
    x = randn(3, 64, dtype=torch.float32)
    with torch.no_grad():
        op.forward_cpu(x)
    assert calls == [1]
    leaf = x.clone().requires_grad_()
    out = op.forward_cpu(leaf)  # the spec: its autograd graph holds no overwritten values
    assert calls == [1]
    out.sum().backward()
    ref = x.clone().requires_grad_()
    act.silu_and_mul(ref).sum().backward()
    assert torch.equal(leaf.grad, ref.grad)


@pytest.mark.parametrize("cls", [ln.RMSNorm, ln.GemmaRMSNorm])
def test_norm_forward_cpu_gradients_through_the_eager_path(cls):
    op = cls(64)
    with torch.no_grad():
        op.weight.copy_(randn(64, dtype=torch.float32))
    x = randn(3, 64, dtype=torch.float32, scale=2.0).requires_grad_()
    ref_x = x.detach().clone().requires_grad_()
    op.forward_cpu(x).square().sum().backward()
    op.forward_native(ref_x).square().sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-5, atol=1e-6)



@pytest.mark.parametrize("name,args", ACTIVATIONS, ids=lambda v: str(v))
def test_activation_eager_takes_inference_tensors_outside_inference_mode(name, args):
    """The in-place steps touch only temporaries made inside the call, never x: an inference
    tensor (made under torch.inference_mode) can be passed in normal mode."""
    with torch.inference_mode():
        x = randn(3, 64, dtype=torch.float32)
    assert torch.equal(getattr(eager, name)(x, *args), getattr(act, name)(x, *args))


FP8, FP8_MAX, FP8_MIN_SCALE = torch.float8_e4m3fn, 448.0, 1.0 / (448.0 * 512.0)


def _same_fp8(got: torch.Tensor, expected: torch.Tensor) -> bool:
    return got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(
        got.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ((1, 7), (7, 4231), (3, 5, 128)), ids=str)
def test_fp8_quant_eager_is_bitwise_the_spec(shape, dtype):
    from customop.math import quant as qm

    x = randn(*shape, dtype=dtype, scale=40.0)
    for scale in (torch.tensor(0.07), torch.tensor([0.07]), torch.rand(*shape[:-1], 1) + 0.01,
                  torch.rand(shape[-1]) + 0.01):
        assert _same_fp8(eager.scaled_fp8_quant(x, scale, FP8, FP8_MAX), qm.scaled_fp8_quant(x, scale, FP8, FP8_MAX))
    got, expected = (m.dynamic_scaled_fp8_quant(x, FP8, FP8_MAX, FP8_MIN_SCALE) for m in (eager, qm))
    assert _same_fp8(got[0], expected[0]) and torch.equal(got[1], expected[1])
    for group, col_major, ue8m0 in ((128, False, False), (64, True, True), (100, False, True)):
        got, expected = (m.per_token_group_fp8_quant(x, group, col_major, ue8m0, FP8, FP8_MAX, FP8_MIN_SCALE)
                         for m in (eager, qm))
        assert _same_fp8(got[0], expected[0]) and torch.equal(got[1], expected[1])
        assert got[1].stride() == expected[1].stride()
    for scale_ub in (None, torch.tensor([30.0])):
        got, expected = (m.dynamic_per_token_scaled_fp8_quant(x, scale_ub, FP8, FP8_MAX, FP8_MIN_SCALE)
                         for m in (eager, qm))
        assert _same_fp8(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_fp8_quant_eager_never_writes_its_input():
    x = randn(4, 64, dtype=torch.float32, scale=40.0)
    before = x.clone()
    eager.scaled_fp8_quant(x, torch.tensor([0.1]), FP8, FP8_MAX)
    eager.dynamic_scaled_fp8_quant(x, FP8, FP8_MAX, FP8_MIN_SCALE)
    eager.dynamic_per_token_scaled_fp8_quant(x, None, FP8, FP8_MAX, FP8_MIN_SCALE)
    eager.per_token_group_fp8_quant(x, 64, False, False, FP8, FP8_MAX, FP8_MIN_SCALE)
    assert torch.equal(x, before)
