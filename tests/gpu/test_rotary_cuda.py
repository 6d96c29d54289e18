"""Rotary-embedding kernel on the GPU: every real-size row of the table (``customop/samples/rotary.py``,
up to 32768 tokens x (32 + 8) heads of 128) through ``forward_kernel``, in place inside a
guard-padded qkv buffer, against the float64 references (``tests/cases/rotary.py``); an fp32 cache
with a bf16 query (the launcher rounds it); CUDA-graph capture and replay. ``launch_all`` is one
launch of each kernel variant, for compute-sanitizer (test_quant_cuda.py runs it under memcheck)."""

from __future__ import annotations

import pytest
import torch

from customop.samples.rotary import BY_LABEL, DTYPES, SIZES, STYLES, style_id
from tests.cases.rotary import check_rope_outputs
from tests.gpu.conftest import assert_close_on_device

pytestmark = pytest.mark.cuda

MAX_POS = 16384
#: fp16 and fp32 (covered by the interpreter tier too) on an odd small row and a real one
FEWER = {torch.float16: ("T33 32+8x128", "T4096 32+8x128"), torch.float32: ("odd rotary 8+2x128 rot 96", "T4096 32+8x128")}


@pytest.fixture(scope="module")
def rotary(cuda_kernels):
    from customop.backends.triton import rotary as module

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


def rows_for(dtype):
    return SIZES["real"] if dtype == torch.bfloat16 else tuple(BY_LABEL[label] for label in FEWER[dtype])


@pytest.mark.parametrize("is_neox", STYLES, ids=style_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_real_sizes(rotary, dtype, is_neox):
    """q/k inside a guarded qkv buffer, rotated in place by forward_kernel: values vs float64; the
    lanes past rotary_dim, v (and the key slot when there is no key) and the guard rows
    bit-identical."""
    for case in rows_for(dtype):
        kv_heads = case.kv_heads or 0
        storage, qkv, q, k = guarded_qkv(case.tokens, case.heads, max(kv_heads, 1), case.head_size, dtype)
        key = k if kv_heads else None
        before, q0, k0 = storage.clone(), q.clone(), None if key is None else key.clone()
        op = case.build(is_neox, dtype, max_pos=MAX_POS).to("cuda")
        positions = torch.randint(0, MAX_POS, (case.tokens,), device="cuda")
        out_q, out_k = op.forward_kernel(positions, q, key)
        torch.cuda.synchronize()
        assert out_q is q and out_k is key
        check_rope_outputs(op, positions, q0, k0, out_q, out_k, products_rounded=False)
        lanes, lanes_before = qkv.view(case.tokens, -1, case.head_size), before[3:-3].view(case.tokens, -1, case.head_size)
        assert torch.equal(_bits(lanes[:, :, case.rotary_dim:]), _bits(lanes_before[:, :, case.rotary_dim:])), \
            f"{case.label}: lanes past rotary_dim changed"
        untouched = (case.heads + kv_heads) * case.head_size
        assert torch.equal(_bits(qkv[:, untouched:]), _bits(before[3:-3, untouched:])), f"{case.label}: v lanes changed"
        assert storage[:3].isnan().all() and storage[-3:].isnan().all(), f"{case.label}: guard rows written"
        del storage, before, q0, k0, op


@pytest.mark.parametrize("is_neox", STYLES, ids=style_id)
@pytest.mark.parametrize("label", ["partial T4096 32+8x128 rot 64", "odd rotary T3000 28+4x128 rot 96",
                                   "many heads T5 64+8x64", "key None T1024 16x256 rot 128"])
def test_fp32_cache_with_bf16_query(rotary, label, is_neox):
    """The launcher given an fp32 cache and a bf16 query rounds the cache rows to bf16 first."""
    case = BY_LABEL[label]
    kv_heads = case.kv_heads or 0
    cache = make_cache(case.rotary_dim, torch.float32)
    storage, qkv, q, k = guarded_qkv(case.tokens, case.heads, max(kv_heads, 1), case.head_size, torch.bfloat16)
    key = k if kv_heads else None
    before = qkv.clone()
    positions = torch.randint(0, MAX_POS, (case.tokens,), device="cuda", dtype=torch.int32)
    want_q = ref_rotary(positions, q, case.head_size, cache, is_neox)
    want_k = ref_rotary(positions, k, case.head_size, cache, is_neox) if key is not None else k.clone()
    rotary.rotary_embedding(positions, q, key, case.head_size, cache, is_neox)
    assert_close_on_device(q, want_q, "query")
    assert_close_on_device(k, want_k, "key")
    lanes = qkv.view(case.tokens, -1, case.head_size)[:, :, case.rotary_dim:]
    assert torch.equal(_bits(lanes), _bits(before.view(case.tokens, -1, case.head_size)[:, :, case.rotary_dim:])), \
        "lanes past rotary_dim changed"


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
    """One launch of each variant on small odd shapes (for compute-sanitizer): the table's small
    rows, plus two odd mid-size ones."""
    from customop.backends.triton import rotary

    launches = 0
    rows = [(c.tokens, c.heads, c.kv_heads or 1, c.head_size, c.rotary_dim) for c in SIZES["small"]]
    for is_neox in (True, False):
        for tokens, nq, nk, hs, rd in rows + [(33, 64, 8, 64, 64), (300, 28, 4, 128, 64)]:
            _, _, q, k = guarded_qkv(tokens, nq, nk, hs, torch.bfloat16, guard_rows=0)
            cache = make_cache(rd, torch.bfloat16)
            positions = torch.randint(0, MAX_POS, (tokens,), device="cuda")
            rotary.rotary_embedding(positions, q, k, hs, cache, is_neox)
            rotary.rotary_embedding(positions, q, None, hs, cache, is_neox)
            launches += 2
    return launches
