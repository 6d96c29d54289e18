"""``forward_tpu`` end to end on the XLA CPU device (the tpu tier: ``bash .ci/tpu.sh``).

Each op class is built with the TPU platform forced and every op enabled, moved to the XLA
device, and compared with its own ``forward_native`` (the spec) on CPU copies: forward, backward
where the backend registers one, and one ``torch.compile(backend="openxla", fullgraph=True)``.
"""

from __future__ import annotations

import pytest
import torch

torch_xla = pytest.importorskip("torch_xla")
pytest.importorskip("torchax")

import customop  # noqa: E402
from customop.backends.tpu import torch_ops  # noqa: E402,F401  (loaded before any compiled call)
from customop.ops.layernorm import GemmaRMSNorm, RMSNorm, RMSNormGated  # noqa: E402
from customop.ops.quantization.input_quant_fp8 import QuantFP8  # noqa: E402
from customop.ops.rotary_embedding import RotaryEmbedding  # noqa: E402
from customop.testing import assert_close, forced_platform  # noqa: E402

pytestmark = pytest.mark.xla

DTYPES = [torch.float32, torch.bfloat16]
ROWS_HIDDEN = [(1, 128), (7, 384), (64, 1024)]


@pytest.fixture(scope="module")
def dev():
    return torch_xla.device()


def build(op_cls, *args, **kwargs):
    """The op as ``forward_tpu`` dispatches it."""
    with forced_platform("tpu"), customop.use_config(customop.Config(custom_ops=["all"])):
        op = op_cls(*args, **kwargs)
    assert op._forward_method.__func__ is type(op).forward_tpu
    return op


def randomize(op, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in op.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (1.0 if scale < 1 else 0.0))
    return op


def rand(*shape, dtype=torch.float32, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def on(dev, *tensors):
    return tuple(None if t is None else t.to(dev) for t in tensors)


def cpu(out):
    return tuple(o.cpu() for o in out) if isinstance(out, tuple) else out.cpu()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", ROWS_HIDDEN)
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm(rows, hidden, residual, dtype, dev):
    op = randomize(build(RMSNorm, hidden, eps=1e-6, dtype=dtype))
    x, r = rand(rows, hidden, dtype=dtype), (rand(rows, hidden, dtype=dtype, seed=2) if residual else None)
    expected = op.forward_native(x, r) if residual else op.forward_native(x)
    op.to(dev)
    actual = op(*on(dev, x, r)) if residual else op(x.to(dev))
    assert_close(cpu(actual), expected, dtype)


def test_rms_norm_variants(dev):
    """No weight, variance over the first lanes, an fp32 weight on bf16 input, 3-D input."""
    x = rand(2, 3, 256, dtype=torch.bfloat16)
    for op in (build(RMSNorm, 256, has_weight=False), build(RMSNorm, 256, var_hidden_size=100),
               randomize(build(RMSNorm, 256, dtype=torch.float32))):
        expected = op.forward_native(x)
        assert_close(op.to(dev)(x.to(dev)).cpu(), expected, torch.bfloat16)


def _grads(op, inputs, out_fn):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out_fn(op, inputs).backward()
    return [t.grad for t in inputs] + [p.grad for p in op.parameters()]


def _loss(out):
    outs = out if isinstance(out, tuple) else (out,)
    return sum((o.float() * (i + 1.0)).sum() for i, o in enumerate(outs) if o is not None)


@pytest.mark.parametrize("op_cls", [RMSNorm, GemmaRMSNorm])
def test_norm_backward(op_cls, dev):
    """Gradients of x, residual and weight through the fused add and both returned tensors."""
    ref = randomize(build(op_cls, 256), scale=0.5)
    x, r = rand(7, 256), rand(7, 256, seed=2)
    expected = _grads(ref, [x, r], lambda op, t: _loss(op.forward_native(*t)))
    xla_op = randomize(build(op_cls, 256), scale=0.5).to(dev)
    actual = _grads(xla_op, list(on(dev, x, r)), lambda op, t: _loss(op(*t)))
    for name, a, e in zip(("x", "residual", "weight"), actual, expected):
        assert_close(a.cpu(), e, torch.float32, atol=1e-4, rtol=1e-4, what=f"grad {name}")
    # without the residual
    x_ref, x_xla = x.clone().requires_grad_(), x.to(dev).requires_grad_()
    ref.forward_native(x_ref).sum().backward()
    xla_op(x_xla).sum().backward()
    assert_close(x_xla.grad.cpu(), x_ref.grad, torch.float32, atol=1e-4, rtol=1e-4, what="grad x")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group,norm_before_gate,activation,gated",
                         [(None, False, "swish", True), (128, True, "sigmoid", True), (None, False, "silu", False)])
def test_rms_norm_gated(group, norm_before_gate, activation, gated, dtype, dev):
    op = randomize(build(RMSNormGated, 512, eps=1e-5, group_size=group, norm_before_gate=norm_before_gate,
                         activation=activation))
    x, z = rand(7, 512, dtype=dtype), (rand(7, 512, dtype=dtype, seed=3) if gated else None)
    expected = op.forward_native(x, z)
    assert_close(op.to(dev)(*on(dev, x, z)).cpu(), expected, dtype)


def test_rms_norm_gated_backward(dev):
    ref = randomize(build(RMSNormGated, 256, group_size=128, norm_before_gate=False))
    x, z = rand(7, 256), rand(7, 256, seed=3)
    expected = _grads(ref, [x, z], lambda op, t: _loss(op.forward_native(*t)))
    xla_op = randomize(build(RMSNormGated, 256, group_size=128, norm_before_gate=False)).to(dev)
    actual = _grads(xla_op, list(on(dev, x, z)), lambda op, t: _loss(op(*t)))
    for name, a, e in zip(("x", "z", "weight"), actual, expected):
        assert_close(a.cpu(), e, torch.float32, atol=1e-4, rtol=1e-4, what=f"grad {name}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("tokens,head_size,rotary_dim", [(1, 128, 128), (7, 128, 64), (64, 64, 32)])
def test_rotary_embedding(tokens, head_size, rotary_dim, neox, dtype, dev):
    op = build(RotaryEmbedding, head_size, rotary_dim, 256, 10000.0, neox, dtype)
    positions = torch.randint(0, 256, (tokens,), generator=torch.Generator().manual_seed(4))
    q, k = rand(tokens, 4 * head_size, dtype=dtype), rand(tokens, 2 * head_size, dtype=dtype, seed=2)
    expected = op.forward_native(positions, q, k)
    q_out, k_out = op.to(dev)(*on(dev, positions, q, k))
    # The spec rotates in the input dtype; the kernel in fp32 with one final rounding.
    assert_close((q_out.cpu(), k_out.cpu()), expected, dtype)
    assert op.to(dev)(positions.to(dev), q.to(dev))[1] is None


def test_rotary_backward(dev):
    op = build(RotaryEmbedding, 128, 64, 256, 10000.0, True, torch.float32)
    positions = torch.randint(0, 256, (7,), generator=torch.Generator().manual_seed(4))
    q, k = rand(7, 256), rand(7, 128, seed=2)
    expected = _grads(op, [q, k], lambda op, t: _loss(op.forward_native(positions, *t)))
    op.to(dev)
    actual = _grads(op, list(on(dev, q, k)), lambda op, t: _loss(op(positions.to(dev), *t)))
    for name, a, e in zip(("query", "key"), actual, expected):
        assert_close(a.cpu(), e, torch.float32, what=f"grad {name}")


def _dequant(q, scale, groups):
    return (q.float().reshape(q.shape[0], groups, -1) * scale.reshape(q.shape[0], groups, 1)).reshape(q.shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", ROWS_HIDDEN)
@pytest.mark.parametrize("group_shape", [(1, -1), (1, 128)], ids=["per-token", "per-group"])
def test_quant_fp8(group_shape, rows, hidden, dtype, dev):
    op = build(QuantFP8, False, group_shape, use_ue8m0=group_shape[1] > 0 and rows == 7)
    x = rand(rows, hidden, dtype=dtype) * 4
    q_ref, s_ref = op.forward_native(x)
    q, s = cpu(op(x.to(dev)))
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape and s.shape == s_ref.shape
    assert_close(s, s_ref, torch.float32, what="scale")
    groups = s.shape[-1]
    assert_close(_dequant(q, s, groups), _dequant(q_ref, s_ref, groups), torch.float8_e4m3fn, what="dequantized")


def test_quant_fp8_other_modes(dev):
    """scale_ub and padding on the kernel path; dynamic per-tensor through a fused XLA function
    (torch_xla 2.9's ``x.amax()`` does not reduce, so the native path is wrong on XLA); static
    scales run native on the XLA device."""
    x, ub = rand(7, 256) * 4, torch.tensor([2.0])
    op = build(QuantFP8, False, (1, -1), num_token_padding=16)
    q_ref, s_ref = op.forward_native(x, None, ub)
    q, s = cpu(op(x.to(dev), None, ub.to(dev)))
    assert q.shape == (16, 256)
    assert_close(s, s_ref, torch.float32)
    assert_close(q.float(), q_ref.float(), torch.float8_e4m3fn)
    for static, shape, scale in [(True, (-1, -1), torch.tensor([0.05])), (False, (-1, -1), None)]:
        op = build(QuantFP8, static, shape)
        q_ref, s_ref = op.forward_native(x, scale)  # on CPU tensors (torch_xla's amax() is the issue)
        q, s = cpu(op(x.to(dev), None if scale is None else scale.to(dev)))
        assert_close(s, s_ref, torch.float32)
        assert_close(q.float(), q_ref.float(), torch.float8_e4m3fn)


@pytest.mark.parametrize("name,reference", [
    ("silu", lambda a, b: torch.nn.functional.silu(a) * b),
    ("gelu", lambda a, b: torch.nn.functional.gelu(a) * b),
    ("gelu_tanh", lambda a, b: torch.nn.functional.gelu(a, approximate="tanh") * b),
])
def test_act_and_mul_bridge(name, reference, dev):
    """The opt-in Pallas activation through the bridge (the op classes stay on XLA's fusion)."""
    x = rand(7, 2 * 384) * 2
    actual = torch_ops.act_and_mul(x.to(dev), name).cpu()
    assert_close(actual, reference(*x.chunk(2, dim=-1)), torch.float32)


def test_openxla_fullgraph_compile_bridge(dev):
    """The customop_tpu ops (with their fakes) under openxla, fullgraph: one graph, no break."""
    x, r, w, cache = rand(7, 256), rand(7, 256, seed=2), rand(256, seed=3), rand(64, 128, seed=4)
    positions = torch.arange(7)

    def step(x, r, w, positions, cache):
        h, r = torch_ops.rms_norm(x, r, w, 1e-6)
        q, _ = torch_ops.rotary_embedding(positions, h, None, 128, cache, True)
        return torch_ops._per_group_quant_op(q, 128, False, torch.float8_e4m3fn)[1], r

    eager = cpu(step(*on(dev, x, r, w, positions, cache)))
    compiled = cpu(torch.compile(step, backend="openxla", fullgraph=True)(*on(dev, x, r, w, positions, cache)))
    assert_close(compiled, eager, torch.float32)


def test_openxla_fullgraph_compile_backward(dev):
    """Training: the registered backward ops compile too (AOTAutograd's joint graph under openxla)."""
    x, w = rand(7, 256), rand(256, seed=3)

    def loss(x, w):
        return (torch_ops.rms_norm(x, None, w, 1e-6) * torch.arange(256, device=x.device)).sum()

    grads = []
    for fn in (loss, torch.compile(loss, backend="openxla", fullgraph=True)):
        xd, wd = (t.to(dev).requires_grad_() for t in (x, w))
        fn(xd, wd).backward()
        grads.append((xd.grad.cpu(), wd.grad.cpu()))
    assert_close(grads[1], grads[0], torch.float32, atol=1e-4, rtol=1e-4)


def test_openxla_fullgraph_compile_op_classes(dev):
    """The op classes' forward_tpu under openxla, fullgraph, against forward_native on CPU."""
    norm = randomize(build(RMSNorm, 256))
    rope = build(RotaryEmbedding, 128, 128, 64, 10000.0, True, torch.float32)
    quant = build(QuantFP8, False, (1, 128))
    x, r, positions = rand(7, 256), rand(7, 256, seed=2), torch.arange(7)
    h, r_ref = norm.forward_native(x, r)
    expected = quant.forward_native(rope.forward_native(positions, h)[0])[1], r_ref

    def step(x, r, positions):
        h, r = norm(x, r)
        return quant(rope(positions, h)[0])[1], r

    for m in (norm, rope, quant):
        m.to(dev)
    with torch.no_grad():  # inference, as served: fp8 quant has no backward
        actual = cpu(torch.compile(step, backend="openxla", fullgraph=True)(*on(dev, x, r, positions)))
    assert_close(actual, expected, torch.float32)


def _opcheck_cases(dev):
    x, r, w = (t.to(dev) for t in (rand(7, 256), rand(7, 256, seed=2), rand(256, seed=3)))
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    ops = torch.ops.customop_tpu
    return {
        "rms_norm": (ops.rms_norm.default, (xg, wg, 1e-6, None, False)),
        "fused_add_rms_norm": (ops.fused_add_rms_norm.default, (xg, r, wg, 1e-6, None, True)),
        "rms_norm_gated": (ops.rms_norm_gated.default, (xg, wg, r, 1e-5, 128, False, False)),
        "rotary_embedding": (ops.rotary_embedding.default,
                             (torch.arange(7).to(dev), xg, rand(16, 64, seed=4).to(dev), 128, True, False)),
        "per_token_quant_fp8": (ops.per_token_quant_fp8.default, (x, None, torch.float8_e4m3fn)),
        "per_group_quant_fp8": (ops.per_group_quant_fp8.default, (x, 128, True, torch.float8_e4m3fn)),
        "per_tensor_quant_fp8": (ops.per_tensor_quant_fp8.default, (x, torch.float8_e4m3fn)),
        "act_and_mul": (ops.act_and_mul.default, (x, "gelu_tanh", 0.0, 7.0)),
    }


@pytest.mark.parametrize("name", ["rms_norm", "fused_add_rms_norm", "rms_norm_gated", "rotary_embedding",
                                  "per_token_quant_fp8", "per_group_quant_fp8", "per_tensor_quant_fp8",
                                  "act_and_mul"])
def test_opcheck(name, dev):
    """Schema, fake and AOT dispatch (with the backward where inputs require grad) of every
    customop_tpu op; opcheck's autograd-registration check does not support XLA tensors (the
    backward tests above cover it)."""
    op, args = _opcheck_cases(dev)[name]
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_cpu_tensors_are_refused():
    with pytest.raises(ValueError, match="XLA tensors"):
        torch_ops.rms_norm(torch.ones(2, 128), None, torch.ones(128), 1e-6)


@pytest.mark.tpu_hw
def test_on_a_real_tpu(dev):
    """On a TPU: JAX must see the TPU too (else call_jax would lower for CPU), and Mosaic runs."""
    import jax
    import torch_xla.runtime as xr

    if xr.device_type() != "TPU":
        pytest.skip("needs a real TPU")
    assert jax.default_backend() == "tpu"
    op = randomize(build(RMSNorm, 1024, dtype=torch.bfloat16))
    x = rand(64, 1024, dtype=torch.bfloat16)
    expected = op.forward_native(x)
    assert_close(op.to(dev)(x.to(dev)).cpu(), expected, torch.bfloat16)
