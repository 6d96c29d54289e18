"""Rotary launcher with ``positions`` that are not a contiguous 1-D tensor (interpreter tier).

The kernel reads token t's position at ``pos_ptr + t``. ``ApplyRotaryEmb.forward_kernel`` used to
build the positions of a ``[B, 1, H, D]`` decode step as ``arange(1).expand(B, 1).flatten()``, a
stride-0 view of ONE element: tokens 1.. read past its storage, and on the H200 the garbage
positions then indexed past the cos/sin cache (an illegal memory access in the patched
transformers decode at batch 64). Here the storage next to the positions holds a valid but wrong
row index, so the old launcher gives deterministic wrong values instead of reading random memory.
"""

from __future__ import annotations

import pytest
import torch

from customop.backends.triton import rotary
from customop.ops.rotary_embedding.apply_rotary import ApplyRotaryEmb
from customop.testing import assert_close
from tests.backends.triton.conftest import as_cpu_kernel
from tests.backends.triton.test_rotary_triton import make_cache, qkv_buffer, ref_rotary

pytestmark = pytest.mark.interpret


def _stride0_positions(batch: int) -> torch.Tensor:
    # one real position (0) followed by a decoy (1): a kernel that ignores the stride reads the decoy
    storage = torch.tensor([0] + [1] * batch)
    return storage[:1].expand(batch)


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_expanded_positions(is_neox):
    _, q, k = qkv_buffer(5, 4, 2, 128, torch.bfloat16)
    cache = make_cache(2, 128, torch.bfloat16)
    positions = _stride0_positions(5)
    want_q, want_k = (ref_rotary(positions, t, 128, cache, is_neox) for t in (q, k))
    rotary.rotary_embedding(positions, q, k, 128, cache, is_neox)
    assert_close(q, want_q)
    assert_close(k, want_k)


def test_strided_positions():
    """Every other element of a buffer (stride 2), e.g. a column of ``[T, 2]`` positions."""
    _, q, _ = qkv_buffer(6, 3, 1, 64, torch.float32)
    cache = make_cache(16, 64, torch.float32)
    positions = torch.tensor([[3, 9], [15, 0], [1, 2], [7, 7], [0, 4], [12, 5]])[:, 0]
    assert positions.stride(0) == 2
    want = ref_rotary(positions, q, 64, cache, True)
    rotary.rotary_embedding(positions, q, None, 64, cache, True)
    assert_close(q, want)


@pytest.mark.parametrize("batch", [1, 3])
def test_apply_rotary_decode_layout(batch):
    """A ``[B, 1, H, 128]`` decode step (Hugging Face's layout after the integration's transpose)
    through forward_kernel: the positions reaching the launcher are contiguous, the result is the
    native one."""
    g = torch.Generator().manual_seed(2)
    proj = torch.randn(batch, 1, 4 * 128, generator=g).to(torch.bfloat16)
    x = proj.view(batch, 1, 4, 128)
    angles = torch.rand(1, 64, generator=g) * 6.0
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    op = ApplyRotaryEmb(enforce_enable=True)
    seen = []

    def launcher(positions, query, key, head_size, cache, is_neox):
        seen.append((positions.shape, positions.stride(), positions.tolist()))
        return rotary.rotary_embedding(positions, query, key, head_size, cache, is_neox)

    with as_cpu_kernel("rotary_embedding", launcher):
        got = op.forward_kernel(x, cos, sin)
    assert seen == [((batch,), (1,), [0] * batch)]
    assert_close(got, op.forward_native(x, cos, sin))
