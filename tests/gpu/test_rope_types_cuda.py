"""get_rope's rope types on the GPU (``customop/samples/rotary.py``, ``ROPE_TYPES``): each built on
the CUDA platform with the op enabled (``forward_cuda``: the Triton kernel on the type's cache,
in place), against the float64 rotation by the op's cache rows (``tests/cases/rotary.py``) at a
realistic token count; DeepSeek-YaRN's and LongRoPE's ``offsets``; an empty batch."""

from __future__ import annotations

import pytest
import torch

import customop
from customop.ops.rotary_embedding import (
    DeepseekScalingRotaryEmbedding, Phi3LongRoPEScaledRotaryEmbedding, RotaryEmbedding, clear_rope_cache)
from customop.samples.rotary import ROPE_TYPES
from tests.cases.rotary import assert_rotated, rope_reference

pytestmark = pytest.mark.cuda
CONFIG = customop.Config(custom_ops=["all,+rotary_embedding"])


@pytest.fixture(autouse=True)
def _fresh(cuda_kernels):
    clear_rope_cache()
    yield
    clear_rope_cache()


def check(op, rows, q, k, out_q, out_k):
    """Against float64 from the cache rounded to the query's dtype; the kernel rounds once."""
    cos, sin = op.cos_sin_cache.to(q.dtype).double()[rows].chunk(2, dim=-1)
    for x, got in ((q, out_q), (k, out_k)):
        want, mag = rope_reference(x, cos, sin, op.head_size, op.is_neox_style)
        assert_rotated(got, want, mag, x.dtype, products_rounded=False)


def inputs(limit, head_size, dtype, tokens=2048, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    positions = torch.randint(0, limit, (tokens,), device="cuda", generator=g)
    q = torch.randn(tokens, 32 * head_size, device="cuda", generator=g).to(dtype)
    k = torch.randn(tokens, 8 * head_size, device="cuda", generator=g).to(dtype)
    return positions, q, k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", ROPE_TYPES, ids=lambda c: c.label)
def test_rope_type_forward_cuda(case, dtype):
    with customop.use_config(CONFIG):
        op = case.build(dtype).cuda()
    assert op.forward_method_name == "forward_cuda"
    positions, q, k = inputs(case.positions, case.head_size, dtype)
    q0, k0 = q.clone(), k.clone()
    out_q, out_k = op(positions, q, k)
    assert out_q is q and out_k is k
    rows = positions + (op.original_max_position_embeddings
                        if isinstance(op, Phi3LongRoPEScaledRotaryEmbedding) and op.use_long_rope else 0)
    check(op, rows, q0, k0, out_q, out_k)


def test_offsets_and_empty_batch():
    with customop.use_config(CONFIG):
        deepseek = DeepseekScalingRotaryEmbedding(64, 64, 4096, 10000.0, False, 4.0, torch.bfloat16).cuda()
        longrope = Phi3LongRoPEScaledRotaryEmbedding(64, 64, 8192, 4096, 10000.0, True, torch.bfloat16,
                                                     [1.1] * 32, [3.0] * 32).cuda()
        plain = RotaryEmbedding(128, 128, 64, 10000.0, True, torch.bfloat16).cuda()
    positions, q, k = inputs(4000, 64, torch.bfloat16, tokens=257, seed=1)
    offsets = torch.arange(257, device="cuda") % 7
    for op, extra in ((deepseek, 0), (longrope, 4096)):
        q0, k0 = q.clone(), k.clone()
        out = op(positions, q0.clone(), k0.clone(), offsets)
        check(op, positions + offsets + extra, q0, k0, *out)
    empty = plain(torch.empty(0, dtype=torch.long, device="cuda"), torch.empty(0, 4096, device="cuda",
                  dtype=torch.bfloat16), torch.empty(0, 1024, device="cuda", dtype=torch.bfloat16))
    assert empty[0].shape == (0, 4096) and empty[1].shape == (0, 1024)
    torch.cuda.synchronize()
