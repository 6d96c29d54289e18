"""Rotary-embedding Triton kernel under TRITON_INTERPRET=1 (CPU tensors): every row of the table
(``customop/samples/rotary.py``) through ``forward_kernel`` (the launcher as the CPU kernel of
``customop::rotary_embedding``) against the float64 references (``tests/cases/rotary.py``), in
place on q/k views of a fused qkv buffer; then the launcher directly and through
``torch.ops.customop``. (ApplyRotaryEmb's forward_kernel is this kernel with key=None on a copy;
its rows run in the native/CPU tier, forward_kernel included, against the same references.)

The kernel rotates in fp32 and rounds once into the input dtype, from cos/sin rounded to the input
dtype (as the spec casts the cache), so the bound is the output dtype's tolerance with no
product-rounding slack (the interpreter truncates fp32 -> bf16, which is still within one ulp):
``customop.testing.TOLERANCES``. In place: lanes past ``rotary_dim``, and everything around the
q/k views inside a fused qkv buffer, must keep their exact bits.
"""

from __future__ import annotations

import pytest
import torch

from customop.backends.triton import rotary
from customop.samples.rotary import DTYPES, SIZES, STYLES, style_id
from customop.testing import assert_close
from tests.backends.triton.conftest import as_cpu_kernel
from tests.cases.rotary import check_rope_outputs

pytestmark = pytest.mark.interpret


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
    rows rounded to x's dtype first (as the kernel does with a cache of another dtype)."""
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


# ---- the table, through forward_kernel -----------------------------------------------------------


#: The table's small rows, less three that this tier's other tests already launch (the interpreter
#: costs ~0.1 s a launch): one llama token (T33 has the geometry, "decode 4+2x64" the single token),
#: odd heads (the partial row has 3+1), key=None (test_key_none).
ROWS = [c for c in SIZES["small"] if c.label not in ("decode 32+8x128", "odd heads 5+3x64", "key None 4x64")]


@pytest.mark.parametrize("is_neox", STYLES, ids=style_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ROWS, ids=lambda c: c.label)
def test_rotary_in_place(case, dtype, is_neox):
    kv_heads = case.kv_heads or 0
    qkv, q, k = qkv_buffer(case.tokens, case.heads, max(kv_heads, 1), case.head_size, dtype)
    key = k if kv_heads else None
    before, q0, k0 = qkv.clone(), q.clone(), None if key is None else key.clone()
    op = case.build(is_neox, dtype)
    positions, _, _ = case.inputs(dtype, generator=torch.Generator().manual_seed(1))
    with as_cpu_kernel("rotary_embedding", rotary.rotary_embedding) as calls:
        out_q, out_k = op.forward_kernel(positions, q, key)
    assert len(calls) == 1, "forward_kernel did not reach the Triton launcher"
    assert out_q is q and out_k is key
    check_rope_outputs(op, positions, q0, k0, out_q, out_k, products_rounded=False)
    # exact bits where nothing rotates: lanes past rotary_dim (and the key when there is none), and v
    heads, heads_before = qkv.view(case.tokens, -1, case.head_size), before.view(case.tokens, -1, case.head_size)
    assert torch.equal(heads[:, :, case.rotary_dim:], heads_before[:, :, case.rotary_dim:])
    first_untouched = (case.heads + kv_heads) * case.head_size
    assert torch.equal(qkv[:, first_untouched:], before[:, first_untouched:])


# ---- the launcher directly ------------------------------------------------------------------------


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


@pytest.mark.slow
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
