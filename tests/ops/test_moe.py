"""``FusedMoE`` (``fused_moe``): each case of the table (``customop/samples/moe.py``) on
forward_native and forward_cpu against the float64 reference (``tests/cases/moe.py``); the CPU
formulations against each other; the library op (opcheck, torch.compile); expert maps, the
router weight on the input, shared experts; bad inputs and unsupported arguments."""

from __future__ import annotations

import zlib

import pytest
import torch

from customop import Config, use_config
from customop.math import moe as moe_math
from customop.ops import moe
from customop.ops.moe import cpu as moe_cpu
from customop.samples.moe import DTYPES, LAYERS, LAYERS_BY_LABEL
from customop.testing import assert_conforms, assert_same_error
from tests.cases import moe as ref

PARAMS = [pytest.param(c, t, id=f"{c.label}-T{t}") for c in LAYERS for t in c.tier_tokens("small")]


def gen(*key) -> torch.Generator:
    """Seeded from the test's parameters: fresh values per case, reproducible."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def build(case, dtype, g=None, **kwargs):
    """The enabled layer with the case's random weights loaded."""
    with use_config(Config(custom_ops=["all"])):
        layer = case.build(dtype, **kwargs)
    with torch.no_grad():
        for name, value in case.weights(layer, generator=g or gen(case.label, str(dtype))).items():
            getattr(layer, name).copy_(value)
    return layer


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case,tokens", PARAMS)
def test_native_and_cpu_match_reference(case, tokens, dtype, poison_empty, monkeypatch):
    # bf16 at 33 tokens x top_k 4 would compile a graph (seconds here): the compiled form has its
    # own tests below
    monkeypatch.setattr(moe_cpu, "COMPILE_FROM_SLOTS", 1 << 30)
    layer = build(case, dtype)
    x, logits = case.inputs(tokens, dtype, generator=gen(case.label, tokens, str(dtype)))
    expected = ref.layer_output(layer, x, logits)
    assert layer._forward_method == layer.forward_cpu
    with torch.no_grad():
        ref.assert_layer(f"{case.label} native", layer.forward_native(x, logits), expected, dtype)
        ref.assert_layer(f"{case.label} cpu", layer(x, logits), expected, dtype)


@pytest.mark.parametrize("name", sorted(moe_cpu.FORMULATIONS))
@pytest.mark.parametrize("label", ["silu E8 k2 H96 I64", "swigluoai E4 k2 H64 I48 bias", "ep2 rank1 E8 k2",
                                   "on-input E5 k1 H64 I32"])
def test_cpu_formulations_match_reference(label, name):
    """Every formulation forward_cpu may choose (and the one it runs under torch.compile)."""
    case = LAYERS_BY_LABEL[label]
    dtype = torch.bfloat16
    layer = build(case, dtype)
    x, logits = case.inputs(33, dtype, generator=gen(label, "formulations"))
    w, ids = layer.select_experts(x, logits)
    expected = ref.experts(layer, x, w, ids)
    fn = moe_cpu.FORMULATIONS[name]
    with torch.no_grad():
        out = fn(x, layer.w13_weight, layer.w2_weight, w, ids, *layer.experts_args())
    ref.assert_layer(f"{label} {name}", out, expected, dtype)


def test_compiled_formulation_of_a_neg_view():
    """torch.compile (2.13) reads an input with the lazy negation bit without the negation: the
    compiled formulation runs the grouped form eagerly for such inputs."""
    label = "silu E8 k2 H96 I64"
    case = LAYERS_BY_LABEL[label]
    layer = build(case, torch.bfloat16)
    x, logits = case.inputs(33, torch.bfloat16, generator=gen(label, "neg"))
    w, ids = layer.select_experts(-x, logits)
    expected = ref.experts(layer, -x, w, ids)
    with torch.no_grad():
        out = moe_cpu.compiled(torch._neg_view(x), layer.w13_weight, layer.w2_weight, w, ids, *layer.experts_args())
    ref.assert_layer(f"{label} compiled, neg view", out, expected, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("label", ["silu E6 k3 H40 I24", "gelu E4 k1 H36 I20 sigmoid"])
def test_forward_cpu_runs_the_measured_choice(label, dtype, monkeypatch):
    """The table's choice, or the loop where _grouped_mm cannot take the rows (H 36 in 2-byte
    dtypes: 72-byte rows)."""
    ran = []
    for name, fn in list(moe_cpu.FORMULATIONS.items()):
        monkeypatch.setitem(moe_cpu.FORMULATIONS, name, lambda *a, _n=name, _f=fn: ran.append(_n) or _f(*a))
    monkeypatch.setattr(moe_cpu, "SPEC_FROM_SLOTS_PER_EXPERT", {})  # the table (AVX2 CPUs: the next test)
    case = LAYERS_BY_LABEL[label]
    layer = build(case, dtype)
    x, logits = case.inputs(7, dtype, generator=gen("choice", label, str(dtype)))
    with torch.no_grad():
        ref.assert_layer("choice", layer(x, logits), ref.layer_output(layer, x, logits), dtype)
    aligned = (case.hidden * x.element_size()) % 16 == 0
    # 7 tokens: below the compile threshold, bf16 runs the eager grouped form
    assert ran == [("grouped" if dtype == torch.bfloat16 else moe_cpu.CHOICE[dtype]) if aligned else "per_expert"]
    assert moe_cpu.choice(x.new_empty(64, x.shape[1]), layer.w2_weight, 2) == (moe_cpu.CHOICE[dtype] if aligned else "per_expert")


def test_avx2_cpus_run_the_spec_from_their_slots_an_expert(monkeypatch):
    """Where half-precision GEMMs get no hardware help (``SPEC_FROM_SLOTS_PER_EXPERT``, set on
    AVX2 CPUs), bf16 calls of 10 or more (token, k) slots an expert run the spec, fp16 calls of 16
    or more; fewer, and fp32, the table; the layer's output stays the reference's either way."""
    monkeypatch.setattr(moe_cpu, "SPEC_FROM_SLOTS_PER_EXPERT", {torch.bfloat16: 10, torch.float16: 16})
    assert moe_cpu.route(128, 2048, 768, 8, torch.bfloat16, 128) == "compiled"  # 8 an expert
    assert moe_cpu.route(160, 2048, 768, 8, torch.bfloat16, 128) == "spec"  # 10 an expert
    assert moe_cpu.route(40, 1024, 3584, 2, torch.bfloat16, 8) == "spec"
    assert moe_cpu.route(256, 2048, 768, 8, torch.float32, 128) == "grouped"
    assert moe_cpu.route(160, 2048, 768, 8, torch.float16, 128) == "grouped"
    assert moe_cpu.route(256, 2048, 768, 8, torch.float16, 128) == "spec"  # 16 an expert
    ran = []
    for name, fn in list(moe_cpu.FORMULATIONS.items()):
        monkeypatch.setitem(moe_cpu.FORMULATIONS, name, lambda *a, _n=name, _f=fn: ran.append(_n) or _f(*a))
    case = LAYERS_BY_LABEL["silu E6 k3 H40 I24"]
    layer = build(case, torch.bfloat16)
    for tokens, want in ((19, "grouped"), (20, "spec")):  # 9.5 and 10 slots an expert
        x, logits = case.inputs(tokens, torch.bfloat16, generator=gen("avx2", str(tokens)))
        with torch.no_grad():
            ref.assert_layer("avx2 route", layer(x, logits), ref.layer_output(layer, x, logits), torch.bfloat16)
        assert ran[-1] == want
    monkeypatch.undo()  # the shipped table: set on AVX2 CPUs only
    assert bool(moe_cpu.SPEC_FROM_SLOTS_PER_EXPERT) is (torch.backends.cpu.get_cpu_capability() == "AVX2")


@pytest.mark.parametrize("label", ["silu E8 k2 H96 I64", "grouped E8 k2 g4 tg2 bias x2.5", "ep2 rank1 E8 k2"])
def test_kernel_path_through_the_library_ops(label):
    """forward_kernel calls torch.ops.customop.*; on CPU tensors their reference bodies run."""
    case = LAYERS_BY_LABEL[label]
    layer = build(case, torch.float16)
    x, logits = case.inputs(7, torch.float16, generator=gen(label, "kernel"))
    with torch.no_grad():
        ref.assert_layer(label, layer.forward_kernel(x, logits), ref.layer_output(layer, x, logits), torch.float16)


def test_fused_experts_op_passes_opcheck():
    case = LAYERS_BY_LABEL["swigluoai E4 k2 H64 I48 bias"]
    layer = build(case, torch.float32)
    x, logits = case.inputs(5, torch.float32, generator=gen("opcheck"))
    w, ids = layer.select_experts(x, logits)
    torch.library.opcheck(torch.ops.customop.fused_experts.default,
                          (x, layer.w13_weight.detach(), layer.w2_weight.detach(), w, ids, *layer.experts_args()))
    sorted_ids = torch.ops.customop.moe_align_block_size(ids, 16, 4, None)
    torch.library.opcheck(torch.ops.customop.moe_align_block_size.default, (ids, 16, 4, None))
    assert sorted_ids[0].shape == (5 * 2 + 4 * 15,) and sorted_ids[1].shape == (5,)


@pytest.mark.slow
@pytest.mark.parametrize("path,dtype", [("forward_cpu", torch.bfloat16), ("forward_cpu", torch.float16),
                                        ("forward_kernel", torch.bfloat16)], ids=str)
def test_layer_compiles_fullgraph(path, dtype):
    """Inside torch.compile the CPU path runs the grouped form in bf16 (static shapes) and the
    library op otherwise; the kernel path is library ops (one node each)."""
    case = LAYERS_BY_LABEL["grouped E8 k2 g4 tg2 bias x2.5"]
    layer = build(case, dtype)
    x, logits = case.inputs(7, dtype, generator=gen("compile", path))
    torch.compiler.reset()
    with torch.no_grad():
        out = torch.compile(getattr(layer, path), fullgraph=True)(x, logits)
    ref.assert_layer(f"compiled {path}", out, ref.layer_output(layer, x, logits), dtype)


def test_conforms():
    assert_conforms(moe.FusedMoE)


# ---- semantics ----------------------------------------------------------------------------------


def test_tokens_routed_to_no_local_expert_give_zeros():
    case = LAYERS_BY_LABEL["ep2 rank1 E8 k2"]  # rank 1 holds experts 4..7
    layer = build(case, torch.float32)
    assert layer.expert_map.tolist() == [-1, -1, -1, -1, 0, 1, 2, 3] and layer.w13_weight.shape[0] == 4
    x = torch.randn(3, case.hidden)
    w = torch.full((3, 2), 0.5)
    ids = torch.tensor([[0, 1], [2, 5], [-1, 3]], dtype=torch.int32)
    for path in ("forward_native", "forward_cpu", "forward_kernel"):
        layer.dispatch_forward()
        layer.forward_method_name = path
        out = layer.apply_experts(x, w, ids)
        assert (out[0] == 0).all() and (out[2] == 0).all(), path
        assert out[1].abs().sum() > 0
        torch.testing.assert_close(out, ref.experts(layer, x, w, ids).float(), atol=1e-5, rtol=1e-5)


def test_router_weight_on_input_needs_top_k_1():
    with pytest.raises(ValueError, match="top_k=1"):
        moe.FusedMoE(4, 2, 32, 32, apply_router_weight_on_input=True)


def test_shared_experts_are_added():
    case = LAYERS_BY_LABEL["silu E8 k2 H96 I64"]
    shared = torch.nn.Linear(case.hidden, case.hidden, bias=False)
    layer = build(case, torch.float32, shared_experts=shared)
    x, logits = case.inputs(4, torch.float32, generator=gen("shared"))
    with torch.no_grad():
        expected = ref.layer_output(layer, x, logits) + shared(x).double()
        ref.assert_layer("shared", layer(x, logits), expected, torch.float32)


def test_weight_loader_per_expert_checkpoint():
    """w1/w3/w2 per expert, as a checkpoint stores them, fill the fused layout; a fused w13
    (gpt-oss) too; the interleaved layout gets gate on even rows; remote experts are skipped."""
    e, h, i = 4, 16, 8
    gate, up, down = torch.randn(e, i, h), torch.randn(e, i, h), torch.randn(e, h, i)
    for activation in ("silu", "swigluoai"):
        layer = moe.FusedMoE(e, 2, h, i, activation=activation, ep_size=2, ep_rank=1)
        for expert in range(e):
            for shard, tensor in (("w1", gate), ("w3", up)):
                ok = layer.w13_weight.weight_loader(layer.w13_weight, tensor[expert], "", shard, expert, True)
                assert ok == (expert >= 2)
            layer.weight_loader(layer.w2_weight, down[expert], "", "w2", expert)
        w13 = layer.w13_weight
        if activation == "silu":
            assert torch.equal(w13[:, :i], gate[2:]) and torch.equal(w13[:, i:], up[2:])
        else:
            assert torch.equal(w13[:, 0::2], gate[2:]) and torch.equal(w13[:, 1::2], up[2:])
        assert torch.equal(layer.w2_weight, down[2:])
        fused = moe.FusedMoE(e, 2, h, i, activation=activation, ep_size=2, ep_rank=1)
        fused.weight_loader(fused.w13_weight, torch.cat([w13.new_zeros(2, 2 * i, h), w13.data]), "", "w13")
        assert torch.equal(fused.w13_weight, w13)
    with pytest.raises(ValueError, match="expects"):
        layer.weight_loader(layer.w2_weight, down[0, :8], "", "w2", 3)
    with pytest.raises(ValueError, match="intermediate_size=8"):
        layer.weight_loader(layer.w13_weight, gate[0, :4], "", "w1", 3)
    with pytest.raises(ValueError, match="shard_id"):
        layer.weight_loader(layer.w13_weight, gate[0], "", "w4", 3)
    mapping = layer.make_expert_params_mapping()
    assert ("experts.w13_", "experts.3.up_proj.", 3, "w3") in mapping and len(mapping) == 3 * e


def test_factory_accepts_vllm_arguments_and_refuses_the_unsupported():
    layer = moe.FusedMoEFactory(num_experts=4, top_k=2, hidden_size=16, intermediate_size=8, prefix="model.layers.0",
                                dp_size=1, quant_config=None, enable_eplb=False, reduce_results=False)
    assert isinstance(layer, moe.FusedMoE) and layer.w13_weight.shape == (4, 16, 16)
    with pytest.raises(NotImplementedError, match="enable_eplb"):
        moe.FusedMoEFactory(num_experts=4, top_k=2, hidden_size=16, intermediate_size=8, enable_eplb=True)
    with pytest.raises(TypeError, match="bogus"):
        moe.FusedMoEFactory(num_experts=4, top_k=2, hidden_size=16, intermediate_size=8, bogus=1)
    with pytest.raises(ValueError, match="activation"):
        moe.FusedMoE(4, 2, 16, 8, activation="relu2_no_mul")
    with pytest.raises(ValueError, match="divide"):
        moe.FusedMoE(6, 2, 16, 8, use_grouped_topk=True, num_expert_group=4, topk_group=2)


# ---- bad inputs ---------------------------------------------------------------------------------


def test_bad_inputs_raise_on_every_path():
    case = LAYERS_BY_LABEL["silu E6 k3 H40 I24"]
    layer = build(case, torch.float32)
    x, logits = case.inputs(3, torch.float32, generator=gen("bad"))
    assert_same_error(layer, (x.to(torch.int32), logits), TypeError, "float32/float16/bfloat16")
    assert_same_error(layer, (x[:, :32], logits), ValueError, r"expected \[num_tokens, 40\]")
    assert_same_error(layer, (x.half(), logits), TypeError, "the weights")
    assert_same_error(layer, (x, logits[:, :5]), ValueError, "expected 6")
    assert_same_error(layer, (x, logits.long()), TypeError, "floating-point")
    with pytest.raises(ValueError, match=r"top_k=7 must be in \[1, num_experts=6\]"):
        moe.FusedMoE(6, 7, 40, 24)


@pytest.mark.parametrize("bad,error,match", [
    (torch.tensor([[0, 6, 1]]), ValueError, r"outside \[-1, 6\)"),
    (torch.tensor([[0, -2, 1]]), ValueError, r"outside \[-1, 6\)"),
    (torch.tensor([[0.0, 1.0, 2.0]]), TypeError, "topk_ids"),
    (torch.tensor([[0, 1]]), ValueError, r"expected \(1, 3\)"),
])
def test_routing_given_is_checked(bad, error, match):
    layer = build(LAYERS_BY_LABEL["silu E6 k3 H40 I24"], torch.float32)
    with pytest.raises(error, match=match):
        layer.apply_experts(torch.randn(1, 40), torch.ones(1, 3), bad)


def test_align_block_size_layout():
    """The reference layout the Triton kernels share: runs per expert, padded with T*K."""
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]], dtype=torch.int32)
    sorted_ids, expert_ids, total = moe_math.moe_align_block_size(ids, 4, 4)
    assert total.tolist() == [12]
    assert sorted_ids[:12].tolist() == [1, 4, 6, 6, 0, 2, 5, 6, 3, 6, 6, 6]
    assert expert_ids.tolist() == [0, 2, 3] + [-1] * (len(expert_ids) - 3)
    emap = torch.tensor([-1, -1, 0, 1], dtype=torch.int32)  # experts 2 and 3 local
    sorted_ids, expert_ids, total = moe_math.moe_align_block_size(ids, 4, 2, emap)
    assert total.tolist() == [8] and sorted_ids[:8].tolist() == [0, 2, 5, 6, 3, 6, 6, 6]
    assert expert_ids[:2].tolist() == [0, 1]


def test_tune_reports_a_shape_whose_candidates_all_fail(monkeypatch, capsys):
    """``benchmarks/specs/moe.py --tune`` with every candidate failing (stubbed: no GPU, no kernel
    launch): the shape is reported untuned with the reason, not a crash on ``min([])``."""
    import customop.backend_loader
    import customop.benchmarks.runner_timing
    from customop.benchmarks.specs import moe as moe_spec

    def fail(_fns):
        raise RuntimeError("out of resources")

    monkeypatch.setattr(customop.backend_loader, "load_backend", lambda name: None)
    monkeypatch.setattr(customop.benchmarks.runner_timing, "time_graph", fail)
    monkeypatch.setattr(moe_spec, "_inputs", lambda shape, dtype, device: dict.fromkeys(
        ("x", "w13", "w2", "topk_weights", "topk_ids")))
    table = moe_spec.tune(models=("qwen3-30b-a3b",), tokens=(1,))
    assert "# T1: untuned: all " in table and "RuntimeError: out of resources" in table
    assert "): (" not in table  # no entry for a model without a tuned row
    assert "qwen3-30b-a3b T1: untuned" in capsys.readouterr().err
    # one candidate timing: the others' failures leave its row
    times = iter([RuntimeError("x")] + [5.0] * 100)

    def some(_fns):
        t = next(times)
        if isinstance(t, Exception):
            raise t
        return t

    monkeypatch.setattr(customop.benchmarks.runner_timing, "time_graph", some)
    table = moe_spec.tune(models=("qwen3-30b-a3b",), tokens=(1,))
    assert "untuned" not in table and "(1, MoEConfig(" in table
