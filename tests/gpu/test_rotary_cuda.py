"""Rotary-embedding kernel on the GPU at real sizes (up to 32768 tokens x (32 + 8) heads of 128)
against a float64 reference; in place inside a guard-padded qkv buffer; CUDA-graph capture and
replay. ``launch_all`` is one launch of each kernel variant, for compute-sanitizer
(test_quant_cuda.py runs it under memcheck)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import assert_close_on_device

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MAX_POS = 16384


@pytest.fixture(scope="module")
def rotary():
    import triton

    from customop.backends.triton import rotary as module

    if not isinstance(module._rotary_kernel, triton.runtime.jit.JITFunction):
        pytest.fail("the Triton kernels were imported under TRITON_INTERPRET=1: "
                    "run `pytest -m cuda tests/gpu` on its own")
    return module


def make_cache(rotary_dim: int, dtype: torch.dtype) -> torch.Tensor:
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2, device="cuda", dtype=torch.float64) / rotary_dim)
    freqs = torch.outer(torch.arange(MAX_POS, device="cuda", dtype=torch.float64), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def ref_rotary(positions, x, head_size, cache, is_neox):
    """float64 RoPE from cos/sin rounded to x's dtype (the spec casts the cache first)."""
    rotary_dim, tokens = cache.shape[-1], positions.numel()
    half = rotary_dim // 2
    heads = x.double().reshape(tokens, -1, head_size).clone()
    rows = cache[positions.reshape(-1)].to(x.dtype).double()
    cos, sin = rows[:, None, :half], rows[:, None, half:]
    rot = heads[..., :rotary_dim]
    x1, x2 = (rot[..., :half], rot[..., half:]) if is_neox else (rot[..., 0::2], rot[..., 1::2])
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    heads[..., :rotary_dim] = torch.cat((o1, o2), -1) if is_neox else torch.stack((o1, o2), -1).flatten(-2)
    return heads.reshape(x.shape).to(x.dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.dtype.itemsize])


def guarded_qkv(tokens, num_q, num_k, head_size, dtype, guard_rows=3):
    """A qkv buffer with NaN guard rows before and after, and its q, k, v views."""
    width = (num_q + 2 * num_k) * head_size
    storage = torch.full((tokens + 2 * guard_rows, width), float("nan"), device="cuda", dtype=dtype)
    qkv = storage[guard_rows: guard_rows + tokens]
    qkv.copy_(torch.randn(tokens, width, device="cuda").to(dtype))
    q = qkv[:, : num_q * head_size]
    k = qkv[:, num_q * head_size: (num_q + num_k) * head_size]
    return storage, qkv, q, k


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype,tokens_list", [
    (torch.bfloat16, (1, 16, 256, 4096, 32768)),
    (torch.float16, (7, 4096)),
    (torch.float32, (33, 4096)),
], ids=["bf16", "fp16", "fp32"])
def test_llama_heads_real_sizes(rotary, dtype, tokens_list, is_neox):
    """32 q + 8 k heads of 128, full rotary, q/k inside a guarded qkv buffer: rotated values vs
    float64, v and the guard rows bit-identical."""
    cache = make_cache(128, dtype)
    for tokens in tokens_list:
        storage, qkv, q, k = guarded_qkv(tokens, 32, 8, 128, dtype)
        before = storage.clone()
        positions = torch.randint(0, MAX_POS, (tokens,), device="cuda")
        want_q, want_k = ref_rotary(positions, q, 128, cache, is_neox), ref_rotary(positions, k, 128, cache, is_neox)
        rotary.rotary_embedding(positions, q, k, 128, cache, is_neox)
        assert_close_on_device(q, want_q, f"query T={tokens}")
        assert_close_on_device(k, want_k, f"key T={tokens}")
        assert torch.equal(_bits(qkv[:, 40 * 128:]), _bits(before[3:-3, 40 * 128:])), "v lanes changed"
        assert storage[:3].isnan().all() and storage[-3:].isnan().all(), "guard rows written"
        del want_q, want_k, storage, before


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("case", [
    dict(tokens=4096, num_q=32, num_k=8, head_size=128, rotary_dim=64),   # partial rotary
    dict(tokens=3000, num_q=28, num_k=4, head_size=128, rotary_dim=96),   # masked pairs, odd heads
    dict(tokens=5, num_q=64, num_k=8, head_size=64, rotary_dim=64),       # decode, looped heads
    dict(tokens=1024, num_q=16, num_k=0, head_size=256, rotary_dim=128),  # key=None
], ids=["partial", "odd", "many-heads", "no-key"])
def test_variants(rotary, case, is_neox):
    tokens, num_q, num_k, hs, rd = (case[k] for k in ("tokens", "num_q", "num_k", "head_size", "rotary_dim"))
    cache = make_cache(rd, torch.float32)  # an fp32 cache with a bf16 query: rounded first
    storage, qkv, q, k = guarded_qkv(tokens, num_q, max(num_k, 1), hs, torch.bfloat16)
    key = k if num_k else None
    before = qkv.clone()
    positions = torch.randint(0, MAX_POS, (tokens,), device="cuda", dtype=torch.int32)
    want_q = ref_rotary(positions, q, hs, cache, is_neox)
    want_k = ref_rotary(positions, k, hs, cache, is_neox) if key is not None else k.clone()
    rotary.rotary_embedding(positions, q, key, hs, cache, is_neox)
    assert_close_on_device(q, want_q, "query")
    assert_close_on_device(k, want_k, "key")
    lanes = qkv.view(tokens, -1, hs)[:, :, rd:]
    assert torch.equal(_bits(lanes), _bits(before.view(tokens, -1, hs)[:, :, rd:])), "lanes past rotary_dim changed"


@pytest.mark.parametrize("tokens", [1, 16, 4096])
def test_cuda_graph_replay(rotary, tokens):
    """Captured once; replayed on new contents of the same buffers it equals an eager call."""
    cache = make_cache(128, torch.bfloat16)
    q = torch.randn(tokens, 32 * 128, device="cuda").bfloat16()
    k = torch.randn(tokens, 8 * 128, device="cuda").bfloat16()
    positions = torch.randint(0, MAX_POS, (tokens,), device="cuda")
    rotary.rotary_embedding(positions, q, k, 128, cache, True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rotary.rotary_embedding(positions, q, k, 128, cache, True)
    new_q = torch.randn(q.shape, device="cuda").bfloat16()
    new_k = torch.randn(k.shape, device="cuda").bfloat16()
    positions.copy_(torch.randint(0, MAX_POS, (tokens,), device="cuda"))
    eager_q, eager_k = new_q.clone(), new_k.clone()
    rotary.rotary_embedding(positions, eager_q, eager_k, 128, cache, True)
    q.copy_(new_q)
    k.copy_(new_k)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(q, eager_q) and torch.equal(k, eager_k)


def launch_all() -> int:
    """One launch of each variant on small odd shapes (for compute-sanitizer)."""
    from customop.backends.triton import rotary

    launches = 0
    for is_neox in (True, False):
        for tokens, nq, nk, hs, rd in ((1, 32, 8, 128, 128), (7, 3, 1, 128, 96), (33, 64, 8, 64, 64),
                                       (300, 28, 4, 128, 64), (3, 48, 4, 128, 128)):
            _, _, q, k = guarded_qkv(tokens, nq, nk, hs, torch.bfloat16, guard_rows=0)
            cache = make_cache(rd, torch.bfloat16)
            positions = torch.randint(0, MAX_POS, (tokens,), device="cuda")
            rotary.rotary_embedding(positions, q, k, hs, cache, is_neox)
            rotary.rotary_embedding(positions, q, None, hs, cache, is_neox)
            launches += 2
    return launches
