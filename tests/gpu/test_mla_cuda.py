"""MLA decode on the GPU (``customop::mla_decode``, backends/triton/mla.py): DeepSeek-V3 shapes (128
heads, kv_lora_rank 512, rope 64, blocks of 64) at batch 1, 16 and 64 and contexts 4096 and 32768
with a shuffled block table and uneven lengths, against a float64 reference computed on the device
row by row; fp16/fp32 at one shape; an empty row; CUDA-graph capture and replay with new lengths;
the sweep's tile configs (``mla.override``) on cache blocks of 64, 16 and 48 and head counts that
are not multiples of the tile; the layer's ``forward_cuda`` == ``forward_native`` on the small table. Written without a GPU at
hand: the lead runs it on the H200."""

from __future__ import annotations

import pytest
import torch

from customop.math.mla import gather_history
from tests.gpu.conftest import assert_close_on_device

pytestmark = pytest.mark.cuda

N, L, R, BLOCK = 128, 512, 64, 64
SCALE = (128 + 64) ** -0.5
#: normwise relative error per row (the kernel rounds P to the input dtype before P @ kv_c)
NORMWISE = {torch.bfloat16: 4 * 2.0 ** -8, torch.float16: 4 * 2.0 ** -11, torch.float32: 1e-5}


@pytest.fixture(scope="module")
def mla():
    import triton

    from customop.backend_loader import load_backend
    from customop.backends.triton import mla as module

    load_backend("cuda")
    if not isinstance(module._split_kernel, triton.runtime.jit.JITFunction):
        pytest.fail("backends/triton/mla.py was imported under TRITON_INTERPRET=1")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("customop::mla_decode", "CUDA")
    return module


def make(batch: int, context: int, dtype: torch.dtype, seed: int = 0, heads: int = N, block: int = BLOCK):
    """Lengths from context // 2 to context (the first row exactly context), blocks shuffled."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    width = -(-context // block)
    cache = torch.randn(batch * width + 7, block, L + R, device="cuda", generator=gen).to(dtype)
    table = torch.randperm(cache.shape[0], device="cuda", generator=gen)[:batch * width].view(batch, width).int()
    lens = torch.randint(context // 2, context + 1, (batch,), device="cuda", generator=gen).int()
    lens[0] = context
    q_latent = torch.randn(batch, heads, L, device="cuda", generator=gen).to(dtype)
    q_pe = torch.randn(batch, heads, R, device="cuda", generator=gen).to(dtype)
    return q_latent, q_pe, cache, table, lens


def check(got, q_latent, q_pe, cache, table, lens, what):
    dtype = q_latent.dtype
    assert got.shape == q_latent.shape and got.dtype == dtype
    for b, length in enumerate(lens.tolist()):
        if length == 0:
            assert torch.equal(got[b], torch.zeros_like(got[b])), f"{what}: row {b} is empty, so zeros"
            continue
        rows = gather_history(cache, table[b], length).double()
        query = torch.cat((q_latent[b], q_pe[b]), -1).double()
        probs = (query @ rows.T * SCALE).softmax(-1)
        ref = probs @ rows[:, :L]
        err = float((got[b].double() - ref).norm() / ref.norm())
        assert err <= NORMWISE[dtype], f"{what}: row {b} normwise error {err:.2e} > {NORMWISE[dtype]:.2e}"


@pytest.mark.parametrize("context", [4096, 32768])
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_deepseek_v3_shapes(mla, batch, context, poison_empty):
    inputs = make(batch, context, torch.bfloat16)
    for bound in (context, 0):
        got = torch.ops.customop.mla_decode(*inputs, bound, SCALE)
        check(got, *inputs, f"bf16 {batch}x{context} max_seq_len={bound}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_other_dtypes_and_an_empty_row(mla, dtype, poison_empty):
    q_latent, q_pe, cache, table, lens = make(16, 4096, dtype, seed=1)
    lens[3] = 0
    lens[5] = 1
    got = torch.ops.customop.mla_decode(q_latent, q_pe, cache, table, lens, 4096, SCALE)
    check(got, q_latent, q_pe, cache, table, lens, str(dtype))


def test_cuda_graph_replay(mla):
    q_latent, q_pe, cache, table, lens = make(16, 4096, torch.bfloat16, seed=2)
    torch.ops.customop.mla_decode(q_latent, q_pe, cache, table, lens, 0, SCALE)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.customop.mla_decode(q_latent, q_pe, cache, table, lens, 0, SCALE)
    for step in range(3):
        lens.copy_(torch.randint(1, 4097, lens.shape, device="cuda"))
        q_latent.normal_()
        graph.replay()
        check(out, q_latent, q_pe, cache, table, lens, f"replay {step}")
        assert torch.equal(out, torch.ops.customop.mla_decode(q_latent, q_pe, cache, table, lens, 0, SCALE))


def test_sweep_configs(mla, poison_empty):
    """The sweep's candidates are correct (its timings are only worth reading if so)."""
    from customop.benchmarks.specs.mla import candidates

    inputs = make(4, 1000, torch.bfloat16, seed=3)
    for cfg in candidates():
        with mla.override(cfg):
            got = torch.ops.customop.mla_decode(*inputs, 1000, SCALE)
        check(got, *inputs, str(cfg))


@pytest.mark.parametrize("block", [16, 48, 64])
@pytest.mark.parametrize("heads", [16, 40, 128])
def test_block_sizes_and_head_counts(mla, block, heads, poison_empty):
    """Default tiles (16 positions inside blocks of 16 and 48) and a per-position lookup (tiles of
    32 over blocks of 48); 16 heads (TP8), 40 (not a multiple of the tile), 128."""
    inputs = make(3, 777, torch.bfloat16, seed=4, heads=heads, block=block)
    check(torch.ops.customop.mla_decode(*inputs, 0, SCALE), *inputs, f"{heads} heads, blocks of {block}")
    if block == 48:
        with mla.override(mla.Config(64, 32, 8, 2)):
            got = torch.ops.customop.mla_decode(*inputs, 0, SCALE)
        check(got, *inputs, f"{heads} heads, tiles of 32 over blocks of 48")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_layer_forward_cuda(mla, dtype):
    from customop.ops.mla import MultiHeadLatentAttentionWrapper
    from customop.samples.mla import BATCHES, build_modules, init_kwargs

    op = MultiHeadLatentAttentionWrapper(**init_kwargs(build_modules(True, dtype, device="cuda"), True))
    for batch in BATCHES:
        positions, hidden, cache, meta = batch.build(dtype, device="cuda")
        with torch.no_grad():
            want = op.forward_native(positions, hidden, cache.clone(), meta)
            got = op.forward_cuda(positions, hidden, cache, meta)
        err = float((got.double() - want.double()).norm() / want.double().norm())
        assert err <= (1e-5 if dtype == torch.float32 else 8 * 2.0 ** -8), f"{batch.label}: {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_layer_compiled_with_inductor(mla, dtype):
    """``torch.compile(fullgraph=True)`` of the layer's CUDA route (the per-request walk as the
    opaque ``customop::mla_attention``, its decode through the Triton kernel): the eager
    forward_cuda's output, and the same cache rows written, on every batch of the small table."""
    from customop.ops.mla import MultiHeadLatentAttentionWrapper
    from customop.samples.mla import BATCHES, build_modules, init_kwargs

    op = MultiHeadLatentAttentionWrapper(**init_kwargs(build_modules(False, dtype, device="cuda"), False))
    for batch in BATCHES:
        positions, hidden, cache, meta = batch.build(dtype, device="cuda")
        eager_cache, compiled_cache = cache.clone(), cache.clone()
        torch._dynamo.reset()
        with torch.no_grad():
            want = op.forward_cuda(positions, hidden, eager_cache, meta)
            got = torch.compile(op.forward_cuda, fullgraph=True)(positions, hidden, compiled_cache, meta)
        err = float((got.double() - want.double()).norm() / want.double().norm())
        assert err <= (1e-5 if dtype == torch.float32 else 4 * 2.0 ** -8), f"{batch.label}: {err:.2e}"
        # the rows written (Inductor may round the projections feeding them differently); NaN stays NaN
        assert_close_on_device(compiled_cache, eager_cache, f"{batch.label}: cache rows")
