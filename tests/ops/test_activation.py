"""Activation family: each case of the table (``customop/samples/activation.py``) on
forward_native and forward_cpu against its float64 reference (``tests/cases/activation.py``), the
library ops (opcheck, fake shapes, the path forward_cuda takes), torch.compile without graph
breaks, input checks, and the factories."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounter
from torch.utils._python_dispatch import TorchDispatchMode

from customop import Config, CustomOp, use_config
from customop.ops import activation as act
from customop.samples.activation import BY_LABEL, CASES, DTYPES, ActivationCase
from customop.testing import assert_close, assert_conforms, forced_platform, randn
from tests.cases.activation import assert_matches, reference, spec_slack

#: the native and CPU paths' sizes: the table's "small" ones (odd widths, one row, a 3-D input)
SIZE = "small"


def build(case: ActivationCase) -> CustomOp:
    with use_config(Config(custom_ops=["all"])):
        return case.build()


def set_cpu_threshold(monkeypatch, op: CustomOp, numel: float) -> None:
    """forward_cpu compiles from ``numel`` elements, for every dtype the op distinguishes."""
    monkeypatch.setattr(op, "cpu_tiers", op.cpu_tiers.compiling_from(numel))


def check(case: ActivationCase, op: CustomOp, x: torch.Tensor, out: torch.Tensor,
          expected: torch.Tensor | None = None) -> None:
    """A path that runs the spec's math: the reference plus the spec's rounding slack."""
    assert_matches(case, op, x, out, spec_rounding=True, expected=expected)


def shape_id(shape) -> str:
    return "x".join(map(str, shape))


PARAMS = [pytest.param(c, s, id=f"{c.label}-{shape_id(s)}") for c in CASES for s in c.shapes(SIZE)]


# ---- the parametrized base: native and the CPU path vs float64 ------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case,shape", PARAMS)
def test_native_and_cpu_eager_match_reference(case, shape, dtype, monkeypatch):
    op = build(case)
    set_cpu_threshold(monkeypatch, op, math.inf)  # compile off: forward_cpu stays eager
    x = case.input(shape, dtype)
    x_before = x.clone()
    expected = reference(case, x.double(), op)
    with torch.no_grad():
        check(case, op, x, op.forward_native(x), expected)
        check(case, op, x, op(x), expected)  # enabled on the CPU platform: forward_cpu
    assert op._forward_method == op.forward_cpu
    assert torch.equal(x, x_before), "x must not be mutated"


# Compile on: forward_cpu's Inductor branch, once per pure function (compiles dominate this
# file's time; the other arguments of a function do not change what Inductor is asked to fuse).
ONE_PER_FUNCTION = ("gelu_and_mul[none]", "gelu_and_mul_sparse[0.3,tanh]")
COMPILED = [pytest.param(c, torch.bfloat16, id=f"{c.label}-bf16") for c in CASES if c.label not in ONE_PER_FUNCTION]
COMPILED += [pytest.param(BY_LABEL["silu_and_mul"], dt, id=f"silu_and_mul-{dt}") for dt in (torch.float32, torch.float16)]


def compiled_shapes(case: ActivationCase):
    """An odd 2-D shape and the 3-D one: one graph serves both (both dims dynamic)."""
    shapes = case.shapes(SIZE)
    return shapes[1], shapes[-1]


@pytest.mark.slow
@pytest.mark.parametrize("case,dtype", COMPILED)
def test_cpu_compiled_matches_reference(case, dtype, monkeypatch):
    op = build(case)
    set_cpu_threshold(monkeypatch, op, 0)
    with torch.no_grad():
        for shape in compiled_shapes(case):
            x = case.input(shape, dtype)
            check(case, op, x, op.forward_cpu(x))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_large(dtype):
    case = BY_LABEL["silu_and_mul"]
    op = build(case)
    x = case.input((256, 2 * 14336), dtype)
    assert x.numel() >= op.cpu_tiers.compile_from(dtype)  # the real threshold: the compiled branch
    with torch.no_grad():
        check(case, op, x, op(x))


@pytest.mark.slow
@pytest.mark.parametrize("label", ["gelu_and_mul[tanh]", "gelu_and_mul[none]"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_and_mul_on_both_sides_of_its_threshold(label, dtype):
    """gelu_and_mul compiles from 16K input elements in bf16/fp16 (the eager tier lost to
    torch.compile at 4-8 rows of 8192: BENCHMARKS.md, "issue 18, CPU, ninth day"), from 512K in
    fp32: the shipped thresholds, an odd width, one row (eager everywhere) and three rows (compiled
    in bf16/fp16), fresh random inputs against the float64 reference."""
    case = BY_LABEL[label]
    op = build(case)
    width = 2 * 4099
    low = dtype in (torch.bfloat16, torch.float16)
    assert op.cpu_tiers.compile_from(dtype) == (1 << 14 if low else 1 << 19)
    with torch.no_grad():
        for rows, compiled in ((1, False), (3, low)):
            x = case.input((rows, width), dtype)
            assert op.cpu_tiers.runs_compiled(x.numel(), dtype) == compiled, rows
            check(case, op, x, op(x))


@pytest.mark.slow
@pytest.mark.parametrize("label", ["silu_and_mul", "swigluoai_and_mul"])
def test_cpu_path_handles_non_contiguous_input(label, monkeypatch):
    """silu_and_mul stays eager (no compiled graph per stride pattern); swigluoai de-interleaves
    into a contiguous copy first, so it runs the compiled graph (the one built above)."""
    case = BY_LABEL[label]
    op = build(case)
    set_cpu_threshold(monkeypatch, op, 0)
    x = case.input((2 * 4231, 7), torch.bfloat16).t()  # last dim strided
    with torch.no_grad():
        check(case, op, x, op.forward_cpu(x))


# ---- compile_native and torch.compile ---------------------------------------------------------


def test_compile_native_defaults():
    with use_config(Config(custom_ops=["none"])):
        silu, relu2, mul_silu = act.SiluAndMul(), act.ReLUSquaredActivation(), act.MulAndSilu()
        plain = act.SiluAndMul(compile_native=False)
    assert silu._compile_native and relu2._compile_native and not mul_silu._compile_native
    assert mul_silu._forward_method == mul_silu.forward_native
    assert plain._forward_method == plain.forward_native
    assert silu._forward_method != silu.forward_native  # wrapped by torch.compile


@pytest.mark.slow
def test_compile_native_runs():
    with use_config(Config(custom_ops=["none"])):
        op = act.SiluAndMul()
    x = randn(5, 2 * 96)
    check(BY_LABEL["silu_and_mul"], op, x, op(x))


class _Wrapper(torch.nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, x):
        return self.op(x * 2.0) + 1.0  # neighbours around the op: one graph must hold all three


CASE_IDS = [c.label for c in CASES]


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_fullgraph_compile(case, platform):
    """cpu: forward_cpu traces its math into the caller's graph; cuda (forced, running the library
    op's reference on CPU tensors): one customop:: node. No graph break either way."""
    torch._dynamo.reset()  # every test's new module recompiles _Wrapper.forward: stay under the limit
    with forced_platform(platform):
        with use_config(Config(custom_ops=["all"])):
            op = case.build(enforce_enable=True)
        counter = CompileCounter()
        compiled = torch.compile(_Wrapper(op), backend=counter, fullgraph=True)
        x = case.input((3, 2 * 40 if case.gated else 40), torch.bfloat16)
        with torch.no_grad():
            out = compiled(x)
    assert counter.frame_count == 1
    expected = reference(case, x.double() * 2.0, op) + 1.0
    atol = 3e-2 + spec_slack(case, x * 2.0)  # the op's own rounding slack, on its input 2x
    assert_close(out, expected, torch.bfloat16, atol=atol)


# ---- the library ops ----------------------------------------------------------------------------


class _OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_forward_cuda_calls_the_library_op(case):
    with forced_platform("cuda"):
        op = case.build(enforce_enable=True)
        assert op.forward_method_name == "forward_cuda"
        x = case.input((4, 2 * 30 if case.gated else 30), torch.float16)
        with torch.no_grad(), _OpRecorder() as recorder:
            out = op(x)
    assert f"customop::{op.name}" in recorder.names
    check(case, op, x, out)


def _library_args(op: CustomOp, x: torch.Tensor) -> tuple:
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in op.math_args())
    return (x, *args)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_opcheck(case):
    op = build(case)
    library_op = getattr(torch.ops.customop, op.name)
    for shape, dtype in (((3, 2 * 17), torch.float32), ((2, 3, 2 * 8), torch.bfloat16)):
        x = case.input(shape, dtype)
        torch.library.opcheck(library_op, _library_args(op, x))


def test_library_schemas_are_fixed():
    expected = {
        "silu_and_mul": "(Tensor x) -> Tensor",
        "mul_and_silu": "(Tensor x) -> Tensor",
        "gelu_and_mul": "(Tensor x, str approximate) -> Tensor",
        "gelu_and_mul_sparse": "(Tensor x, float std_multiplier, str approximate) -> Tensor",
        "fatrelu_and_mul": "(Tensor x, float threshold) -> Tensor",
        "swigluoai_and_mul": "(Tensor x, float alpha, float limit) -> Tensor",
        "swiglustep_and_mul": "(Tensor x, float limit) -> Tensor",
        "silu_and_mul_with_clamp": "(Tensor x, float swiglu_limit, float alpha, float beta) -> Tensor",
        "situ_and_mul": "(Tensor x, float beta, float? linear_beta) -> Tensor",
        "gelu": "(Tensor x) -> Tensor",
        "gelu_tanh": "(Tensor x) -> Tensor",
        "gelu_new": "(Tensor x) -> Tensor",
        "gelu_fast": "(Tensor x) -> Tensor",
        "quick_gelu": "(Tensor x) -> Tensor",
        "relu2": "(Tensor x) -> Tensor",
        "xielu": "(Tensor x, Tensor alpha_p, Tensor alpha_n, float beta, float eps) -> Tensor",
    }
    for name, schema in expected.items():
        assert str(getattr(torch.ops.customop, name).default._schema) == f"customop::{name}{schema}"


def test_fake_shapes_from_meta_tensors():
    x = torch.empty(5, 3, 2 * 11, device="meta", dtype=torch.bfloat16)
    assert torch.ops.customop.silu_and_mul(x).shape == (5, 3, 11)
    assert torch.ops.customop.swigluoai_and_mul(x, 1.702, 7.0).shape == (5, 3, 11)
    assert torch.ops.customop.gelu_new(x).shape == x.shape


# ---- input checks -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["forward_cpu", "forward_cuda"])
def test_bad_inputs(path):
    with forced_platform("cuda"):
        gated, elementwise = act.SiluAndMul(), act.NewGELU()
    forward = lambda op, x: getattr(op, path)(x)  # noqa: E731
    with pytest.raises(ValueError, match=r"silu_and_mul.*x's last dimension must be even"):
        forward(gated, torch.randn(3, 7))
    with pytest.raises(TypeError, match=r"silu_and_mul.*x has dtype torch.int32"):
        forward(gated, torch.ones(3, 8, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"gelu_new.*x has dtype torch.float8_e4m3fn"):
        forward(elementwise, torch.zeros(3, 8, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match=r"gelu_new.*at least one dimension"):
        forward(elementwise, torch.tensor(1.0))
    with pytest.raises(TypeError, match=r"gelu_new: x must be a torch.Tensor"):
        forward(elementwise, [1.0, 2.0])


def test_kernel_paths_need_contiguous_input():
    op = act.SiluAndMul()
    with pytest.raises(ValueError, match=r"silu_and_mul.*contiguous"):
        op.forward_cuda(torch.randn(16, 7).t())
    with pytest.raises(TypeError, match=r"float64"):
        op.forward_cuda(torch.randn(3, 8, dtype=torch.float64))  # fine on the CPU path only


def test_xielu_checks_the_parameter_device():
    op = act.XIELU()
    with pytest.raises(ValueError, match=r"xielu: x is on meta"):
        op.forward_cuda(torch.empty(3, 8, device="meta"))


def test_constructor_arguments():
    with pytest.raises(ValueError, match="approximate"):
        act.GeluAndMul("exact")
    with pytest.raises(ValueError, match="approximate"):
        act.GeluAndMulSparse(0.5, approximate="sigmoid")
    with pytest.raises(ValueError, match="activation_sparsity is 0.0"):
        act.GeluAndMulSparse(0.0)
    with pytest.raises(ValueError, match=r"in \(0, 1\)"):
        act.GeluAndMulSparse(1.0)
    sparse = act.GeluAndMulSparse(0.95)
    assert sparse.std_multiplier.dtype == torch.float32
    assert sparse._std_multiplier == pytest.approx(statistics.NormalDist().inv_cdf(0.95), rel=1e-6)
    assert (act.SwigluOAIAndMul().alpha, act.SwigluOAIAndMul().limit) == (1.702, 7.0)
    assert act.FatreluAndMul().threshold == 0.0
    with pytest.raises(TypeError):
        act.SiluAndMulWithClamp()  # swiglu_limit has no default (vLLM 0.33)
    with pytest.raises(ValueError, match="swiglu_limit is required"):
        act.SiluAndMulWithClamp(None)
    clamp = act.SiluAndMulWithClamp(7)
    assert (clamp.swiglu_limit, clamp.alpha, clamp.beta) == (7.0, 1.0, 0.0) and clamp._compile_native
    situ = act.SituAndMul()
    assert (situ.beta, situ.linear_beta) == (1.0, None) and situ._compile_native
    assert act.SituAndMul(4, 25).linear_beta == 25.0
    with pytest.raises(ValueError, match="SituAndMul: beta"):
        act.SituAndMul(0.0)
    with pytest.raises(ValueError, match="SituAndMul: linear_beta"):
        act.SituAndMul(1.0, 0.0)
    with pytest.raises(ValueError, match="SwigluStepAndMul requires limit"):
        act.SwigluStepAndMul(None)
    assert not act.SwigluStepAndMul()._compile_native and not act.GELU()._compile_native


def _vllm_033_native(name: str, x: torch.Tensor, op) -> torch.Tensor:
    """vLLM 0.33's forward_native of the ops added in 0.33, operation by operation (the rounding
    order matters: the comparison below is bitwise)."""
    d = x.shape[-1] // 2
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "swiglustep_and_mul":
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).clamp(max=op.limit) * up.clamp(min=-op.limit, max=op.limit)
    if name == "silu_and_mul_with_clamp":
        lim = op.swiglu_limit
        gate, up = torch.clamp(x[..., :d], max=lim), torch.clamp(x[..., d:], min=-lim, max=lim)
        return gate * torch.sigmoid(op.alpha * gate) * (up + op.beta)
    assert name == "situ_and_mul"
    gate, up = x[..., :d].float(), x[..., d:].float()
    gate = op.beta * torch.tanh(gate / op.beta) * torch.sigmoid(gate)
    if op.linear_beta is not None:
        up = op.linear_beta * torch.tanh(up / op.linear_beta)
    return (gate * up).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [c for c in CASES if c.op in ("gelu", "gelu_tanh", "swiglustep_and_mul",
                                                               "silu_and_mul_with_clamp", "situ_and_mul")],
                         ids=lambda c: c.label)
def test_new_033_ops_equal_vllm_native_bitwise(case, dtype):
    op = build(case)
    x = case.input((5, 2 * 37 if case.gated else 37), dtype)
    assert torch.equal(op.forward_native(x), _vllm_033_native(case.op, x, op))


def test_xielu_parameters_in_inverse_softplus_form():
    op = act.XIELU()
    assert op.alpha_p.dtype == op.alpha_n.dtype == op.beta.dtype == op.eps.dtype == torch.bfloat16
    assert op.alpha_p.shape == op.alpha_n.shape == (1,)
    assert float(F.softplus(op.alpha_p.detach().float())) == pytest.approx(0.8, abs=2e-2)
    assert float(op.beta.float() + F.softplus(op.alpha_n.detach().float())) == pytest.approx(0.8, abs=2e-2)
    assert (float(op.beta), float(op.eps)) == (0.5, float(torch.tensor(-1e-6, dtype=torch.bfloat16)))
    custom = act.XIELU(alpha_p_init=1.5, alpha_n_init=2.0, beta=0.25, dtype=torch.float32)
    assert float(F.softplus(custom.alpha_p.detach())) == pytest.approx(1.5, rel=1e-6)
    assert float(custom.beta + F.softplus(custom.alpha_n.detach())) == pytest.approx(2.0, rel=1e-6)


# ---- registration, conformance, factories ------------------------------------------------------

CLASSES = {"silu_and_mul": act.SiluAndMul, "mul_and_silu": act.MulAndSilu, "gelu_new": act.NewGELU,
           "gelu_fast": act.FastGELU, "quick_gelu": act.QuickGELU, "gelu_and_mul": act.GeluAndMul,
           "gelu_and_mul_sparse": act.GeluAndMulSparse, "relu2": act.ReLUSquaredActivation,
           "xielu": act.XIELU, "swigluoai_and_mul": act.SwigluOAIAndMul, "fatrelu_and_mul": act.FatreluAndMul,
           "swiglustep_and_mul": act.SwigluStepAndMul, "silu_and_mul_with_clamp": act.SiluAndMulWithClamp,
           "situ_and_mul": act.SituAndMul, "gelu": act.GELU, "gelu_tanh": act.GELUTanh}


def test_the_table_covers_every_activation_op():
    assert {case.op for case in CASES} == set(CLASSES)


def test_registered_names():
    for name, cls in CLASSES.items():
        assert CustomOp.op_registry[name] is cls and cls.name == name


@pytest.mark.parametrize("cls", list(CLASSES.values()), ids=list(CLASSES))
def test_samples_conform(cls):
    with torch.no_grad():
        assert_conforms(cls)


def test_get_act_fn():
    act.clear_shared_activations()
    silu = act.get_act_fn("SiLU")
    assert isinstance(silu, torch.nn.SiLU) and act.get_act_fn("silu") is silu
    assert act.get_act_fn("torch.nn.modules.activation.SiLU") is silu
    assert isinstance(act.get_act_fn("torch.nn.modules.linear.Identity"), torch.nn.Identity)
    assert act.get_act_fn("gelu_pytorch_tanh").approximate == "tanh"
    assert isinstance(act.get_act_fn("gelu"), act.GELU)  # vLLM 0.33: the CustomOp, not nn.GELU
    for name, cls in (("gelu_new", act.NewGELU), ("gelu_fast", act.FastGELU), ("quick_gelu", act.QuickGELU),
                      ("relu2", act.ReLUSquaredActivation), ("xielu", act.XIELU), ("relu", torch.nn.ReLU),
                      ("tanh", torch.nn.Tanh), ("sigmoid", torch.nn.Sigmoid)):
        assert isinstance(act.get_act_fn(name), cls)
    with pytest.raises(ValueError, match=r"'swish'.*known: \['gelu', 'gelu_fast'"):
        act.get_act_fn("swish")


def test_get_act_and_mul_fn():
    act.clear_shared_activations()
    silu = act.get_act_and_mul_fn("silu")
    assert isinstance(silu, act.SiluAndMul) and act.get_act_and_mul_fn("SILU") is silu
    assert act.get_act_and_mul_fn("gelu").approximate == "none"
    assert isinstance(act.get_act_and_mul_fn("geglu"), act.GeluAndMul)
    assert isinstance(act.get_act_and_mul_fn("swigluoai"), act.SwigluOAIAndMul)
    fresh = act.get_act_and_mul_fn("silu", compile_native=False)
    assert fresh is not silu and not fresh._compile_native
    assert act.get_act_and_mul_fn("swigluoai", alpha=1.0).alpha == 1.0
    with pytest.raises(ValueError, match=r"'relu'.*known: \['geglu', 'gelu', 'silu', 'swigluoai'\]"):
        act.get_act_and_mul_fn("relu")


def test_shared_instance_keeps_the_config_of_first_use():
    act.clear_shared_activations()
    with use_config(Config(custom_ops=["none"])):
        first = act.get_act_and_mul_fn("gelu")
    with use_config(Config(custom_ops=["all"])):
        assert act.get_act_and_mul_fn("gelu") is first
    assert first._forward_method == first.forward_native
    act.clear_shared_activations()


def test_xielu_reads_beta_and_eps_from_a_state_dict():
    op = act.XIELU()
    state = {k: v.clone() for k, v in op.state_dict().items()}
    state["beta"].fill_(0.25)
    op.load_state_dict(state)
    assert op.math_args()[2] == 0.25
