"""The norms vLLM 0.33 added: LayerNorm (layer_norm), NemotronLayerNorm1P (nemotron_layer_norm)
and FusedRMSNormGated (fused_rms_norm_gated). The case table's rows run in test_layernorm.py and
the backend tiers; here: vLLM's constructors and parameters, the rounding points that tell its
math apart from the near misses (the compute dtype, Nemotron's 1 + w and its residual add, the
gate's place), the call forms (prenorm, residual_in_fp32, autocast), bad inputs on every path,
and autograd through the kernel path's library ops.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from customop.config import Config, use_config
from customop.ops.layernorm import FusedRMSNormGated, LayerNorm, NemotronLayerNorm1P
from customop.testing import assert_close, assert_same_error, randn

PATHS = ["forward_native", "forward_cpu", "forward_kernel"]


def enabled(cls, *args, **kwargs):
    with use_config(Config(custom_ops=["all"])):
        op = cls(*args, **kwargs)
    return op.requires_grad_(False)


def randomise(op, offset=1.0, dtype=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for name in ("weight", "bias"):
        p = getattr(op, name, None)
        if p is not None:
            shift = offset if name == "weight" else 0.0
            p.data = (randn(*p.shape, generator=gen, scale=0.5) + shift).to(dtype or p.dtype)
    return op


# ---- constructors and parameters ---------------------------------------------------------------


def test_layer_norm_constructor():
    op = LayerNorm(16)
    assert (op.eps, op.elementwise_affine) == (1e-5, True)
    assert torch.equal(op.weight, torch.ones(16)) and torch.equal(op.bias, torch.zeros(16))
    assert op.weight.dtype == torch.get_default_dtype()
    assert LayerNorm(16, dtype=torch.bfloat16).bias.dtype == torch.bfloat16
    assert LayerNorm(16, bias=False).bias is None
    no_affine = LayerNorm(16, elementwise_affine=False, bias=True)  # bias ignored without affine
    assert no_affine.weight is None and no_affine.bias is None


def test_nemotron_constructor():
    op = NemotronLayerNorm1P(16)
    assert op.eps == 1e-5
    assert torch.equal(op.weight, torch.zeros(16)) and torch.equal(op.bias, torch.zeros(16))
    x = randn(3, 16)
    assert_close(op(x), F.layer_norm(x, (16,), eps=1e-5), torch.float32)  # zeros: the plain norm


def test_fused_rms_norm_gated_constructor():
    op = FusedRMSNormGated(16)
    assert (op.eps, op.activation, op.elementwise_affine) == (1e-5, "swish", True)
    assert torch.equal(op.weight, torch.ones(16)) and op.bias is None
    assert FusedRMSNormGated(16, elementwise_affine=False).weight is None
    assert FusedRMSNormGated(16, dtype=torch.bfloat16).weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="fused_rms_norm_gated: activation='gelu'"):
        FusedRMSNormGated(16, activation="gelu")


# ---- the rounding points ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_layer_norm_computes_in_the_promoted_dtype(path):
    """bf16 x with fp32 parameters: normalised in fp32 and cast once (vLLM's promote(x, w))."""
    op = randomise(enabled(LayerNorm, 256, dtype=torch.float32))
    x = randn(9, 256, dtype=torch.bfloat16, scale=3.0)
    want = F.layer_norm(x.float(), (256,), op.weight, op.bias, 1e-5).bfloat16()
    got = getattr(op, path)(x)
    assert got.dtype == torch.bfloat16
    assert_close(got, want, torch.bfloat16)
    if path != "forward_kernel":
        assert torch.equal(got, want)


@pytest.mark.parametrize("path", PATHS)
def test_nemotron_one_plus_w_is_formed_in_the_weight_dtype(path):
    """A bf16 weight gives a bf16 1 + w: the spec is bit-exact with that, and an fp32 1 + w
    visibly differs (or the test could not tell them apart)."""
    op = randomise(enabled(NemotronLayerNorm1P, 512), offset=0.0, dtype=torch.bfloat16, seed=1)
    op.weight.data = op.weight.data * 0.05 + 0.003  # small offsets: where rounding 1 + w bites
    x = randn(64, 512, dtype=torch.bfloat16, scale=2.0)
    w1 = op.weight + 1
    assert w1.dtype == torch.bfloat16
    want = F.layer_norm(x, (512,), w1, op.bias, 1e-5)
    got = getattr(op, path)(x)
    if path == "forward_kernel":
        assert (got == want).float().mean() > 0.99
    else:
        assert torch.equal(got, want)
    fp32_w1 = F.layer_norm(x.float(), (512,), op.weight.float() + 1, op.bias.float(), 1e-5).bfloat16()
    assert (fp32_w1 != want).float().mean() > 0.01


@pytest.mark.parametrize("path", PATHS)
def test_nemotron_residual_add_rounds_to_the_input_dtype(path):
    """h = x + residual in bf16 is the new residual and what gets normalised (not the fp32 sum,
    as RMSNorm's fused add does)."""
    op = randomise(enabled(NemotronLayerNorm1P, 512), offset=0.0, dtype=torch.bfloat16, seed=2)
    x, r = randn(64, 512, dtype=torch.bfloat16, scale=3.0), randn(64, 512, dtype=torch.bfloat16, scale=3.0)
    h = x + r
    want = F.layer_norm(h, (512,), op.weight + 1, op.bias, 1e-5)
    got, new_residual = getattr(op, path)(x.clone(), r.clone())
    assert torch.equal(new_residual, h)
    if path == "forward_kernel":
        assert_close(got, want, torch.bfloat16)
    else:
        assert torch.equal(got, want)
    unrounded = F.layer_norm(x.float() + r.float(), (512,), (op.weight + 1).float(), op.bias.float(), 1e-5)
    assert (unrounded.bfloat16() != want).float().mean() > 0.01


@pytest.mark.parametrize("path", PATHS)
def test_fused_rms_norm_gated_gates_after_the_norm(path):
    """rms(x) * w * g * sigmoid(g) in fp32, one cast: not rms(x * silu(g)) (RMSNormGated's
    default order)."""
    op = randomise(enabled(FusedRMSNormGated, 128))
    x, g = randn(5, 128, scale=2.0), randn(5, 128)
    xf = x.double()
    y = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * op.weight.double()
    want = y * g.double() * torch.sigmoid(g.double())
    assert_close(getattr(op, path)(x, g), want, torch.float32)
    before = (xf * F.silu(g.double()))
    before = before / torch.sqrt(before.pow(2).mean(-1, keepdim=True) + 1e-5) * op.weight.double()
    assert (before - want).abs().max() > 0.1


# ---- call forms ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_fused_rms_norm_gated_prenorm_and_residual_forms(path):
    op = randomise(enabled(FusedRMSNormGated, 96))
    x, g = randn(4, 96, dtype=torch.bfloat16, scale=2.0), randn(4, 96, dtype=torch.bfloat16)
    r32 = randn(4, 96, scale=2.0)
    fn = getattr(op, path)
    plain = fn(x, g)
    # prenorm without a residual: (y, x), or x in fp32 under residual_in_fp32
    y, res = fn(x, g, prenorm=True)
    assert torch.equal(y, plain) and torch.equal(res, x)
    y, res = fn(x, g, None, True, True)
    assert res.dtype == torch.float32 and torch.equal(res, x.float())
    assert torch.equal(x, x.clone())  # no path writes into x
    # with an fp32 residual: the fp32 sum is normalised and returned in the residual's dtype
    y, res = fn(x, g, r32, prenorm=True, residual_in_fp32=False)
    s = x.float() + r32
    assert res.dtype == torch.float32 and torch.equal(res, s)
    assert y.dtype == torch.bfloat16
    assert_close(y, _gated64(s, g, op), torch.bfloat16)
    assert torch.equal(fn(x, g, r32), y)  # without prenorm: y alone


def _gated64(s, g, op):
    s = s.double()
    y = s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + op.eps) * op.weight.double()
    return y * g.double() * torch.sigmoid(g.double())


def test_nemotron_under_autocast_casts_first():
    """vLLM casts x, 1 + w and the bias to the autocast dtype, then runs the norm without autocast."""
    op = randomise(enabled(NemotronLayerNorm1P, 64), offset=0.0)
    x, r = randn(3, 64, scale=2.0), randn(3, 64)
    want = F.layer_norm((x + r).bfloat16(), (64,), (op.weight + 1).bfloat16(), op.bias.bfloat16(), 1e-5)
    for path in PATHS:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, h = getattr(op, path)(x.clone(), r.clone())
        assert got.dtype == torch.bfloat16 and h.dtype == torch.float32
        assert torch.equal(got, want) and torch.equal(h, x + r)


# ---- bad inputs: one error, every path ---------------------------------------------------------------


def _bad_cases():
    x = randn(4, 64, dtype=torch.bfloat16)
    yield LayerNorm, {"dtype": torch.float16}, (x,), TypeError, r"layer_norm: weight has dtype torch.float16, expected x's"
    yield LayerNorm, {}, (randn(4, 32),), ValueError, r"layer_norm: x has shape \(4, 32\), expected \[\.\.\., 64\]"
    yield LayerNorm, {}, (x.int(),), TypeError, r"layer_norm: x must be a floating-point"
    yield NemotronLayerNorm1P, {}, (x, randn(2, 64, dtype=torch.bfloat16)), ValueError, r"nemotron_layer_norm: residual has shape"
    yield NemotronLayerNorm1P, {}, (x, randn(4, 64)), TypeError, r"nemotron_layer_norm: residual has dtype"
    yield FusedRMSNormGated, {}, (x, randn(4, 32, dtype=torch.bfloat16)), ValueError, r"fused_rms_norm_gated: g has shape"
    yield FusedRMSNormGated, {}, (x, x, randn(4, 63)), ValueError, r"fused_rms_norm_gated: residual has shape"
    yield FusedRMSNormGated, {}, (x, x, x.long()), TypeError, r"fused_rms_norm_gated: residual must be a floating-point"


@pytest.mark.parametrize("cls,init,args,error,match", list(_bad_cases()),
                         ids=lambda v: v.__name__ if isinstance(v, type) and not issubclass(v, Exception) else None)
def test_bad_inputs_same_error_on_every_path(cls, init, args, error, match):
    assert_same_error(enabled(cls, 64, **init), args, error, match)


def test_bias_checks():
    op = enabled(LayerNorm, 64)
    op.bias = torch.nn.Parameter(torch.zeros(63), requires_grad=False)
    assert_same_error(op, (randn(2, 64),), ValueError, r"layer_norm: bias has shape \(63,\), expected \(64,\)")
    op.bias = torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16), requires_grad=False)
    assert_same_error(op, (randn(2, 64, dtype=torch.bfloat16),), TypeError,
                      r"layer_norm: bias has dtype torch.bfloat16, expected weight's torch.float32")


# ---- autograd through the kernel path ------------------------------------------------------------------


@pytest.mark.parametrize("cls,call", [
    (LayerNorm, lambda op, x, g: op(x)),
    (NemotronLayerNorm1P, lambda op, x, g: op(x)),
    (FusedRMSNormGated, lambda op, x, g: op(x, g)),
], ids=["layer_norm", "nemotron_layer_norm", "fused_rms_norm_gated"])
def test_kernel_path_gradients_match_the_spec(cls, call):
    """forward_kernel runs the customop:: op, whose registered backward must give autograd's
    gradients of the spec (x, the parameters and the gate)."""
    grads = []
    for path in ("forward_native", "forward_kernel"):
        op = randomise(enabled(cls, 48), offset=0.0 if cls is NemotronLayerNorm1P else 1.0).requires_grad_(True)
        op.forward = getattr(op, path)
        x = randn(5, 48, scale=2.0, generator=torch.Generator().manual_seed(3)).requires_grad_()
        g = randn(5, 48, generator=torch.Generator().manual_seed(4)).requires_grad_()
        out = call(lambda *a: op.forward(*a), x, g)
        (out * torch.linspace(-1, 1, 48)).sum().backward()
        grads.append([x.grad, g.grad if cls is FusedRMSNormGated else None]
                     + [p.grad for p in op.parameters()])
    for want, got in zip(*grads):
        if want is None:
            assert got is None
        else:
            assert_close(got, want, torch.float32, atol=1e-4, rtol=1e-4)
