"""Norms family: every case of the table (``customop/samples/layernorm.py``) on forward_native and
forward_cpu against the float64 references (``tests/cases/layernorm.py``, vLLM's rounding order
where it is observable), forward_kernel's wiring (reaching the library op's reference on CPU
tensors) and the compiled paths; then the in-place contracts, the forward_cuda wiring (forced
platform), bad inputs, opcheck on each ``customop::`` norm op, torch.compile(fullgraph=True) and
the conformance suite.
"""

from __future__ import annotations

import math

import pytest
import torch

from customop.config import Config, use_config
from customop.ops.layernorm import (
    FusedRMSNormGated, GemmaRMSNorm, LayerNorm, NemotronLayerNorm1P, RMSNorm, RMSNormGated,
)
from customop.samples.layernorm import BY_LABEL, CASES, DTYPES, SIZES, NormCase
from customop.testing import assert_close, assert_conforms, forced_platform, randn
from tests.cases.layernorm import assert_matches, ref_fused_add, ref_rms_norm, reference

#: The large shape runs forward_cpu only: its compiled code is what changes with size (row
#: parallelism, vector tails); eager native runs the same ATen kernels.
LARGE = (256, 8192)
#: compile=True (the caller compiles the op) re-runs one shape on forward_native only: every case
#: costs an Inductor compile, and inside a caller's compile forward_cpu traces the same math
#: (it skips its own compiled function there), so a second path would compile the same graph.
COMPILE_SHAPE = (7, 4231)


def shape_id(shape) -> str:
    return "x".join(map(str, shape))


def build(case: NormCase, hidden: int, dtype: torch.dtype, custom_ops=("all",), **kwargs):
    """An enabled op with the row's random weight (so a path that drops the weight fails)."""
    with use_config(Config(custom_ops=list(custom_ops))):
        return case.build(hidden, dtype, torch.Generator().manual_seed(0), **kwargs)


def make_case(case: NormCase, shape, dtype):
    """(op, call args, expected (float64 output, float64 new residual or None))."""
    op = build(case, shape[-1], dtype)
    args = case.inputs(shape, dtype, generator=torch.Generator().manual_seed(1))
    return op, args, reference(case, op, *args)


def run_and_check(case, path, shape, dtype, compiled=False):
    op, args, expected = make_case(case, shape, dtype)
    if not case.base:  # forward_cpu stays eager: a compile per row and dtype is the base rows' cost
        op.cpu_tiers = op.cpu_tiers.compiling_from(math.inf)
    fn = getattr(op, path)
    if compiled:
        fn = torch.compile(fn, fullgraph=True)
    inputs = [a.clone() for a in args]
    assert_matches(fn(*args, **case.call_kwargs), expected, dtype, exact_residual=True, what=case.label)
    for before, after in zip(inputs, args):  # native and CPU paths never write into their inputs
        assert torch.equal(before, after)


# ---- the table: every case, size and dtype ---------------------------------------------------
# forward_cpu with the shipped thresholds on the base rows (7x4231 in bf16/fp16 is compiled), eager
# on the others; the compiled paths of the base rows at a large size and under torch.compile below.

PARAMS = [pytest.param(c, s, id=f"{c.label}-{shape_id(s)}") for c in CASES for s in SIZES["small"]]
BASE = [c for c in CASES if c.base]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", ["forward_native", "forward_cpu"])
@pytest.mark.parametrize("case,shape", PARAMS)
def test_matches_float64_reference(case, shape, path, dtype):
    run_and_check(case, path, shape, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path,shape,compiled", [("forward_cpu", LARGE, False), ("forward_native", COMPILE_SHAPE, True)],
                         ids=[f"forward_cpu-{shape_id(LARGE)}", f"forward_native-{shape_id(COMPILE_SHAPE)}-torch_compile"])
@pytest.mark.parametrize("case", BASE, ids=lambda c: c.label)
def test_compiled_paths_match_float64_reference(case, path, shape, compiled, dtype):
    run_and_check(case, path, shape, dtype, compiled)


@pytest.mark.parametrize("case,shape", PARAMS)
def test_forward_kernel_wiring(case, shape):
    """forward_kernel (what forward_cuda/_xpu/_tpu run) on CPU tensors reaches the library op's
    reference: the arguments it builds give the right result, in place for the fused add."""
    op, args, expected = make_case(case, shape, torch.bfloat16)
    got = op.forward_kernel(*args, **case.call_kwargs)
    assert_matches(got, expected, torch.bfloat16, what=case.label)
    if case.in_place:
        assert got[0] is args[0] and got[1] is args[1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_rms_norm_multiplies_in_weight_dtype(dtype):
    """HF Llama rounds the normalised value to the weight dtype, then multiplies in that dtype.
    Matching that order bit for bit (up to rare double-rounding ties) must hold, and multiplying in
    fp32 instead must visibly differ, or this test could not tell the orders apart."""
    gen = torch.Generator().manual_seed(3)
    x = randn(64, 512, dtype=dtype, generator=gen)
    op = build(BY_LABEL["rms_norm"], 512, dtype)
    y64 = x.double() / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + op.eps)
    weight_order = (y64.to(dtype) * op.weight).to(dtype)
    fp32_order = (y64.float() * op.weight.float()).to(dtype)
    for got in (op.forward_native(x), op.forward_cpu(x)):
        assert (got == weight_order).float().mean() > 0.995
    assert (fp32_order != weight_order).float().mean() > 0.02


# ---- variants outside the table (forward_kernel runs the spec for them) --------------------------


def build_cls(cls, hidden, weight_dtype=None, custom_ops=("all",), **kwargs):
    """An enabled op of ``cls`` with a random weight (of ``weight_dtype`` if given)."""
    with use_config(Config(custom_ops=list(custom_ops))):
        op = cls(hidden, **kwargs)
    op.requires_grad_(False)
    if op.weight is not None:
        gen = torch.Generator().manual_seed(0)
        w = randn(*op.weight.shape, generator=gen, scale=0.5) + (0.0 if cls in (GemmaRMSNorm, NemotronLayerNorm1P) else 1.0)
        op.weight.data = w.to(weight_dtype or op.weight.dtype)
    return op


def rms_expected(x, op, residual=None):
    """``reference``'s pair for an RMSNorm outside the table (a variance subset, say)."""
    if residual is None:
        return ref_rms_norm(x, op.weight, op.eps, op.variance_size_override), None
    return ref_fused_add(x, residual, op.weight, op.eps, var_size=op.variance_size_override)


@pytest.mark.parametrize("path", ["forward_native", "forward_cpu", "forward_cuda"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_var_hidden_size_and_no_weight(path, with_residual):
    x, residual = randn(3, 4, 96, dtype=torch.bfloat16), randn(3, 4, 96, dtype=torch.bfloat16)
    extra = (residual,) if with_residual else ()
    for op, weight, var_size in (
        (build_cls(RMSNorm, 96, var_hidden_size=64, dtype=torch.bfloat16), True, 64),
        (build_cls(RMSNorm, 96, has_weight=False), False, None),
        (build_cls(RMSNorm, 96, var_hidden_size=96, dtype=torch.bfloat16), True, None),  # == hidden: plain
    ):
        assert (op.weight is not None) == weight and op.variance_size_override == var_size
        got = getattr(op, path)(x.clone(), *(r.clone() for r in extra))
        assert_matches(got, rms_expected(x, op, *extra), torch.bfloat16, exact_residual=True)


def test_gated_constructor_defaults():
    op = RMSNormGated(32)
    assert (op.eps, op.group_size, op.norm_before_gate, op.activation) == (1e-5, 32, False, "swish")
    assert torch.equal(op.weight, torch.ones(32))


def test_weight_init_and_defaults():
    assert torch.equal(RMSNorm(16).weight, torch.ones(16)) and RMSNorm(16).eps == 1e-6
    assert RMSNorm(16, dtype=torch.bfloat16).weight.dtype == torch.bfloat16
    assert torch.equal(GemmaRMSNorm(16).weight, torch.zeros(16)) and GemmaRMSNorm(16).eps == 1e-6
    for cls, name in ((RMSNorm, "rms_norm"), (GemmaRMSNorm, "gemma_rms_norm"), (RMSNormGated, "rms_norm_gated"),
                      (LayerNorm, "layer_norm"), (NemotronLayerNorm1P, "nemotron_layer_norm"),
                      (FusedRMSNormGated, "fused_rms_norm_gated")):
        assert cls.name == name


def test_the_table_covers_every_norm_op_and_kernel_entry():
    assert {case.op for case in CASES} == {"rms_norm", "gemma_rms_norm", "rms_norm_gated", "layer_norm",
                                           "nemotron_layer_norm", "fused_rms_norm_gated"}
    assert {case.library_op for case in CASES} == set(SCHEMAS)


# ---- in-place contracts ----------------------------------------------------------------------------

FUSED = [BY_LABEL["fused_add_rms_norm"], BY_LABEL["gemma_fused_add_rms_norm[x-dtype weight]"],
         BY_LABEL["fused_add_nemotron_layer_norm[x-dtype weight]"]]


@pytest.mark.parametrize("case", FUSED, ids=lambda c: c.op)
@pytest.mark.parametrize("platform", ["cuda", "xpu"])
def test_kernel_path_mutates_inputs_and_returns_them(case, platform):
    op, (x, residual), expected = make_case(case, (5, 3, 256), torch.bfloat16)
    with forced_platform(platform), use_config(Config(custom_ops=[f"+{case.op}"])):
        op.dispatch_forward()  # explicitly enabled: runs forward_<platform> with no device present
        assert op.forward_method_name == f"forward_{platform}"
        out, new_residual = op(x, residual)
    assert out is x and new_residual is residual  # written in place, the same tensors returned
    assert_matches((x, residual), expected, torch.bfloat16, exact_residual=True)


@pytest.mark.parametrize("case", FUSED, ids=lambda c: c.op)
def test_kernel_path_non_contiguous_rows_still_correct(case):
    """A kernel needs unit-stride rows; a strided x is copied first, so the result lands in a new
    tensor (not in x) while residual is still updated in place: callers use the returned tensors."""
    x = randn(64, 6).t()  # shape (6, 64), last-dim stride 6
    residual = randn(6, 64)
    op = build(case, 64, torch.float32)
    expected = reference(case, op, x, residual)
    x_before = x.clone()
    out, new_residual = op.forward_cuda(x, residual)
    assert_matches((out, new_residual), expected, torch.float32, exact_residual=True)
    assert torch.equal(x, x_before) and new_residual is residual


def test_fused_mixed_weight_dtype_and_var_hidden_size_run_native():
    """The fused kernel needs weight.dtype == x.dtype and no variance override: otherwise
    forward_cuda is forward_native (new tensors, inputs untouched)."""
    x, residual = randn(4, 128, dtype=torch.bfloat16), randn(4, 128, dtype=torch.bfloat16)
    for op in (build_cls(RMSNorm, 128, weight_dtype=torch.float32),
               build_cls(RMSNorm, 128, var_hidden_size=100, dtype=torch.bfloat16)):
        xb, rb = x.clone(), residual.clone()
        out, new_residual = op.forward_cuda(xb, rb)
        assert out is not xb and new_residual is not rb
        assert torch.equal(xb, x) and torch.equal(rb, residual)
        assert_matches((out, new_residual), rms_expected(x, op, residual), torch.bfloat16, exact_residual=True)
    # Without a residual the kernel op takes a weight of another dtype.
    op = build_cls(RMSNorm, 128, weight_dtype=torch.float32)
    assert_close(op.forward_cuda(x), ref_rms_norm(x, op.weight, op.eps), torch.bfloat16)


@pytest.mark.parametrize("case", FUSED, ids=lambda c: c.op)
def test_kernel_path_in_place_survives_compile(case):
    """Under torch.compile the mutating op is functionalized; the writes must still reach x and
    residual."""
    op, (x, residual), expected = make_case(case, (4, 128), torch.float32)
    out, new_residual = torch.compile(op.forward_cuda, fullgraph=True)(x, residual)
    assert_matches((out, new_residual), expected, torch.float32, exact_residual=True)
    assert_matches((x, residual), expected, torch.float32, exact_residual=True)


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
    "layer_norm": "customop::layer_norm(Tensor x, Tensor? weight, Tensor? bias, float eps) -> Tensor",
    "nemotron_layer_norm": "customop::nemotron_layer_norm(Tensor x, Tensor weight, Tensor? bias, float eps) -> Tensor",
    "fused_add_nemotron_layer_norm": "customop::fused_add_nemotron_layer_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, Tensor? bias, float eps) -> ()",
    "fused_rms_norm_gated": "customop::fused_rms_norm_gated(Tensor x, Tensor g, Tensor? weight, float eps, bool sigmoid) -> Tensor",
    "fused_add_rms_norm_gated": "customop::fused_add_rms_norm_gated(Tensor x, Tensor g, Tensor residual, Tensor? weight, float eps, bool sigmoid) -> (Tensor, Tensor)",
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
    yield "layer_norm", (x3, w48, randn(48), 1e-5)
    yield "layer_norm", (xb, randn(40), None, 1e-5)  # fp32 weight on bf16 x
    yield "layer_norm", (xb, None, None, 1e-5)
    yield "nemotron_layer_norm", (xb, wb, randn(40, dtype=torch.bfloat16), 1e-5)
    yield "fused_add_nemotron_layer_norm", (x3, r3, w48, randn(48), 1e-5)
    yield "fused_add_nemotron_layer_norm", (xb, rb, randn(40), None, 1e-5)
    yield "fused_rms_norm_gated", (x3, r3, w48, 1e-5, False)
    yield "fused_rms_norm_gated", (xb, rb, None, 1e-5, True)
    yield "fused_add_rms_norm_gated", (xb, rb, randn(5, 40), wb, 1e-5, False)  # fp32 residual


@pytest.mark.parametrize("name,args", list(_opcheck_samples()), ids=lambda v: v if isinstance(v, str) else None)
def test_opcheck(name, args):
    torch.library.opcheck(getattr(torch.ops.customop, name).default, args)


@pytest.mark.parametrize("cls,call", [
    (RMSNorm, lambda op, x, r: op(x) + op(x, r)[0]),
    (GemmaRMSNorm, lambda op, x, r: op(x) + op(x, r)[1]),
    (RMSNormGated, lambda op, x, r: op(x, r) + op(x)),
    (LayerNorm, lambda op, x, r: op(x) + r),
    (NemotronLayerNorm1P, lambda op, x, r: op(x) + op(x, r)[0]),
    (FusedRMSNormGated, lambda op, x, r: op(x, r) + op(x, r, r, True)[1]),
], ids=["rms_norm", "gemma_rms_norm", "rms_norm_gated", "layer_norm", "nemotron_layer_norm", "fused_rms_norm_gated"])
@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_compiles_fullgraph_without_graph_break(cls, call, platform):
    """Dynamo must trace each path as one graph: the kernel ops (with the backend loaded at trace
    time) and the CPU path. The counting backend keeps this cheap (Inductor is covered above)."""
    counter = torch._dynamo.testing.CompileCounter()
    with forced_platform(platform):
        op = build_cls(cls, 64, custom_ops=[f"+{cls.name}"])
    assert op.forward_method_name == f"forward_{platform}"
    x, r = randn(8, 64), randn(8, 64)
    expected = call(lambda *a: op.forward_native(*a), x.clone(), r.clone())
    # (The lambda's code object is shared by every case of this test: allow it more cache entries.)
    with torch._dynamo.config.patch(recompile_limit=64):
        got = torch.compile(lambda x, r: call(op, x, r), backend=counter, fullgraph=True)(x, r)
    assert_close(got, expected, torch.float32)
    assert counter.frame_count == 1 and counter.op_count > 0


# ---- conformance -------------------------------------------------------------------------------------


@pytest.mark.slow  # the base rows' check samples cross forward_cpu's compile threshold
@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm, RMSNormGated, LayerNorm, NemotronLayerNorm1P,
                                 FusedRMSNormGated], ids=lambda c: c.name)
def test_conforms(cls):
    assert_conforms(cls)
