"""The TPU paths of the norms vLLM 0.33 added (layer_norm, nemotron_layer_norm with its fused add,
fused_rms_norm_gated with its fused add).

- The Pallas kernels in pure JAX, interpret mode, against float64 references written here (needs
  only jax: the main tier).
- Their ``xla`` kernels on the XLA CPU device (``@pytest.mark.xla``, the tpu tier): each
  ``torch.ops.customop`` op on XLA tensors against the same op's reference on CPU copies, the
  Pallas function proven to have run, and the op classes through ``forward_tpu``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from customop.backends import tpu  # noqa: E402
from customop.testing import assert_close  # noqa: E402

DTYPES = {"fp32": (jnp.float32, torch.float32), "bf16": (jnp.bfloat16, torch.bfloat16)}
# one row; odd rows in one full-dim block; a multi-step grid whose last block is partial
SHAPES = [(1, 128, None), (7, 384, None), (20, 256, 8)]


def _rand(shape, dtype, seed, scale=1.0, offset=0.0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale + offset, dtype=dtype)


def _f64(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def _check(actual, expected: np.ndarray, tdtype: torch.dtype, what: str = "output") -> None:
    assert_close(torch.from_numpy(_f64(actual)), torch.from_numpy(expected), dtype=tdtype, what=what)


def _ln64(h: np.ndarray, eps: float) -> np.ndarray:
    centred = h - h.mean(-1, keepdims=True)
    return centred / np.sqrt((centred ** 2).mean(-1, keepdims=True) + eps)


def _sigmoid(g: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-g))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden,block", SHAPES)
def test_layer_norm(rows, hidden, block, dtype):
    jd, td = DTYPES[dtype]
    x = _rand((rows, hidden), jd, 0, 2.0, offset=1.0)  # an offset: the mean matters
    w, b = _rand((hidden,), jd, 1, 0.5, 1.0), _rand((hidden,), jd, 2, 0.5)
    y = tpu.layer_norm(x, w, b, 1e-5, block_rows=block, interpret=True)
    assert y.shape == x.shape and y.dtype == x.dtype
    _check(y, _ln64(_f64(x), 1e-5) * _f64(w) + _f64(b), td)
    _check(tpu.layer_norm(x, None, None, 1e-5, block_rows=block, interpret=True), _ln64(_f64(x), 1e-5), td)
    # an fp32 weight on a bf16 input: fp32 math, the output in x's dtype
    y32 = tpu.layer_norm(x, w.astype(jnp.float32), None, 1e-5, interpret=True)
    assert y32.dtype == x.dtype
    _check(y32, _ln64(_f64(x), 1e-5) * _f64(w), td)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden,block", SHAPES[1:])
def test_nemotron_layer_norm_and_fused_add(rows, hidden, block, dtype):
    """1 + w is formed in w's dtype; the residual add rounds to x's dtype before the norm."""
    jd, td = DTYPES[dtype]
    x, r = _rand((rows, hidden), jd, 0, 2.0), _rand((rows, hidden), jd, 3, 2.0)
    w, b = _rand((hidden,), jd, 1, 0.5), _rand((hidden,), jd, 2, 0.5)
    w1 = _f64(w + jnp.asarray(1, jd))
    y = tpu.nemotron_layer_norm(x, w, b, 1e-5, block_rows=block, interpret=True)
    _check(y, _ln64(_f64(x), 1e-5) * w1 + _f64(b), td)
    y, h = tpu.nemotron_layer_norm(x, w, b, 1e-5, r, block_rows=block, interpret=True)
    h_expected = _f64(jnp.asarray(_f64(x) + _f64(r), jd))  # rounded to x's dtype
    _check(h, h_expected, td, "residual")
    _check(y, _ln64(h_expected, 1e-5) * w1 + _f64(b), td)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden,block", SHAPES[1:])
@pytest.mark.parametrize("activation", ["swish", "sigmoid"])
def test_fused_rms_norm_gated(activation, rows, hidden, block, dtype):
    jd, td = DTYPES[dtype]
    x, g, r = _rand((rows, hidden), jd, 0, 2.0), _rand((rows, hidden), jd, 1), _rand((rows, hidden), jnp.float32, 2)
    w = _rand((hidden,), jd, 3, 0.5, 1.0)
    gate = _sigmoid(_f64(g)) if activation == "sigmoid" else _f64(g) * _sigmoid(_f64(g))

    def expected(s, weight):
        y = s / np.sqrt((s ** 2).mean(-1, keepdims=True) + 1e-5)
        return (y if weight is None else y * _f64(weight)) * gate

    for weight in (w, None):
        got = tpu.fused_rms_norm_gated(x, g, weight, 1e-5, activation=activation, block_rows=block, interpret=True)
        assert got.dtype == x.dtype
        _check(got, expected(_f64(x), weight), td)
    y, s = tpu.fused_rms_norm_gated(x, g, w, 1e-5, r, activation=activation, block_rows=block, interpret=True)
    s64 = _f64(x) + _f64(r)
    assert s.dtype == jnp.float32  # residual_out keeps the residual's dtype
    _check(s, s64, torch.float32, "residual_out")
    _check(y, expected(s64, w), td)


def test_fused_rms_norm_gated_rejects_an_unknown_activation():
    x = jnp.ones((2, 128))
    with pytest.raises(ValueError, match="fused_rms_norm_gated: activation='gelu'"):
        tpu.fused_rms_norm_gated(x, x, None, activation="gelu", interpret=True)


# ---- the xla kernels (tpu tier) ---------------------------------------------------------------------


def _xla_cases(dtype):
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen) * scale).to(dt)

    x, r, g = rand(7, 384, scale=2.0), rand(7, 384, scale=2.0), rand(7, 384)
    w, b = rand(384, scale=0.5), rand(384, scale=0.5)
    return {
        # name: (op, args, the JAX function the kernel must run)
        "layer_norm": ("layer_norm", (x, w, b, 1e-5), "layer_norm"),
        "layer_norm-no-affine": ("layer_norm", (x, None, None, 1e-5), "layer_norm"),
        "layer_norm-fp32-weight": ("layer_norm", (x, w.float(), b.float(), 1e-5), "layer_norm"),
        "nemotron_layer_norm": ("nemotron_layer_norm", (x, w, b, 1e-5), "nemotron_layer_norm"),
        "fused_add_nemotron_layer_norm": ("fused_add_nemotron_layer_norm", (x, r, w, b, 1e-5), "nemotron_layer_norm"),
        "fused_rms_norm_gated": ("fused_rms_norm_gated", (x, g, w, 1e-5, False), "fused_rms_norm_gated"),
        "fused_rms_norm_gated-no-weight": ("fused_rms_norm_gated", (x, g, None, 1e-5, True), "fused_rms_norm_gated"),
        "fused_add_rms_norm_gated": ("fused_add_rms_norm_gated", (x, g, r.float(), w, 1e-5, False),
                                     "fused_rms_norm_gated"),
    }


@pytest.mark.xla
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(_xla_cases(torch.float32)))
def test_xla_kernel_vs_reference(case, dtype, monkeypatch):
    pytest.importorskip("torch_xla")
    pytest.importorskip("torchax")
    import torch_xla

    from customop.backends.tpu import xla_kernels

    seen: list[str] = []
    jax_call = xla_kernels._jax

    def counted(fn, *args, **statics):
        seen.append(fn.__qualname__)
        return jax_call(fn, *args, **statics)

    monkeypatch.setattr(xla_kernels, "_jax", counted)
    dev = torch_xla.device()
    name, args, jax_fn = _xla_cases(dtype)[case]
    op = getattr(torch.ops.customop, name).default
    written = [i for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    results = []
    for device in ("cpu", dev):
        call_args = [a.clone().to(device) if isinstance(a, torch.Tensor) else a for a in args]
        out = op(*call_args)
        if written:
            out = tuple(call_args[i] for i in written)
        out = out if isinstance(out, tuple) else (out,)
        results.append(tuple(o.cpu() for o in out))
    expected, actual = results
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a.dtype == e.dtype and a.shape == e.shape
        assert_close(a, e, e.dtype, what=f"{case}[{i}]")
    assert jax_fn in seen, f"{case}: the xla kernel did not run {jax_fn} (ran {seen})"


@pytest.mark.xla
def test_op_classes_through_forward_tpu():
    """Built with the TPU platform forced, the classes run forward_tpu on XLA tensors and match
    their forward_native on CPU copies (the fused add written in place, prenorm's pair)."""
    pytest.importorskip("torch_xla")
    pytest.importorskip("torchax")
    import torch_xla

    from customop.config import Config, use_config
    from customop.ops.layernorm import FusedRMSNormGated, LayerNorm, NemotronLayerNorm1P
    from customop.testing import forced_platform

    dev = torch_xla.device()
    gen = torch.Generator().manual_seed(1)
    x, r, g = (torch.randn(5, 256, generator=gen).bfloat16() for _ in range(3))
    with forced_platform("tpu"), use_config(Config(custom_ops=["all"])):
        ops = [LayerNorm(256, dtype=torch.bfloat16), NemotronLayerNorm1P(256), FusedRMSNormGated(256)]
    calls = [(ops[0], (x,), {}), (ops[1], (x, r), {}), (ops[2], (x, g), {}), (ops[2], (x, g, r), {"prenorm": True})]
    for op, args, kwargs in calls:
        op.requires_grad_(False)
        assert op.forward_method_name == "forward_tpu"
        expected = op.forward_native(*(a.clone() for a in args), **kwargs)
        op.to(dev)
        got = op(*(a.clone().to(dev) for a in args), **kwargs)
        op.to("cpu")
        got, expected = (got, expected) if isinstance(got, tuple) else ((got,), (expected,))
        for a, e in zip(got, expected):
            assert_close(a.cpu(), e, torch.bfloat16, what=op.name)
