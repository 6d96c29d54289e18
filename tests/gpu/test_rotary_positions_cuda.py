"""Rotary launcher on the GPU with ``positions`` that are not a contiguous 1-D tensor: the
decode-step layout (one position expanded over the batch, stride 0) and a strided column. Before
the launcher made them contiguous the kernel read positions past the tensor, and the garbage
positions indexed past the cos/sin cache (illegal memory access in the patched transformers
decode at batch 64). The storage next to the expanded position holds a valid decoy row index, so
a regression shows as wrong values rather than a poisoned CUDA context."""

from __future__ import annotations

import pytest
import torch

from customop.ops.rotary_embedding.apply_rotary import ApplyRotaryEmb
from tests.gpu.conftest import assert_close_on_device
from tests.gpu.test_rotary_cuda import make_cache, ref_rotary

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def rotary(cuda_kernels):
    from customop.backends.triton import rotary as module

    return module


@pytest.mark.parametrize("batch", [4, 64])
def test_expanded_positions(rotary, batch):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, 32 * 128, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(batch, 8 * 128, device="cuda", generator=g).to(torch.bfloat16)
    cache = make_cache(128, torch.bfloat16)
    storage = torch.full((batch + 1,), 1000, device="cuda")
    storage[0] = 7
    positions = storage[:1].expand(batch)
    want_q, want_k = (ref_rotary(positions, t, 128, cache, True) for t in (q, k))
    rotary.rotary_embedding(positions, q, k, 128, cache, True)
    torch.cuda.synchronize()
    assert_close_on_device(q, want_q)
    assert_close_on_device(k, want_k)


def test_strided_positions(rotary):
    q = torch.randn(6, 4 * 64, device="cuda")
    cache = make_cache(64, torch.float32)
    positions = torch.tensor([[3, 9], [15, 0], [1, 2], [7, 7], [0, 4], [12, 5]], device="cuda")[:, 0]
    want = ref_rotary(positions, q, 64, cache, True)
    rotary.rotary_embedding(positions, q, None, 64, cache, True)
    assert_close_on_device(q, want)


@pytest.mark.parametrize("batch", [1, 64])
def test_apply_rotary_decode_layout(cuda_kernels, batch):
    """Hugging Face's decode layout through ApplyRotaryEmb: ``[B, 1, 32, 128]`` bf16 views of the
    projection, cos/sin ``[1, 64]``."""
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(batch, 1, 32 * 128, device="cuda", generator=g).to(torch.bfloat16).view(batch, 1, 32, 128)
    angles = torch.rand(1, 64, device="cuda", generator=g) * 6.0
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    op = ApplyRotaryEmb(enforce_enable=True)
    got = op.forward_kernel(x, cos, sin)
    torch.cuda.synchronize()
    assert_close_on_device(got, op.forward_native(x, cos, sin))
