"""Rotary-embedding Triton kernel under TRITON_INTERPRET=1 (CPU tensors), against a float64
reference written here.

The kernel rotates in fp32 and rounds once into the input dtype, from cos/sin rounded to the input
dtype (as the spec casts the cache); the reference does the same rotation in float64 and rounds
once, so the bound is one ulp of the output dtype (the interpreter truncates fp32 -> bf16, which
is still within one ulp): ``customop.testing.TOLERANCES``. In place: lanes past ``rotary_dim``,
and everything around the q/k views inside a fused qkv buffer, must keep their exact bits.
"""

from __future__ import annotations

import pytest
import torch

import customop.ops  # noqa: F401  (defines torch.ops.customop.rotary_embedding)
from customop.backends.triton import rotary
from customop.testing import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_cache(max_pos: int, rotary_dim: int, dtype: torch.dtype, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def round_like_interpreter(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` as the interpreter's kernels round: fp32 -> bf16 truncates."""
    if dtype == torch.bfloat16 and t.dtype == torch.float32:
        return (t.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
    return t.to(dtype)


def ref_rotary(positions, x, head_size, cache, is_neox):
    """float64 RoPE of ``x [T, H*head_size]`` (any leading shape matching positions), from cache
    rows rounded to x's dtype first (as the spec casts the cache)."""
    tokens = positions.numel()
    rotary_dim = cache.shape[-1]
    half = rotary_dim // 2
    heads = x.double().reshape(tokens, -1, head_size).clone()
    rows = round_like_interpreter(cache[positions.reshape(-1).long()], x.dtype).double()
    cos, sin = rows[:, None, :half], rows[:, None, half:]
    rot = heads[..., :rotary_dim]
    if is_neox:
        x1, x2 = rot[..., :half], rot[..., half:]
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    if is_neox:
        heads[..., :rotary_dim] = torch.cat((o1, o2), dim=-1)
    else:
        heads[..., :rotary_dim] = torch.stack((o1, o2), dim=-1).flatten(-2)
    return heads.reshape(x.shape).to(x.dtype)


def qkv_buffer(tokens, num_q, num_k, head_size, dtype, seed=0):
    """A fused qkv projection output ``[T, (num_q + 2*num_k) * head_size]`` and its q, k views
    (row stride larger than the view: what models pass)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (num_q + 2 * num_k) * head_size, generator=g).to(dtype)
    q = qkv[:, : num_q * head_size]
    k = qkv[:, num_q * head_size: (num_q + num_k) * head_size]
    return qkv, q, k


CASES = [  # tokens, q heads, k heads, head_size, rotary_dim
    pytest.param(1, 4, 2, 64, 64, id="decode-full"),     # heads split over programs
    pytest.param(7, 3, 1, 128, 64, id="partial"),         # partial rotary, odd head counts
    pytest.param(33, 8, 2, 128, 96, id="odd-rotary"),     # rotary_dim/2 = 48: masked pairs
    pytest.param(16, 32, 8, 128, 128, id="llama"),        # 32+8 heads of 128 (issue 4's shape)
    pytest.param(3, 48, 4, 128, 128, id="many-heads"),    # 48 q heads > a 32-head tile: the looped path
]


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,num_q,num_k,head_size,rotary_dim", CASES)
def test_rotary_in_place(dtype, is_neox, tokens, num_q, num_k, head_size, rotary_dim):
    qkv, q, k = qkv_buffer(tokens, num_q, num_k, head_size, dtype)
    before = qkv.clone()
    cache = make_cache(4096, rotary_dim, dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(1))
    want_q = ref_rotary(positions, q, head_size, cache, is_neox)
    want_k = ref_rotary(positions, k, head_size, cache, is_neox)

    assert rotary.rotary_embedding(positions, q, k, head_size, cache, is_neox) is None
    assert_close(q, want_q, what="query")
    assert_close(k, want_k, what="key")
    # exact bits where nothing rotates: lanes past rotary_dim, and v
    heads = qkv.view(tokens, -1, head_size)
    assert torch.equal(heads[:, :, rotary_dim:], before.view(tokens, -1, head_size)[:, :, rotary_dim:])
    assert torch.equal(qkv[:, (num_q + num_k) * head_size:], before[:, (num_q + num_k) * head_size:])


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_key_none(is_neox):
    _, q, _ = qkv_buffer(5, 4, 2, 64, torch.bfloat16)
    cache = make_cache(64, 64, torch.bfloat16)
    positions = torch.tensor([0, 63, 7, 7, 1])
    want = ref_rotary(positions, q, 64, cache, is_neox)
    rotary.rotary_embedding(positions, q, None, 64, cache, is_neox)
    assert_close(q, want)


def test_fp32_cache_int32_positions_3d_layout():
    """An fp32 cache with a bf16 query (rounded to bf16 first, like the spec), int32 positions of
    shape [B, S] and query/key given as [B, S, H, D] contiguous tensors."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 4, 64, generator=g).to(torch.bfloat16)
    k = torch.randn(2, 3, 2, 64, generator=g).to(torch.bfloat16)
    cache = make_cache(32, 64, torch.float32)
    positions = torch.randint(0, 32, (2, 3), dtype=torch.int32, generator=g)
    want_q = ref_rotary(positions, q, 64, cache, True)
    want_k = ref_rotary(positions, k, 64, cache, True)
    rotary.rotary_embedding(positions, q, k, 64, cache, True)
    assert_close(q, want_q)
    assert_close(k, want_k)


def test_position_zero_is_identity():
    """cos = 1, sin = 0 at position 0: the rotation must return the exact input."""
    _, q, k = qkv_buffer(4, 4, 2, 128, torch.bfloat16)
    q0, k0 = q.clone(), k.clone()
    rotary.rotary_embedding(torch.zeros(4, dtype=torch.long), q, k, 128, make_cache(8, 128, torch.bfloat16), False)
    assert torch.equal(q, q0) and torch.equal(k, k0)


def test_rejects_odd_rotary_dim():
    _, q, k = qkv_buffer(2, 2, 1, 64, torch.float32)
    with pytest.raises(ValueError, match="even"):
        rotary.rotary_embedding(torch.zeros(2, dtype=torch.long), q, k, 64, torch.zeros(8, 63), True)


# ---- through torch.ops.customop, with the launcher registered for CPU tensors -------------------


@pytest.fixture
def cpu_kernel():
    lib = torch.library.Library("customop", "IMPL")
    lib.impl("rotary_embedding", rotary.rotary_embedding, "CPU")
    yield
    lib._destroy()


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_through_torch_ops(cpu_kernel, is_neox):
    """Dispatch reaches the launcher (bits equal to a direct call), opcheck passes (the schema
    marks query and key as mutated), and torch.compile(fullgraph=True) keeps the in-place
    writes: a compiled function that rotates and then reads q and k sees the rotated values."""
    _, q, k = qkv_buffer(6, 4, 2, 64, torch.bfloat16)
    cache = make_cache(128, 32, torch.bfloat16)
    positions = torch.randint(0, 128, (6,), generator=torch.Generator().manual_seed(2))
    direct_q, direct_k = q.clone(), k.clone()
    rotary.rotary_embedding(positions, direct_q, direct_k, 64, cache, is_neox)

    op_q, op_k = q.clone(), k.clone()
    torch.ops.customop.rotary_embedding(positions, op_q, op_k, 64, cache, is_neox)
    assert torch.equal(op_q, direct_q) and torch.equal(op_k, direct_k)

    torch.library.opcheck(torch.ops.customop.rotary_embedding.default,
                          (positions, q.clone(), k.clone(), 64, cache, is_neox))

    def rotate_then_sum(positions, q, k):
        torch.ops.customop.rotary_embedding(positions, q, k, 64, cache, is_neox)
        return q * 2, k * 2

    c_q, c_k = q.clone(), k.clone()
    out_q, out_k = torch.compile(rotate_then_sum, backend="aot_eager", fullgraph=True)(positions, c_q, c_k)
    assert torch.equal(c_q, direct_q) and torch.equal(c_k, direct_k)
    assert torch.equal(out_q, direct_q * 2) and torch.equal(out_k, direct_k * 2)
