"""The MoE kernels (backends/triton/moe.py, moe_routing.py) under the Triton interpreter: the
routers and the layer through ``forward_kernel`` (the launchers as the CPU kernels of their
``customop::`` ops) against the float64 references (``tests/cases/moe.py``), the alignment against
its reference layout, other tilings than the default, and the library ops (opcheck, compile).

Sizes are the table's small ones (E 4-64, H and I 20-96 with non-multiples of 16, T in
{0, 1, 7, 33}); every layer case runs in bf16 at 33 tokens, a few in every dtype and size: each
interpreted call takes ~0.3 s here (~2.5 s for the E64 k8 case, hence 33 tokens only)."""

from __future__ import annotations

import contextlib
import zlib

import pytest
import torch

from customop import Config, use_config
from customop.backends.triton import moe as moe_kernels
from customop.backends.triton import moe_routing, moe_tuning
from customop.math import moe as moe_math
from customop.samples.moe import DTYPES, LAYERS, LAYERS_BY_LABEL, ROUTING, ROUTING_BY_LABEL, TOKENS
from tests.backends.triton.conftest import as_cpu_kernel
from tests.cases import moe as ref

pytestmark = pytest.mark.interpret

LAUNCHERS = {name.removeprefix("customop::"): fn for name, fn in {**moe_kernels.KERNELS, **moe_routing.KERNELS}.items()}


def gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


@contextlib.contextmanager
def kernels(*names: str):
    """The named launchers as CPU kernels; yields their call counters."""
    with contextlib.ExitStack() as stack:
        yield {n: stack.enter_context(as_cpu_kernel(n, LAUNCHERS[n])) for n in names}


def build_layer(case, dtype, g):
    with use_config(Config(custom_ops=["all"])):
        layer = case.build(dtype)
    with torch.no_grad():
        for name, value in case.weights(layer, generator=g).items():
            getattr(layer, name).copy_(value)
    return layer


# ---- routing --------------------------------------------------------------------------------------

ROUTING_PARAMS = [pytest.param(c, t, torch.bfloat16, id=f"{c.label}-T{t}") for c in ROUTING for t in TOKENS["small"]]
ROUTING_PARAMS += [pytest.param(ROUTING_BY_LABEL[label], 7, dt, id=f"{label}-T7-{dt}")
                   for label in ("topk biased sigmoid E32 k4 x2.5", "grouped V3 E256 g8 tg4 k8")
                   for dt in (torch.float32, torch.float16)]


@pytest.mark.parametrize("case,tokens,dtype", ROUTING_PARAMS)
def test_routing_kernel_matches_reference(case, tokens, dtype, poison_empty):
    with use_config(Config(custom_ops=["all"])):
        op = case.build()
    hidden, logits, bias = case.inputs(tokens, dtype, generator=gen(case.label, tokens, str(dtype)))
    with kernels(case.op) as calls, torch.no_grad():
        got = op.forward_kernel(hidden, logits, bias)
    assert len(calls[case.op]) == 1, "forward_kernel did not reach the Triton launcher"
    ref.assert_routing(case.label, got, ref.op_routing(op, logits, bias))


def test_routing_kernel_reads_strided_logits():
    logits = torch.randn(9, 40, generator=gen("strided"))[:, :32]
    got = moe_routing.fused_topk(logits, 4, True, "softmax", None, 1.0)
    ref.assert_routing("strided", got, ref.routing(logits, 4, True))


# ---- alignment ----------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens,top_k,experts,block,ep", [(33, 3, 6, 16, None), (7, 2, 8, 16, (2, 1)),
                                                            (1, 8, 128, 16, None), (40, 4, 8, 32, (3, 2)),
                                                            (5, 1, 4, 64, None)])
def test_align_block_size_matches_reference(tokens, top_k, experts, block, ep, poison_empty):
    """Same padded counts, block experts and, per block, the same set of slots (the kernel's order
    within an expert's run is its atomics' arrival order)."""
    ids = torch.randint(-1, experts, (tokens, top_k), generator=gen(tokens, experts), dtype=torch.int32)
    emap = None if ep is None else moe_math.expert_map(experts, *ep)
    n_local = experts if emap is None else int((emap >= 0).sum())
    got = LAUNCHERS["moe_align_block_size"](ids, block, n_local, emap)
    want = moe_math.moe_align_block_size(ids, block, n_local, emap)
    assert torch.equal(got[2], want[2]) and torch.equal(got[1], want[1])
    used = int(want[2])
    assert torch.equal(got[0][:used].view(-1, block).sort(-1).values, want[0][:used].view(-1, block).sort(-1).values)
    assert (got[0][used:] == ids.numel()).all()


# ---- the layer ----------------------------------------------------------------------------------

LAYER_PARAMS = [pytest.param(c, 33, torch.bfloat16, id=f"{c.label}-T33-bf16") for c in LAYERS]
LAYER_PARAMS += [pytest.param(LAYERS_BY_LABEL[label], t, dt, id=f"{label}-T{t}-{dt}")
                 for label in ("silu E6 k3 H40 I24", "swigluoai E4 k2 H64 I48 bias")
                 for t in (0, 1, 7) for dt in DTYPES]


@pytest.mark.parametrize("case,tokens,dtype", LAYER_PARAMS)
def test_layer_kernel_path_matches_reference(case, tokens, dtype, poison_empty):
    g = gen(case.label, tokens, str(dtype))
    layer = build_layer(case, dtype, g)
    x, logits = case.inputs(tokens, dtype, generator=g)
    expected = ref.layer_output(layer, x, logits)
    router = "grouped_topk" if layer.use_grouped_topk else "fused_topk"
    with kernels(router, "fused_experts") as calls, torch.no_grad():
        out = layer.forward_kernel(x, logits)
    assert len(calls[router]) == 1 and len(calls["fused_experts"]) == 1
    ref.assert_layer(f"{case.label} T{tokens}", out, expected, dtype)


CONFIGS = [moe_tuning.MoEConfig(16, moe_tuning.GemmConfig(16, 16, 1), moe_tuning.GemmConfig(32, 16, 1)),
           moe_tuning.MoEConfig(32, moe_tuning.GemmConfig(32, 32, 4), moe_tuning.GemmConfig(16, 64, 2)),
           moe_tuning.MoEConfig(64, moe_tuning.GemmConfig(128, 128, 8), moe_tuning.GemmConfig(64, 128, 8))]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"m{c.block_m}-n{c.gemm1.block_n}-k{c.gemm1.block_k}")
@pytest.mark.parametrize("label", ["silu E6 k3 H40 I24", "ep3 rank0 round_robin E7 k3"])
def test_other_tilings(label, cfg, poison_empty):
    """K tails (BLOCK_K 16 over H 40), several N blocks, group orders, blocks wider than the
    problem: what a tuned table may select."""
    case = LAYERS_BY_LABEL[label]
    g = gen(label, str(cfg))
    layer = build_layer(case, torch.float16, g)
    x, logits = case.inputs(33, torch.float16, generator=g)
    w, ids = layer.select_experts(x, logits)
    with moe_tuning.override(cfg), torch.no_grad():
        out = LAUNCHERS["fused_experts"](x, layer.w13_weight, layer.w2_weight, w, ids, *layer.experts_args())
    ref.assert_layer(label, out, ref.experts(layer, x, w, ids), torch.float16)


def test_routing_given_with_minus_one_ids(poison_empty):
    """Slots with id -1 (padding) add nothing; a token with no slot left gets zeros."""
    case = LAYERS_BY_LABEL["silu E8 k2 H96 I64"]
    layer = build_layer(case, torch.float32, gen("minus one"))
    x = torch.randn(4, case.hidden, generator=gen("x"))
    ids = torch.tensor([[1, -1], [-1, -1], [7, 0], [3, 3]], dtype=torch.int32)  # a duplicate: summed twice
    w = torch.rand(4, 2, generator=gen("w"))
    out = LAUNCHERS["fused_experts"](x, layer.w13_weight, layer.w2_weight, w, ids, *layer.experts_args())
    assert (out[1] == 0).all()
    ref.assert_layer("minus one", out, ref.experts(layer, x, w, ids), torch.float32)


@pytest.mark.parametrize("tokens", [1, 3, 20], ids=lambda t: f"T{t}")
def test_decode_shortcut_and_ids_out_of_range(tokens, poison_empty):
    """E 64, top_k 2: up to 8 tokens the GEMMs skip the alignment (one block per slot). On both
    routes ids -1 and ids outside [0, E) (unchecked on devices) add nothing and read nothing."""
    from customop.samples.moe import LayerCase

    case = LayerCase("E64 k2", 64, 2, 40, 24)
    g = gen("decode", tokens)
    layer = build_layer(case, torch.bfloat16, g)
    x = torch.randn(tokens, case.hidden, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 64, (tokens, 2), generator=g, dtype=torch.int32)
    ids[0, 1] = -1
    ids[-1, 0] = 64 + 7  # out of range
    w = torch.rand(tokens, 2, generator=g)
    out = LAUNCHERS["fused_experts"](x, layer.w13_weight, layer.w2_weight, w, ids, *layer.experts_args())
    kept = torch.where(ids < 64, ids, -1)
    ref.assert_layer(f"T{tokens}", out, ref.experts(layer, x, w, kept), torch.bfloat16)


# ---- through torch.ops.customop.* ---------------------------------------------------------------


@pytest.mark.slow
def test_library_ops_run_the_kernels_and_pass_opcheck_and_compile():
    case = LAYERS_BY_LABEL["grouped E8 k2 g4 tg2 bias x2.5"]
    g = gen("library")
    layer = build_layer(case, torch.float16, g)
    x, logits = case.inputs(7, torch.float16, generator=g)
    expected = ref.layer_output(layer, x, logits)
    with kernels("grouped_topk", "fused_experts", "moe_align_block_size") as calls, torch.no_grad():
        w, ids = layer.select_experts(x, logits, kernel=True)
        args = (x, layer.w13_weight, layer.w2_weight, w, ids, *layer.experts_args())
        torch.library.opcheck(torch.ops.customop.fused_experts.default, args)
        torch.library.opcheck(torch.ops.customop.grouped_topk.default,
                              (logits, 2, True, 4, 2, "sigmoid", 2.5, layer.e_score_correction_bias))
        torch.library.opcheck(torch.ops.customop.moe_align_block_size.default, (ids, 16, 8, None))
        torch.compiler.reset()
        before = len(calls["fused_experts"])
        out = torch.compile(layer.forward_kernel, fullgraph=True)(x, logits)
        assert len(calls["fused_experts"]) > before, "the compiled graph did not call the Triton kernel"
    ref.assert_layer("compiled", out, expected, torch.float16)


# ---- compiled for the GPUs (no GPU needed) ------------------------------------------------------


@pytest.mark.slow
def test_kernels_compile_for_h200_and_mi300():
    """Every MoE kernel variant compiles for sm_90 (without register spills) and gfx942: the
    interpreter accepts code the GPU compilers reject, and widens the bf16 dots the GPU runs.
    Both targets at once, one process each (CI has two cores)."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    procs = {target: subprocess.Popen([sys.executable, "-m", "tests.backends.triton.moe_aot_check", "--target", target],
                                      cwd=root, env=dict(os.environ, TRITON_INTERPRET="0"), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
             for target in ("cuda:90", "hip:gfx942")}
    problems = []
    for target, proc in procs.items():
        out, err = proc.communicate(timeout=900)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        assert lines, f"{target}: no report (exit {proc.returncode}):\n{err[-4000:]}"
        report = json.loads(lines[-1])
        assert len(report) >= 16
        problems += [f"{target} {label}: {info['error']}" for label, info in report.items() if "error" in info]
        if target.startswith("cuda"):
            problems += [f"{target} {label}: spills {info}" for label, info in report.items()
                         if "error" not in info and (info["local_bytes"] or info["spill_bytes"])]
    assert not problems, "\n".join(problems)
