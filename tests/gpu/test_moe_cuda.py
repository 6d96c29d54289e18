"""MoE kernels on the GPU (``pytest -m cuda`` on the H200): the routers at real token counts and
up to 256 experts, the layer at Mixtral-8x7B and Qwen3-30B-A3B sizes (bf16, T up to 4096) and
every case of the table (``customop/samples/moe.py``) at 256 tokens, against float64 references
(per expert on the GPU; ``tests/cases/moe.py`` for the small cases); every tuning candidate; the
``torch._grouped_mm`` route; CUDA-graph capture and replay; inputs inside NaN-guarded buffers;
compute-sanitizer memcheck over one launch of each kernel."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zlib

import pytest
import torch

from customop import Config, use_config
from customop.backends.triton import moe_tuning
from customop.samples.moe import LAYERS, REAL_LAYERS, ROUTING, TOKENS
from tests.cases import moe as ref
from tests.gpu.conftest import assert_close_on_device

pytestmark = pytest.mark.cuda

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def build_layer(case, dtype=torch.bfloat16):
    """The layer on the GPU with random weights drawn there (``case.weights``' scaling; drawing
    Mixtral's 2.8 GB on the CPU would take most of the test's time)."""
    with use_config(Config(custom_ops=["all"])):
        layer = case.build(dtype).to("cuda")
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(case.label.encode()))
    scales = {"w13_weight": case.hidden ** -0.5, "w2_weight": layer.intermediate_size_per_partition ** -0.5,
              "w13_bias": 0.5, "w2_bias": 0.5}
    with torch.no_grad():
        for name, param in layer.named_parameters(recurse=False):
            param.copy_(torch.randn(param.shape, device="cuda", generator=g) * scales[name])
    return layer


def experts_f64(layer, x, weights, ids) -> torch.Tensor:
    """float64 on the GPU, one expert at a time (the per-slot reference of tests/cases is too slow
    at these sizes): silu-and-mul experts without bias or expert map, the real layers' form."""
    assert layer.activation == "silu" and layer.w13_bias is None and layer.expert_map is None
    out = torch.zeros(x.shape[0], layer.hidden_size, dtype=torch.float64, device=x.device)
    inter = layer.intermediate_size_per_partition
    for e in range(layer.local_num_experts):
        token, slot = (ids.long() == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        h = x[token].double() @ layer.w13_weight[e].double().t()
        g, u = h[:, :inter], h[:, inter:]
        y = (g / (1.0 + torch.exp(-g)) * u) @ layer.w2_weight[e].double().t()
        out.index_add_(0, token, y * weights[token, slot].double()[:, None])
    return out


# ---- routing ----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ROUTING, ids=lambda c: c.label)
def test_routing_real_token_counts(cuda_kernels, case):
    with use_config(Config(custom_ops=["all"])):
        op = case.build()
    for tokens in TOKENS["real"]:
        hidden, logits, bias = case.inputs(tokens, torch.bfloat16, "cuda", gen(case.label, tokens))
        w, ids = op.forward_kernel(hidden, logits, bias)
        rows = slice(0, 64)  # the Python reference: 64 rows per size
        want = ref.op_routing(op, logits[rows].cpu(), None if bias is None else bias.cpu())
        ref.assert_routing(f"{case.label} T{tokens}", (w[rows].cpu(), ids[rows].cpu()), want)
        spec_w, spec_ids = op.forward_native(hidden, logits, bias)  # every row against the spec
        assert torch.equal(ids, spec_ids), f"{case.label} T{tokens}: ids differ from the spec"
        assert_close_on_device(w, spec_w, f"{case.label} T{tokens} weights", atol=2e-6)


# ---- the layer --------------------------------------------------------------------------------


@pytest.mark.parametrize("case", REAL_LAYERS, ids=lambda c: c.label)
def test_real_layers(cuda_kernels, case, poison_empty):
    layer = build_layer(case)
    for tokens in TOKENS["real"]:
        x, logits = case.inputs(tokens, torch.bfloat16, "cuda", gen(case.label, tokens))
        with torch.no_grad():
            out = layer.forward_kernel(x, logits)
            w, ids = layer.select_experts(x, logits)
            expected = experts_f64(layer, x, w, ids)
        torch.cuda.synchronize()
        atol, rtol = ref.moe_tolerance(torch.bfloat16)
        assert out.dtype == torch.bfloat16 and not out.isnan().any()
        assert_close_on_device(out, expected.float(), f"{case.label} T{tokens}", atol=atol)
        del x, out, expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", LAYERS, ids=lambda c: c.label)
def test_table_cases_at_256_tokens(cuda_kernels, case, dtype, poison_empty):
    layer = build_layer(case, dtype)
    x, logits = case.inputs(256, dtype, "cuda", gen(case.label, str(dtype)))
    with torch.no_grad():
        out = layer.forward_kernel(x, logits)
    layer_cpu = layer.to("cpu")
    ref.assert_layer(case.label, out.cpu(), ref.layer_output(layer_cpu, x.cpu(), logits.cpu()), dtype)


@pytest.mark.parametrize("tokens", [1, 256, 4096])
def test_every_tuning_candidate_and_the_grouped_mm_route(cuda_kernels, tokens):
    """What a tuned table may select must be right too (Qwen3-30B-A3B's layer)."""
    case = REAL_LAYERS[1]
    layer = build_layer(case)
    x, logits = case.inputs(tokens, torch.bfloat16, "cuda", gen("tune", tokens))
    w, ids = layer.select_experts(x, logits)
    expected = experts_f64(layer, x, w, ids).float()
    atol, _ = ref.moe_tolerance(torch.bfloat16)
    launcher = cuda_kernels["customop::fused_experts"]
    for cfg in moe_tuning.candidates(tokens, case.num_experts, case.top_k):
        with moe_tuning.override(cfg), torch.no_grad():
            out = launcher(x, layer.w13_weight, layer.w2_weight, w, ids, *layer.experts_args())
        assert_close_on_device(out, expected, f"T{tokens} {cfg}", atol=atol)


def test_cuda_graph_replay_matches_eager(cuda_kernels):
    case = REAL_LAYERS[1]
    layer = build_layer(case)
    x, logits = case.inputs(16, torch.bfloat16, "cuda", gen("graph"))
    with torch.no_grad():
        eager = layer.forward_kernel(x, logits)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            layer.forward_kernel(x, logits)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = layer.forward_kernel(x, logits)
        x.copy_(torch.randn_like(x))
        logits.copy_(torch.randn_like(logits))  # new routing: the captured alignment must follow it
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, layer.forward_kernel(x, logits))
        assert not torch.equal(captured, eager)


def test_inputs_inside_nan_guarded_buffers(cuda_kernels, poison_empty):
    """x, the weights and the routing sit inside NaN-filled buffers: a read outside them would
    put NaN into the output."""
    case = REAL_LAYERS[1]
    layer = build_layer(case)
    t, h, pad = 33, case.hidden, 256
    guard = torch.full((t * h + 2 * pad,), float("nan"), device="cuda", dtype=torch.bfloat16)
    x = guard[pad:-pad].view(t, h)
    x.copy_(torch.randn(t, h, device="cuda"))
    w13 = torch.full((layer.w13_weight.numel() + 2 * pad,), float("nan"), device="cuda", dtype=torch.bfloat16)
    w13[pad:-pad].copy_(layer.w13_weight.flatten())
    logits = torch.randn(t, case.num_experts, device="cuda")
    w, ids = layer.select_experts(x, logits)
    out = cuda_kernels["customop::fused_experts"](x, w13[pad:-pad].view_as(layer.w13_weight), layer.w2_weight, w, ids,
                                                  *layer.experts_args())
    torch.cuda.synchronize()
    assert not out.isnan().any()
    assert_close_on_device(out, experts_f64(layer, x, w, ids).float(), "guarded", atol=ref.moe_tolerance(torch.bfloat16)[0])


def _sanitizer() -> str | None:
    return shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.path.exists(p)), None)


SANITIZE = """
import torch
from customop import Config, use_config
from customop.backend_loader import load_backend
from customop.samples.moe import LAYERS, ROUTING
load_backend("cuda")
for case in ROUTING:
    with use_config(Config(custom_ops=["all"])):
        op = case.build()
    op.forward_kernel(*case.inputs(7, torch.bfloat16, "cuda"))
for case in LAYERS:
    with use_config(Config(custom_ops=["all"])):
        layer = case.build(torch.bfloat16).to("cuda")
    for name, value in case.weights(layer, device="cuda").items():
        getattr(layer, name).data.copy_(value)
    layer.forward_kernel(*case.inputs(33, torch.bfloat16, "cuda"))
torch.cuda.synchronize()
print("LAUNCHED")
"""


@pytest.mark.skipif(_sanitizer() is None, reason="compute-sanitizer is not installed")
def test_memcheck_clean():
    proc = subprocess.run([_sanitizer(), "--tool", "memcheck", "--error-exitcode", "1", sys.executable, "-c", SANITIZE],
                          cwd=ROOT, capture_output=True, text=True, timeout=900, env=dict(os.environ, TRITON_INTERPRET="0"))
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0 and "LAUNCHED" in proc.stdout and "ERROR SUMMARY: 0 errors" in proc.stdout + proc.stderr, tail
