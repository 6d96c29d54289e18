"""The IPEX call mappings (backends/xpu/ipex_ops.py) on CPU tensors, what is theirs beyond the
case tables (test_tables.py runs every table row of the ops IPEX serves against the float64
references): the arguments handed on, each build's names, the rotation in place in both
layouts, and IPEX's measured limits. Against the library's reference op.

Each test runs against both stand-ins (``fake_ipex``) and, in the xpu tier, the real CPU build of
IPEX 2.8.0, whose functions take CPU tensors."""

from __future__ import annotations

import pytest
import torch

from customop.backends.xpu import ipex_ops
from customop.math import rotary
from customop.testing import assert_close

def _kernels(ipex_build):
    return ipex_ops.bind_all(ipex_build.llm.functional)


def test_rms_norm_hands_on_what_ipex_cannot_take(ipex_build):
    kernel = _kernels(ipex_build)["customop::rms_norm"]
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    assert not kernel.supports(x, None, 1e-6)  # IPEX has no weight-less norm
    assert not kernel.supports(x, torch.ones(32), 1e-6)  # a weight of another dtype
    assert not kernel.supports(x.double(), torch.ones(32, dtype=torch.float64), 1e-6)
    assert not kernel.supports(torch.randn(32, 4).t(), torch.ones(4), 1e-6)  # strided rows


def test_each_build_uses_its_own_names():
    from tests.backends.xpu import fake_ipex

    x = torch.randn(3, 8)
    for build, silu, gelu in ((fake_ipex.cpu_build(), "silu_mul", "gelu_mul"),
                              (fake_ipex.xpu_build(), "silu_and_mul", "gelu_and_mul")):
        kernels = _kernels(build)
        kernels["customop::silu_and_mul"].run(x)
        kernels["customop::gelu_and_mul"].run(x, "tanh")
        assert build.llm.functional.calls == [silu, gelu]
    assert "customop::quick_gelu" not in _kernels(fake_ipex.cpu_build())  # gelu_quick: XPU build only
    assert set(ipex_ops.BINDERS) == set(_kernels(fake_ipex.xpu_build()))


def test_quick_gelu_xpu_build_only(ipex_build):
    kernels = _kernels(ipex_build)
    if not hasattr(ipex_build.llm.functional, "gelu_quick"):
        assert "customop::quick_gelu" not in kernels
        return
    x = torch.randn(4, 20)
    assert_close(kernels["customop::quick_gelu"].run(x), torch.ops.customop.quick_gelu(x))


def _rotary_case(dtype, head_size, rotary_dim, neox, layout_3d):
    tokens, heads, kv_heads, max_pos = 6, 4, 2, 40
    cache = rotary.cos_sin_cache(torch.arange(max_pos, dtype=torch.float), rotary.rope_inv_freq(10000.0, rotary_dim))
    positions = torch.randint(0, max_pos, (tokens,))
    shape_q = (tokens, heads, head_size) if layout_3d else (tokens, heads * head_size)
    shape_k = (tokens, kv_heads, head_size) if layout_3d else (tokens, kv_heads * head_size)
    return positions, torch.randn(shape_q, dtype=dtype), torch.randn(shape_k, dtype=dtype), cache.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("layout_3d", [False, True], ids=["flat", "heads"])
def test_rotary_embedding_in_place(ipex_build, dtype, neox, layout_3d):
    kernel = _kernels(ipex_build)["customop::rotary_embedding"]
    positions, query, key, cache = _rotary_case(dtype, 64, 64, neox, layout_3d)
    expected_q, expected_k = query.clone(), key.clone()
    torch.ops.customop.rotary_embedding(positions, expected_q, expected_k, 64, cache, neox)
    assert kernel.supports(positions, query, key, 64, cache, neox)
    q_ptr, k_ptr = query.data_ptr(), key.data_ptr()
    assert kernel.run(positions, query, key, 64, cache, neox) is None
    assert (query.data_ptr(), key.data_ptr()) == (q_ptr, k_ptr)
    assert_close(query, expected_q, what="query")
    assert_close(key, expected_k, what="key")


def test_rotary_embedding_partial_and_keyless(ipex_build):
    kernel = _kernels(ipex_build)["customop::rotary_embedding"]
    positions, query, key, cache = _rotary_case(torch.float32, 64, 32, True, False)
    assert not kernel.supports(positions, query, None, 64, cache, True)  # no key: the next provider
    batched = hasattr(ipex_build.llm.functional, "rotary_embedding_batched")
    # The CPU build asserts on partial rotation; the XPU build takes rot_dim itself.
    assert kernel.supports(positions, query, key, 64, cache, True) == batched
    if batched:
        expected_q, expected_k = query.clone(), key.clone()
        torch.ops.customop.rotary_embedding(positions, expected_q, expected_k, 64, cache, True)
        kernel.run(positions, query, key, 64, cache, True)
        assert_close((query, key), (expected_q, expected_k))


@pytest.mark.ipex
def test_measured_limits_of_the_cpu_build():
    """Why ``supports`` hands these calls on: IPEX 2.8.0+cpu itself refuses them (if a build ever
    accepts them, this fails and the ``supports`` checks can be widened)."""
    from tests.backends.xpu.conftest import real_ipex

    fns = real_ipex()[0].llm.functional
    # the message depends on the build's dispatch path: both are a refusal of the missing weight
    with pytest.raises(RuntimeError, match="Unsupported input type|Expected a proper Tensor but got None"):
        fns.rms_norm(torch.randn(4, 32), None, 1e-6)  # no weight-less norm
    positions, query, key, cache = _rotary_case(torch.float32, 64, 32, True, True)
    cos, sin = cache.index_select(0, positions).chunk(2, dim=-1)
    with pytest.raises(AssertionError, match="last dim"):
        fns.rotary_embedding(query, key, sin, cos, 32, True)  # partial rotation
