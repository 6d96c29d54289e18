"""Norms family: RMSNorm (+ fused residual add), GemmaRMSNorm, RMSNormGated.

Every path is checked against float64 references written here (not forward_native), following
vLLM's rounding order where it is observable; then the in-place contracts, the forward_cuda wiring
(forced platform, reaching the library op's reference on CPU tensors), bad inputs, opcheck on each
``customop::`` norm op, torch.compile(fullgraph=True) and the conformance suite.
"""

from __future__ import annotations

import pytest
import torch

from customop.config import Config, use_config
from customop.ops.layernorm import GemmaRMSNorm, RMSNorm, RMSNormGated
from customop.testing import assert_close, assert_conforms, forced_platform, randn
from tests.backends.triton import references as refs

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 8), (7, 4231), (3, 5, 4096)]
#: The large shape runs forward_cpu only: its compiled code is what changes with size (row
#: parallelism, vector tails); eager native runs the same ATen kernels already parallel at 3x5x4096.
LARGE = (256, 8192)
#: compile=True (the caller compiles the op) re-runs one shape on forward_native only: every case
#: costs an Inductor compile, and inside a caller's compile forward_cpu traces the same math
#: (it skips its own compiled function there), so a second path would compile the same graph.
COMPILE_SHAPES = [(7, 4231)]
CASES = [(p, s, False) for p in ("forward_native", "forward_cpu") for s in SHAPES]
CASES += [("forward_cpu", LARGE, False)]
CASES += [("forward_native", s, True) for s in COMPILE_SHAPES]
VARIANTS = ["rms_norm", "fused_add_rms_norm", "gemma_rms_norm", "gemma_fused_add_rms_norm", "rms_norm_gated"]
GROUPS = 8  # rms_norm_gated in the base case normalises 8 groups when the hidden size allows it


# ---- float64 references -----------------------------------------------------------------------


def ref_rms_norm(x, weight, eps, residual=None, var_size=None):
    """(output in float64, new residual in x's dtype or None). The normalised value is rounded to
    the weight's dtype before the multiply (HF Llama); the product itself is exact in float64."""
    h = x.double() if residual is None else x.double() + residual.double()
    v = h if var_size is None else h[..., :var_size]
    y = h / torch.sqrt((v * v).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y.to(weight.dtype).double() * weight.double()
    return y, None if residual is None else h.to(x.dtype)


def ref_gemma(x, weight, eps, residual=None):
    h = x.double() if residual is None else x.double() + residual.double()
    return refs.ref_gemma(h, weight, eps), None if residual is None else h.to(x.dtype)


#: the gated norm's float64 reference is the one the kernel tests use
ref_gated = refs.ref_gated


# ---- helpers -------------------------------------------------------------------------------------


def build(cls, *args, weight_dtype=None, seed=0, custom_ops=("all",), **kwargs):
    """An enabled op with random weights (so a path that drops the weight fails)."""
    with use_config(Config(custom_ops=list(custom_ops))):
        op = cls(*args, **kwargs)
    op.requires_grad_(False)  # inference, as in vLLM; the kernel ops have no autograd formula
    if op.weight is not None:
        gen = torch.Generator().manual_seed(seed)
        w = randn(*op.weight.shape, generator=gen, scale=0.5) + (0.0 if cls is GemmaRMSNorm else 1.0)
        op.weight.data = w.to(weight_dtype or op.weight.dtype)
    return op


def make_case(variant, shape, dtype):
    """(op, call args, float64 expected output, expected new residual or None)."""
    h, gen = shape[-1], torch.Generator().manual_seed(1)
    x, other = randn(*shape, dtype=dtype, generator=gen), randn(*shape, dtype=dtype, generator=gen)
    if variant in ("rms_norm", "fused_add_rms_norm"):
        op = build(RMSNorm, h, dtype=dtype)
        residual = other if variant == "fused_add_rms_norm" else None
        out, res = ref_rms_norm(x, op.weight, op.eps, residual)
        return op, (x,) if residual is None else (x, residual), out, res
    if variant in ("gemma_rms_norm", "gemma_fused_add_rms_norm"):
        op = build(GemmaRMSNorm, h)
        residual = other if variant == "gemma_fused_add_rms_norm" else None
        out, res = ref_gemma(x, op.weight, op.eps, residual)
        return op, (x,) if residual is None else (x, residual), out, res
    group = h // GROUPS if h % GROUPS == 0 and h >= 64 else None
    op = build(RMSNormGated, h, group_size=group, dtype=dtype)
    return op, (x, other), ref_gated(x, op.weight, other, op.eps, op.group_size, False, False), None


def check_result(got, expected_out, expected_residual, dtype):
    if expected_residual is None:
        assert got.dtype == dtype
        assert_close(got, expected_out, dtype)
        return
    out, residual = got
    assert out.dtype == residual.dtype == dtype
    assert_close(out, expected_out, dtype, what="out")
    # The fp32 sum of two inputs rounds once to x's dtype: the new residual is exact.
    assert_close(residual, expected_residual, dtype, atol=0, rtol=0, what="residual")


# ---- the parametrized base -------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("path,shape,compiled", CASES,
                         ids=[f"{p}-{'x'.join(map(str, s))}{'-torch_compile' if c else ''}" for p, s, c in CASES])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64_reference(variant, path, shape, compiled, dtype):
    op, args, expected_out, expected_residual = make_case(variant, shape, dtype)
    fn = getattr(op, path)
    if compiled:
        fn = torch.compile(fn, fullgraph=True)
    inputs = [a.clone() for a in args]
    check_result(fn(*args), expected_out, expected_residual, dtype)
    for before, after in zip(inputs, args):  # native and CPU paths never write into their inputs
        assert torch.equal(before, after)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_rms_norm_multiplies_in_weight_dtype(dtype):
    """HF Llama rounds the normalised value to the weight dtype, then multiplies in that dtype.
    Matching that order bit for bit (up to rare double-rounding ties) must hold, and multiplying in
    fp32 instead must visibly differ, or this test could not tell the orders apart."""
    gen = torch.Generator().manual_seed(3)
    x = randn(64, 512, dtype=dtype, generator=gen)
    op = build(RMSNorm, 512, dtype=dtype)
    y64 = x.double() / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + op.eps)
    weight_order = (y64.to(dtype) * op.weight).to(dtype)
    fp32_order = (y64.float() * op.weight.float()).to(dtype)
    for got in (op.forward_native(x), op.forward_cpu(x)):
        assert (got == weight_order).float().mean() > 0.995
    assert (fp32_order != weight_order).float().mean() > 0.02


# ---- variants outside the base -------------------------------------------------------------------


@pytest.mark.parametrize("path", ["forward_native", "forward_cpu", "forward_cuda"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_var_hidden_size_and_no_weight(path, with_residual):
    x, residual = randn(3, 4, 96, dtype=torch.bfloat16), randn(3, 4, 96, dtype=torch.bfloat16)
    extra = (residual,) if with_residual else ()
    for op, weight, var_size in (
        (build(RMSNorm, 96, var_hidden_size=64, dtype=torch.bfloat16), True, 64),
        (build(RMSNorm, 96, has_weight=False), False, None),
        (build(RMSNorm, 96, var_hidden_size=96, dtype=torch.bfloat16), True, None),  # == hidden: plain
    ):
        assert (op.weight is not None) == weight and op.variance_size_override == var_size
        expected_out, expected_res = ref_rms_norm(x, op.weight, op.eps, residual if with_residual else None, var_size)
        got = getattr(op, path)(x.clone(), *(r.clone() for r in extra))
        check_result(got, expected_out, expected_res, torch.bfloat16)


@pytest.mark.parametrize("path", ["forward_native", "forward_cpu", "forward_cuda"])
@pytest.mark.parametrize("group_size", [None, 16])
@pytest.mark.parametrize("norm_before_gate", [False, True])
@pytest.mark.parametrize("activation", ["swish", "silu", "sigmoid"])
@pytest.mark.parametrize("with_z", [False, True])
def test_rms_norm_gated_variants(path, group_size, norm_before_gate, activation, with_z):
    x, z = randn(2, 3, 64, dtype=torch.bfloat16), randn(2, 3, 64, dtype=torch.bfloat16, scale=2.0)
    op = build(RMSNormGated, 64, group_size=group_size, norm_before_gate=norm_before_gate,
               activation=activation, dtype=torch.bfloat16)
    expected = ref_gated(x, op.weight, z if with_z else None, op.eps, group_size or 64,
                         norm_before_gate, activation == "sigmoid")
    got = getattr(op, path)(x, *((z,) if with_z else ()))
    assert_close(got, expected, torch.bfloat16)


def test_gated_constructor_defaults():
    op = RMSNormGated(32)
    assert (op.eps, op.group_size, op.norm_before_gate, op.activation) == (1e-5, 32, False, "swish")
    assert torch.equal(op.weight, torch.ones(32))


def test_weight_init_and_defaults():
    assert torch.equal(RMSNorm(16).weight, torch.ones(16)) and RMSNorm(16).eps == 1e-6
    assert RMSNorm(16, dtype=torch.bfloat16).weight.dtype == torch.bfloat16
    assert torch.equal(GemmaRMSNorm(16).weight, torch.zeros(16)) and GemmaRMSNorm(16).eps == 1e-6
    for cls, name in ((RMSNorm, "rms_norm"), (GemmaRMSNorm, "gemma_rms_norm"), (RMSNormGated, "rms_norm_gated")):
        assert cls.name == name


# ---- in-place contracts ----------------------------------------------------------------------------

FUSED = [(RMSNorm, "fused_add_rms_norm"), (GemmaRMSNorm, "gemma_fused_add_rms_norm")]


@pytest.mark.parametrize("cls,variant", FUSED, ids=["rms_norm", "gemma_rms_norm"])
@pytest.mark.parametrize("platform", ["cuda", "xpu"])
def test_kernel_path_mutates_inputs_and_returns_them(cls, variant, platform):
    op, (x, residual), expected_out, expected_res = make_case(variant, (5, 3, 256), torch.bfloat16)
    with forced_platform(platform), use_config(Config(custom_ops=[f"+{cls.name}"])):
        op.dispatch_forward()  # explicitly enabled: runs forward_<platform> with no device present
        assert op.forward_method_name == f"forward_{platform}"
        out, new_residual = op(x, residual)
    assert out is x and new_residual is residual  # written in place, the same tensors returned
    check_result((x, residual), expected_out, expected_res, torch.bfloat16)


@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm], ids=["rms_norm", "gemma_rms_norm"])
def test_kernel_path_non_contiguous_rows_still_correct(cls):
    """A kernel needs unit-stride rows; a strided x is copied first, so the result lands in a new
    tensor (not in x) while residual is still updated in place: callers use the returned tensors."""
    x = randn(64, 6).t()  # shape (6, 64), last-dim stride 6
    residual = randn(6, 64)
    op = build(cls, 64)
    ref = ref_rms_norm if cls is RMSNorm else ref_gemma
    expected_out, expected_res = ref(x, op.weight, op.eps, residual)
    x_before = x.clone()
    out, new_residual = op.forward_cuda(x, residual)
    check_result((out, new_residual), expected_out, expected_res, torch.float32)
    assert torch.equal(x, x_before) and new_residual is residual


def test_fused_mixed_weight_dtype_and_var_hidden_size_run_native():
    """The fused kernel needs weight.dtype == x.dtype and no variance override: otherwise
    forward_cuda is forward_native (new tensors, inputs untouched)."""
    x, residual = randn(4, 128, dtype=torch.bfloat16), randn(4, 128, dtype=torch.bfloat16)
    for op in (build(RMSNorm, 128, weight_dtype=torch.float32), build(RMSNorm, 128, var_hidden_size=100, dtype=torch.bfloat16)):
        xb, rb = x.clone(), residual.clone()
        out, new_residual = op.forward_cuda(xb, rb)
        assert out is not xb and new_residual is not rb
        assert torch.equal(xb, x) and torch.equal(rb, residual)
        expected_out, expected_res = ref_rms_norm(x, op.weight, op.eps, residual, op.variance_size_override)
        check_result((out, new_residual), expected_out, expected_res, torch.bfloat16)
    # Without a residual the kernel op takes a weight of another dtype.
    op = build(RMSNorm, 128, weight_dtype=torch.float32)
    assert_close(op.forward_cuda(x), ref_rms_norm(x, op.weight, op.eps)[0], torch.bfloat16)


@pytest.mark.parametrize("cls,variant", FUSED, ids=["rms_norm", "gemma_rms_norm"])
def test_kernel_path_in_place_survives_compile(cls, variant):
    """Under torch.compile the mutating op is functionalized; the writes must still reach x and
    residual."""
    op, (x, residual), expected_out, expected_res = make_case(variant, (4, 128), torch.float32)
    out, new_residual = torch.compile(op.forward_cuda, fullgraph=True)(x, residual)
    check_result((out, new_residual), expected_out, expected_res, torch.float32)
    check_result((x, residual), expected_out, expected_res, torch.float32)


# ---- bad inputs ----------------------------------------------------------------------------------


def _bad_rms_inputs():
    x = randn(4, 64)
    yield "x must be a floating-point", TypeError, RMSNorm, {}, (x.int(),)
    yield "x has shape", ValueError, RMSNorm, {}, (randn(4, 65),)
    yield "weight has shape", ValueError, RMSNorm, {"weight": torch.ones(32)}, (x,)
    yield "weight must be a floating-point", TypeError, RMSNorm, {"weight": torch.ones(64, dtype=torch.int32)}, (x,)
    yield "weight is on meta", ValueError, RMSNorm, {"weight": torch.ones(64, device="meta")}, (x,)
    yield "residual is on meta", ValueError, RMSNorm, {}, (x, torch.ones(4, 64, device="meta"))
    yield "residual has shape", ValueError, RMSNorm, {}, (x, randn(2, 64))
    yield "residual has dtype", TypeError, RMSNorm, {}, (x, randn(4, 64, dtype=torch.bfloat16))
    yield "residual must be a floating-point", TypeError, GemmaRMSNorm, {}, (x, x.long())
    yield "weight has shape", ValueError, GemmaRMSNorm, {"weight": torch.ones(65)}, (x,)
    yield "z has shape", ValueError, RMSNormGated, {}, (x, randn(4, 32))
    yield "z is on meta", ValueError, RMSNormGated, {}, (x, torch.ones(4, 64, device="meta"))
    yield "x has shape", ValueError, RMSNormGated, {}, (randn(4, 32), None)


@pytest.mark.parametrize("path", ["forward_cuda", "forward_xpu"])
@pytest.mark.parametrize("message,error,cls,state,args", list(_bad_rms_inputs()),
                         ids=lambda v: v.replace(" ", "_") if isinstance(v, str) else None)
def test_bad_inputs_name_op_and_argument(path, message, error, cls, state, args):
    op = cls(64)
    for key, value in state.items():
        setattr(op, key, torch.nn.Parameter(value, requires_grad=False))
    with pytest.raises(error, match=f"customop.{cls.name}: {message}"):
        getattr(op, path)(*args)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="rms_norm_gated: group_size=24 must divide hidden_size=64"):
        RMSNormGated(64, group_size=24)
    with pytest.raises(ValueError, match="rms_norm_gated: activation='gelu'"):
        RMSNormGated(64, activation="gelu")
    with pytest.raises(ValueError, match="rms_norm: var_hidden_size=80"):
        RMSNorm(64, var_hidden_size=80)


# ---- torch.library: schemas, opcheck, compile ------------------------------------------------------

SCHEMAS = {
    "rms_norm": "customop::rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor",
    "fused_add_rms_norm": "customop::fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor? weight, float eps) -> ()",
    "gemma_rms_norm": "customop::gemma_rms_norm(Tensor x, Tensor weight, float eps) -> Tensor",
    "gemma_fused_add_rms_norm": "customop::gemma_fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()",
    "rms_norm_gated": "customop::rms_norm_gated(Tensor x, Tensor weight, Tensor? z, float eps, int group_size, bool norm_before_gate, bool sigmoid) -> Tensor",
}


def test_schemas_are_the_backend_contract():
    for name, schema in SCHEMAS.items():
        assert str(getattr(torch.ops.customop, name).default._schema) == schema


def _opcheck_samples():
    x3, r3 = randn(2, 3, 48), randn(2, 3, 48)
    xb, rb, wb = randn(5, 40, dtype=torch.bfloat16), randn(5, 40, dtype=torch.bfloat16), randn(40, dtype=torch.bfloat16)
    w48 = randn(48)
    yield "rms_norm", (x3, w48, 1e-6)
    yield "rms_norm", (xb, None, 1e-5)
    yield "rms_norm", (xb, randn(40), 1e-6)  # fp32 weight on bf16 x
    yield "fused_add_rms_norm", (x3, r3, w48, 1e-6)
    yield "fused_add_rms_norm", (xb, rb, wb, 1e-6)
    yield "fused_add_rms_norm", (xb, rb, None, 1e-6)
    yield "gemma_rms_norm", (xb, randn(40), 1e-6)
    yield "gemma_fused_add_rms_norm", (x3, r3, w48, 1e-6)
    yield "rms_norm_gated", (x3, w48, r3, 1e-5, 16, False, False)
    yield "rms_norm_gated", (xb, wb, rb, 1e-5, 40, True, True)
    yield "rms_norm_gated", (x3, w48, None, 1e-5, 48, False, False)


@pytest.mark.parametrize("name,args", list(_opcheck_samples()), ids=lambda v: v if isinstance(v, str) else None)
def test_opcheck(name, args):
    torch.library.opcheck(getattr(torch.ops.customop, name).default, args)


@pytest.mark.parametrize("cls,call", [
    (RMSNorm, lambda op, x, r: op(x) + op(x, r)[0]),
    (GemmaRMSNorm, lambda op, x, r: op(x) + op(x, r)[1]),
    (RMSNormGated, lambda op, x, r: op(x, r) + op(x)),
], ids=["rms_norm", "gemma_rms_norm", "rms_norm_gated"])
@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_compiles_fullgraph_without_graph_break(cls, call, platform):
    """Dynamo must trace each path as one graph: the kernel ops (with the backend loaded at trace
    time) and the CPU path. The counting backend keeps this cheap (Inductor is covered above)."""
    counter = torch._dynamo.testing.CompileCounter()
    with forced_platform(platform):
        op = build(cls, 64, custom_ops=[f"+{cls.name}"])
    assert op.forward_method_name == f"forward_{platform}"
    x, r = randn(8, 64), randn(8, 64)
    expected = call(lambda *a: op.forward_native(*a), x.clone(), r.clone())
    # (The lambda's code object is shared by every case of this test: allow it more cache entries.)
    with torch._dynamo.config.patch(recompile_limit=64):
        got = torch.compile(lambda x, r: call(op, x, r), backend=counter, fullgraph=True)(x, r)
    assert_close(got, expected, torch.float32)
    assert counter.frame_count == 1 and counter.op_count > 0


# ---- conformance -------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm, RMSNormGated], ids=lambda c: c.name)
def test_conforms(cls):
    assert_conforms(cls)
