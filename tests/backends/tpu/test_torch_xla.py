"""The TPU backend's xla kernels on the XLA CPU device (the tpu tier: ``bash .ci/tpu.sh``).

Every row of the case tables (``customop/samples/<family>.py``, their ``"tpu"`` sizes) is built
with the TPU platform forced and run through its ``forward_tpu`` on XLA tensors, judged by the
float64 references of ``tests/cases``: the xla kernel must run where the row's ``customop::`` op
has one, and the reference body, fused by XLA with no CPU fallback, where it has none. A new
row is tested here with no edit of this file.

Then what is the backend's own, with ``torch.ops.customop.<op>`` on XLA tensors against the same
op on CPU copies (its reference body): the backward ops (``jax.vjp``), argument values the tables
do not hold, the per-argument fallbacks, the in-place ops on views, backward through the
functional norms and the op classes, ``torch.compile(backend="openxla", fullgraph=True)``
(inference and training) and ``torch.library.opcheck`` on XLA tensors. Pallas runs in interpret
mode here.
"""

from __future__ import annotations

import pytest
import torch

torch_xla = pytest.importorskip("torch_xla")
pytest.importorskip("torchax")

import torch_xla.debug.metrics as xla_metrics  # noqa: E402

import customop  # noqa: E402
from customop.backends.tpu import xla_kernels  # noqa: E402  (importing the backend registers the kernels)
from customop.math import layernorm as norm_spec  # noqa: E402
from customop.math.fp8 import fp8_max, fp8_min_scale  # noqa: E402
from customop.samples import activation as act_table  # noqa: E402
from customop.testing import assert_close, forced_platform  # noqa: E402
from tests.backends import kernel_cases  # noqa: E402

pytestmark = pytest.mark.xla

ops = torch.ops.customop
DTYPES = [torch.float32, torch.bfloat16]
FP8 = torch.float8_e4m3fn
FP8_MAX, MIN_SCALE = fp8_max(FP8), fp8_min_scale(FP8)


@pytest.fixture(scope="module")
def dev():
    return torch_xla.device()


@pytest.fixture
def calls(monkeypatch):
    """The JAX functions (``_jax``, which the Pallas path goes through too) and spec functions
    (``_spec``) the xla kernels ran, by name."""
    seen: list[str] = []
    jax_call, spec_call = xla_kernels._jax, xla_kernels._spec

    def counted_jax(fn, *args, **statics):
        seen.append(fn.__qualname__)
        return jax_call(fn, *args, **statics)

    def counted_spec(fn, *args):
        seen.append("spec:" + fn.__name__)
        return spec_call(fn, *args)

    monkeypatch.setattr(xla_kernels, "_jax", counted_jax)
    monkeypatch.setattr(xla_kernels, "_spec", counted_spec)
    return seen


def rand(*shape, dtype=torch.float32, seed=1, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def leaf(t, device):
    """A fresh leaf that requires grad (``.to`` may return ``t`` itself, or a non-leaf)."""
    return t.detach().clone().to(device).requires_grad_()


def on(dev, *tensors):
    return tuple(t.to(dev) if isinstance(t, torch.Tensor) else t for t in tensors)


def cpu(out):
    return tuple(cpu(o) for o in out) if isinstance(out, (tuple, list)) else (None if out is None else out.cpu())


def check(actual, expected, what="output"):
    """Under the expected dtype's tolerance; fp8 compared as values (one e4m3 ulp)."""
    if isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected), what
        for i, (a, e) in enumerate(zip(actual, expected)):
            check(a, e, f"{what}[{i}]")
        return
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, \
        f"{what}: {actual.dtype} {tuple(actual.shape)} vs {expected.dtype} {tuple(expected.shape)}"
    if expected.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        # one ulp: 2^-3 relative for e4m3 (3 mantissa bits), 2^-2 for e5m2
        assert_close(actual.float(), expected.float(), atol=1e-2, rtol=0.125 if expected.dtype == FP8 else 0.25,
                     what=what)
    else:
        assert not actual.isnan().any(), f"{what}: NaN (an unwritten lane?)"
        assert_close(actual, expected, expected.dtype, what=what)


def run_both(name, args, dev):
    """``ops.<name>`` on CPU clones (the reference) and on XLA copies; returns the results as
    CPU tensors: the outputs, or for an in-place op the tensors it writes."""
    op = getattr(ops, name).default
    written = [i for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    results = []
    for device in ("cpu", dev):
        call_args = [a.clone().to(device) if isinstance(a, torch.Tensor) else a for a in args]
        out = op(*call_args)
        if written:
            out = tuple(call_args[i] for i in written if call_args[i] is not None)
        results.append(cpu(out))
    return results


# ---- the case tables through forward_tpu --------------------------------------------------------------

#: the xla kernels that are Pallas or JAX code (fp32 inside, one rounding); the others are the
#: op's spec, functionalized, and round where it does
COMPUTED = set(xla_kernels.KERNELS) - set(xla_kernels.GATED_ACTIVATIONS)


#: rows whose forward_tpu is known to leave the XLA device or fuse badly: row label -> why
KNOWN = {
    "dynamic per-tensor padded 12": "QuantFP8's token padding runs aten::view_copy.dtype on the CPU (torch_xla 2.9)",
    "dynamic per-token padded 12": "QuantFP8's token padding runs aten::view_copy.dtype on the CPU (torch_xla 2.9)",
}


def _row_params():
    """Every row once, at the last "tpu" size in bf16: this tier checks the route (the kernel
    reached, nothing on the CPU, XLA fusing what has no kernel); the kernels' numerics at every
    size and dtype are test_kernels.py's, in the main tier."""
    params = []
    for p in kernel_cases.params("tpu", dtypes=(torch.bfloat16,), last_only=True):
        why = KNOWN.get(p.values[0].case.label)
        params.append(p if why is None else pytest.param(*p.values, id=p.id, marks=pytest.mark.xfail(reason=why,
                                                                                                     strict=True)))
    return params


@pytest.mark.parametrize("row,dtype", _row_params())
def test_table_row_forward_tpu(row, dtype, dev, calls):
    with forced_platform("tpu"), customop.use_config(customop.Config(custom_ops=["all"])):
        op, args, kwargs = kernel_cases.make(row, dtype)
    assert op.forward_method_name == "forward_tpu"
    ref_op, before = kernel_cases.snapshot(op, args)
    xla_metrics.clear_all()
    with torch.no_grad():
        out = op.to(dev)(*on(dev, *args), **kwargs)
    if row.family == "activation":
        # elementwise: one fused pass. A view at an offset run inside an op lowers to a gather
        # (xla_kernels._spec says why the gated ops' kernel functionalizes their spec)
        assert "gather" not in torch_xla._XLAC._get_xla_tensors_hlo([out])
    kernel_cases.judge(row, ref_op, before, cpu(out), dtype, spec_rounding=row.library_op not in COMPUTED,
                       exact_fp8=False, strides=False)
    assert not xla_metrics.executed_fallback_ops(), "ran on the CPU"
    if row.library_op in xla_kernels.KERNELS:
        assert calls, f"forward_tpu did not reach the xla kernel of customop::{row.library_op}"
    else:
        assert calls == [], f"customop::{row.library_op} has no xla kernel, yet {calls} ran"


# ---- ops on XLA tensors vs their reference on CPU: what the tables do not hold ------------------------


def _norm_cases(rows, dtype):
    hidden = 128 if rows == 1 else 384
    x, r, z = rand(rows, hidden, dtype=dtype), rand(rows, hidden, dtype=dtype, seed=2), rand(rows, hidden, dtype=dtype,
                                                                                              seed=3)
    w = rand(hidden, dtype=dtype, seed=4, scale=0.5)
    return {
        # name: (op, args, the JAX function the kernel must run)
        "rms_norm": ("rms_norm", (x, w, 1e-6), "rms_norm"),
        "rms_norm-no-weight": ("rms_norm", (x, None, 1e-6), "rms_norm"),
        "rms_norm-fp32-weight": ("rms_norm", (x, w.float(), 1e-6), "rms_norm"),
        "fused_add_rms_norm": ("fused_add_rms_norm", (x, r, w, 1e-6), "rms_norm"),
        "gemma_rms_norm": ("gemma_rms_norm", (x, w, 1e-6), "gemma_rms_norm"),
        "gemma_fused_add_rms_norm": ("gemma_fused_add_rms_norm", (x, r, w, 1e-6), "gemma_rms_norm"),
        "rms_norm_gated": ("rms_norm_gated", (x, w, z, 1e-5, 128, False, False), "rms_norm_gated"),
        "rms_norm_gated-before-sigmoid": ("rms_norm_gated", (x, w, z, 1e-5, 128, True, True), "rms_norm_gated"),
        "rms_norm_gated-no-gate": ("rms_norm_gated", (x, w, None, 1e-5, hidden, False, False), "rms_norm_gated"),
        "rms_norm_backward": ("rms_norm_backward", (z, x, w, 1e-6), "rms_norm_vjp"),
        "rms_norm_backward-no-weight": ("rms_norm_backward", (z, x, None, 1e-6), "rms_norm_vjp"),
        "gemma_rms_norm_backward": ("gemma_rms_norm_backward", (z, x, w, 1e-6), "rms_norm_vjp"),
        "rms_norm_gated_backward": ("rms_norm_gated_backward", (z, x, w, r, 1e-5, 128, False, False),
                                    "rms_norm_gated_vjp"),
        "rms_norm_gated_backward-before": ("rms_norm_gated_backward", (z, x, w, r, 1e-5, 128, True, True),
                                           "rms_norm_gated_vjp"),
    }


def _rotary_cases(rows, dtype):
    positions = torch.randint(0, 64, (rows,), generator=torch.Generator().manual_seed(5))
    q, k = rand(rows, 4 * 128, dtype=dtype), rand(rows, 2 * 128, dtype=dtype, seed=2)
    return {
        "rotary-neox": ("rotary_embedding", (positions, q, k, 128, rand(64, 128, dtype=dtype, seed=6), True), "_rotate"),
        "rotary-gptj-partial-no-key": ("rotary_embedding", (positions, q, None, 128, rand(64, 64, dtype=dtype, seed=6),
                                                            False), "_rotate"),
    }


def _quant_cases(rows, dtype):
    hidden = 256 if rows == 1 else 384
    x = rand(rows, hidden, dtype=dtype, scale=3.0)
    x[0, :7] = 0  # partly zero: scale_ub and the min scale get exercised below
    return {
        "dynamic_scaled_fp8_quant": ("dynamic_scaled_fp8_quant", (x, FP8, FP8_MAX, MIN_SCALE), "per_tensor_quant_fp8"),
        "dynamic_per_token": ("dynamic_per_token_scaled_fp8_quant", (x, None, FP8, FP8_MAX, MIN_SCALE),
                              "per_token_quant_fp8"),
        "dynamic_per_token-ub": ("dynamic_per_token_scaled_fp8_quant", (x, torch.tensor([1.5]), FP8, FP8_MAX,
                                                                        MIN_SCALE), "per_token_quant_fp8"),
        "per_token_group": ("per_token_group_fp8_quant", (x, 128, False, False, FP8, FP8_MAX, MIN_SCALE),
                            "per_group_quant_fp8"),
        "per_token_group-ue8m0-column-major": ("per_token_group_fp8_quant", (x, 64, True, True, FP8, FP8_MAX,
                                                                              MIN_SCALE), "per_group_quant_fp8"),
        "per_token_group-224-bound": ("per_token_group_fp8_quant", (x, 128, False, False, FP8, 224.0, MIN_SCALE),
                                      "per_group_quant_fp8"),
        "dynamic_per_token-e5m2": ("dynamic_per_token_scaled_fp8_quant",
                                   (x, None, torch.float8_e5m2, fp8_max(torch.float8_e5m2),
                                    fp8_min_scale(torch.float8_e5m2)), "per_token_quant_fp8"),
    }


def _cases(rows, dtype):
    return {**_norm_cases(rows, dtype), **_rotary_cases(rows, dtype), **_quant_cases(rows, dtype)}


#: the backward ops and argument values no table row reaches (the tables run e4m3fn with its own
#: maximum, through the op classes' forward)
BEYOND_TABLES = [case for case in _cases(1, torch.float32)
                 if "backward" in case or case in ("dynamic_per_token-e5m2", "per_token_group-224-bound")]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("case", BEYOND_TABLES)
def test_kernel_vs_reference(case, rows, dtype, dev, calls, poison_empty):
    name, args, jax_fn = _cases(rows, dtype)[case]
    actual, expected = run_both(name, args, dev)[::-1]
    check(actual, expected, case)
    assert jax_fn in calls, f"{case}: the xla kernel did not run {jax_fn} (ran {calls})"


def _no_kernel_cases():
    """The ops without an xla kernel that no table row reaches through forward_tpu (the others are
    checked there): the fused norm-quant function."""
    x = rand(7, 384, scale=3.0)
    return {
        "rms_norm_dynamic_per_token_fp8_quant": (x, rand(384, seed=4), 1e-6, torch.tensor([2.0]), FP8, FP8_MAX,
                                                 MIN_SCALE),
    }


@pytest.mark.parametrize("name", list(_no_kernel_cases()))
def test_reference_runs_fused_on_xla(name, dev, calls):
    """Ops without an xla kernel: their reference body runs on XLA tensors (no CPU fallback, no
    gather) and matches the CPU run."""
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(f"customop::{name}", "XLA")
    args = _no_kernel_cases()[name]
    xla_metrics.clear_all()
    out = getattr(ops, name)(*on(dev, *args))
    outs = list(out) if isinstance(out, tuple) else [out]
    hlo = torch_xla._XLAC._get_xla_tensors_hlo(outs)
    assert "gather" not in hlo
    check(cpu(out), getattr(ops, name)(*args), name)
    assert not xla_metrics.executed_fallback_ops() and calls == []


@pytest.mark.parametrize("case", ["rms_norm", "fused_add_rms_norm", "rms_norm_gated", "rotary-neox",
                                  "dynamic_per_token", "per_token_group", "rms_norm_gated_backward"])
def test_unsupported_dtype_runs_the_spec(case, dev, calls):
    """The per-argument exception: float64 inputs (no kernel takes them) run the spec on XLA."""
    name, args, _ = {**_cases(7, torch.float32)}[case]
    args = tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    actual, expected = run_both(name, args, dev)[::-1]
    # the spec normalises float64 in float32 (.float()), on either device: float32's tolerance
    assert_close(actual, expected, torch.float32, what=case)
    assert calls and all(c.startswith("spec:") for c in calls)


def test_in_place_on_views(dev):
    """In-place ops write through views of a larger buffer (the caller's tensors are views)."""
    x, r, w = rand(7, 256), rand(7, 256, seed=2), rand(256, seed=3)
    expected_y, expected_h = norm_spec.fused_add_rms_norm(x, r, w, 1e-6)
    buf = torch.zeros(7, 512).to(dev)
    buf[:, 128:384] = x.to(dev)
    rd = r.to(dev)
    ops.fused_add_rms_norm(buf[:, 128:384], rd, w.to(dev), 1e-6)
    out = buf.cpu()
    check(out[:, 128:384], expected_y)
    check(rd.cpu(), expected_h)
    assert not out[:, :128].any() and not out[:, 384:].any()

    positions, cache = torch.arange(7), rand(16, 64, seed=4)
    qkv = rand(7, 3 * 128, seed=5)
    q_expected = qkv[:, :128].clone()
    ops.rotary_embedding(positions, q_expected, None, 64, cache, True)
    qkv_xla = qkv.to(dev)
    ops.rotary_embedding(positions.to(dev), qkv_xla[:, :128], None, 64, cache.to(dev), True)
    check(qkv_xla.cpu()[:, :128], q_expected)
    check(qkv_xla.cpu()[:, 128:], qkv[:, 128:])


def test_in_place_refuses_recording_autograd(dev):
    x = rand(2, 128).to(dev).requires_grad_()
    with pytest.raises(RuntimeError, match="no autograd formula"):
        ops.fused_add_rms_norm(x * 1, rand(2, 128).to(dev).requires_grad_(), None, 1e-6)


# ---- backward through the functional norm ops ----------------------------------------------------


BACKWARD = {
    "rms_norm": (ops.rms_norm, norm_spec.rms_norm, ("x", "w"), (1e-6,), "rms_norm_vjp"),
    "rms_norm-no-weight": (ops.rms_norm, norm_spec.rms_norm, ("x", None), (1e-6,), "rms_norm_vjp"),
    "gemma_rms_norm": (ops.gemma_rms_norm, norm_spec.gemma_rms_norm, ("x", "w"), (1e-6,), "rms_norm_vjp"),
    "rms_norm_gated": (ops.rms_norm_gated, norm_spec.rms_norm_gated, ("x", "w", "z"), (1e-5, 128, False, False),
                       "rms_norm_gated_vjp"),
    "rms_norm_gated-before-sigmoid": (ops.rms_norm_gated, norm_spec.rms_norm_gated, ("x", "w", "z"),
                                      (1e-5, 128, True, True), "rms_norm_gated_vjp"),
    "rms_norm_gated-no-gate": (ops.rms_norm_gated, norm_spec.rms_norm_gated, ("x", "w", None),
                               (1e-5, 256, False, False), "rms_norm_gated_vjp"),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(BACKWARD))
def test_backward(case, dtype, dev, calls):
    """Gradients through the op on XLA (its backward op's xla kernel: the JAX vjp) vs
    torch.autograd through the spec on CPU."""
    op, spec, names, statics, vjp = BACKWARD[case]
    values = {"x": rand(7, 256, dtype=dtype), "w": rand(256, dtype=dtype, seed=4, scale=0.5) + 1,
              "z": rand(7, 256, dtype=dtype, seed=3)}
    grad_y = rand(7, 256, dtype=dtype, seed=9)
    grads = []
    for fn, device in ((spec, "cpu"), (op, dev)):
        leaves = [leaf(values[n], device) if n else None for n in names]
        fn(*leaves, *statics).backward(grad_y.to(device))
        grads.append([t.grad.cpu() for t in leaves if t is not None])
    check(grads[1], grads[0], f"{case} grads")
    assert vjp in calls


# ---- torch.compile(backend="openxla", fullgraph=True) ----------------------------------------------


def _compile_inputs():
    return dict(x=rand(7, 256), r=rand(7, 256, seed=2), w=rand(256, seed=3, scale=0.5), positions=torch.arange(7),
                q=rand(7, 2 * 128, seed=5), cache=rand(16, 128, seed=6))


def _step(x, r, w, positions, q, cache):
    h = ops.rms_norm(x, w, 1e-6)
    ops.fused_add_rms_norm(x, r, w, 1e-6)  # in place: x <- norm(x + r), r <- x + r
    ops.rotary_embedding(positions, q, None, 128, cache, True)  # in place
    act = ops.silu_and_mul(torch.cat([h, x], dim=-1))
    q8, s8 = ops.per_token_group_fp8_quant(q, 128, False, True, FP8, FP8_MAX, MIN_SCALE)
    _, s1 = ops.dynamic_per_token_scaled_fp8_quant(act, None, FP8, FP8_MAX, MIN_SCALE)
    _, s0 = ops.dynamic_scaled_fp8_quant(h, FP8, FP8_MAX, MIN_SCALE)
    g = ops.gemma_rms_norm(h, w, 1e-6) + ops.rms_norm_gated(h, w, x, 1e-5, 128, False, False)
    return h, act, q8.float(), s8, s1, s0, g


def test_openxla_fullgraph_compile(dev, calls):
    """Every kind of op (Pallas, fused JAX, functionalized spec, in place) in one graph."""
    cpu_in = _compile_inputs()
    expected = _step(**cpu_in)
    xla_in = {k: v.to(dev) for k, v in _compile_inputs().items()}
    actual = cpu(torch.compile(_step, backend="openxla", fullgraph=True)(**xla_in))
    check(actual, expected, "outputs")
    check(cpu((xla_in["x"], xla_in["r"], xla_in["q"])), (cpu_in["x"], cpu_in["r"], cpu_in["q"]), "written inputs")
    assert {"rms_norm", "_rotate", "per_group_quant_fp8", "spec:silu_and_mul"} <= set(calls)


def test_openxla_fullgraph_compile_training(dev, calls):
    """Training: AOTAutograd's joint graph with the backward ops, under openxla."""
    x, w, z = rand(7, 256), rand(256, seed=3, scale=0.5) + 1, rand(7, 256, seed=4)
    weights = torch.arange(256.0)

    def loss(x, w, z):
        return ((ops.rms_norm(x, w, 1e-6) + ops.gemma_rms_norm(x, w, 1e-6)) * weights.to(x.device)).sum() \
            + ops.rms_norm_gated(x, w, z, 1e-5, 128, True, False).square().sum()

    grads = []
    for fn, device in ((loss, "cpu"), (torch.compile(loss, backend="openxla", fullgraph=True), dev)):
        leaves = [leaf(t, device) for t in (x, w, z)]
        fn(*leaves).backward()
        grads.append(cpu([t.grad for t in leaves]))
    # w's gradient sums 7 rows of terms up to ~255 |x| (the loss weights): CPU and XLA add them in
    # different orders, so the difference is bounded by the terms' size, not the (possibly near
    # zero) sum's: 8 fp32 ulps of the largest gradient, not of each element
    scale = max(g.abs().max().item() for g in grads[0])
    assert_close(grads[1], grads[0], atol=2 ** -23 * 8 * scale, rtol=1e-5, what="grads")
    assert {"rms_norm_vjp", "rms_norm_gated_vjp"} <= set(calls)


# ---- opcheck on XLA tensors --------------------------------------------------------------------------


def _opcheck_cases():
    cases = {case: (name, args) for case, (name, args, _) in _cases(7, torch.float32).items()}
    for case in act_table.CASES:  # each gated op with an xla kernel, with its first table row's arguments
        if case.op in xla_kernels.GATED_ACTIVATIONS and case.op not in cases:
            cases[case.op] = (case.op, (rand(7, 2 * 384), *case.build().math_args()))
    return cases


@pytest.mark.parametrize("case", list(_opcheck_cases()))
def test_opcheck(case, dev):
    """Schema (incl. which arguments are written), fake and AOT dispatch of every op with an xla
    kernel, on XLA tensors; opcheck's autograd-registration check does not take XLA tensors (the
    backward tests above cover autograd)."""
    name, args = _opcheck_cases()[case]
    torch.library.opcheck(getattr(ops, name).default, on(dev, *args),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


# ---- the op classes' forward_tpu ---------------------------------------------------------------------


def build(op_cls, *args, **kwargs):
    """The op as forward_tpu dispatches it (TPU platform forced, every op enabled)."""
    with forced_platform("tpu"), customop.use_config(customop.Config(custom_ops=["all"])):
        op = op_cls(*args, **kwargs)
    assert op.forward_method_name == "forward_tpu"
    return op


def _randomized(op, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in op.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5 + 1.0)
    return op


def test_op_class_without_kernel_runs_native_on_xla(dev, calls):
    """RMSNorm's variance over the first lanes (no table row: forward_kernel runs the spec)."""
    from customop.ops.layernorm import RMSNorm

    op, x = _randomized(build(RMSNorm, 256, var_hidden_size=100)), rand(7, 256)
    with torch.no_grad():
        expected = op.forward_native(x)
        check(cpu(op.to(dev)(x.to(dev))), expected, "var_hidden_size")
    assert calls == []


def test_op_class_backward(dev):
    """Training through RMSNorm on XLA: the functional op's registered backward; with the fused
    residual the op class runs forward_native while autograd records (no formula for in place)."""
    from customop.ops.layernorm import RMSNorm

    x, r = rand(7, 256), rand(7, 256, seed=2)
    grads = []
    for device in ("cpu", dev):
        op = _randomized(build(RMSNorm, 256)).to(device)
        leaves = [leaf(t, device) for t in (x, r)]
        forward = op.forward_native if device == "cpu" else op
        y = forward(leaves[0])
        y2, h = forward(y, leaves[1])
        (y2.sum() + (h * 2).sum()).backward()
        grads.append(cpu([leaves[0].grad, leaves[1].grad, op.weight.grad]))
    check(grads[1], grads[0], "grads")


def test_rms_norm_quant_fp8_on_xla(dev):
    from customop.ops.quantization import rms_norm_quant_fp8

    x, w = rand(7, 256, scale=3.0), rand(256, seed=2)
    with forced_platform("tpu"):
        expected = rms_norm_quant_fp8(x, w, 1e-6)
        check(cpu(rms_norm_quant_fp8(x.to(dev), w.to(dev), 1e-6)), expected)


def test_op_classes_compile(dev):
    """The op classes' forward_tpu under openxla, fullgraph, against forward_native on CPU."""
    from customop.ops.layernorm import RMSNorm
    from customop.ops.quantization import QuantFP8
    from customop.ops.rotary_embedding import RotaryEmbedding

    norm = _randomized(build(RMSNorm, 256))
    rope = build(RotaryEmbedding, 128, 128, 64, 10000.0, True, torch.float32)
    quant = build(QuantFP8, False, (1, 128))
    x, r, positions = rand(7, 256), rand(7, 256, seed=2), torch.arange(7)
    with torch.no_grad():
        h, r_ref = norm.forward_native(x, r)
        expected = quant.forward_native(rope.forward_native(positions, h)[0])[1], r_ref

        def step(x, r, positions):
            h, r = norm(x, r)
            return quant(rope(positions, h)[0])[1], r

        for m in (norm, rope, quant):
            m.to(dev)
        actual = cpu(torch.compile(step, backend="openxla", fullgraph=True)(*on(dev, x, r, positions)))
    check(actual, expected)


@pytest.mark.tpu_hw
def test_on_a_real_tpu(dev):
    """On a TPU: JAX must see the TPU too (else call_jax would lower for CPU), and Mosaic runs."""
    import jax
    import torch_xla.runtime as xr

    if xr.device_type() != "TPU":
        pytest.skip("needs a real TPU")
    assert jax.default_backend() == "tpu"
    x, w = rand(64, 1024, dtype=torch.bfloat16), rand(1024, dtype=torch.bfloat16, seed=2)
    check(ops.rms_norm(x.to(dev), w.to(dev), 1e-6).cpu(), ops.rms_norm(x, w, 1e-6))
