"""get_rope's rope types through ``forward_tpu`` on the XLA CPU device (the tpu tier:
``bash .ci/tpu.sh``): each row of ``customop/samples/rotary.py``'s ``ROPE_TYPES`` (the Pallas
rotary kernel with the type's cache) against its ``forward_native`` on CPU; DeepSeek-YaRN's and
LongRoPE's ``offsets``; an empty batch."""

from __future__ import annotations

import pytest
import torch

torch_xla = pytest.importorskip("torch_xla")
pytest.importorskip("torchax")

import customop  # noqa: E402
from customop.backends.tpu import xla_kernels  # noqa: E402, F401  (registers the xla kernels)
from customop.ops.rotary_embedding import (  # noqa: E402
    DeepseekScalingRotaryEmbedding, Phi3LongRoPEScaledRotaryEmbedding, RotaryEmbedding, clear_rope_cache)
from customop.samples.rotary import ROPE_TYPES, compare_rotated  # noqa: E402
from customop.testing import forced_platform  # noqa: E402

pytestmark = pytest.mark.xla
CONFIG = customop.Config(custom_ops=["all"])


@pytest.fixture(scope="module")
def dev():
    return torch_xla.device()


@pytest.fixture(autouse=True)
def _fresh_rope_cache():
    clear_rope_cache()
    yield
    clear_rope_cache()


def inputs(case_positions, head_size, dtype, tokens=7, seed=0):
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, case_positions, (tokens,), generator=gen)
    q = torch.randn(tokens, 3 * head_size, generator=gen).to(dtype)
    k = torch.randn(tokens, 2 * head_size, generator=gen).to(dtype)
    return positions, q, k


def on_xla(op, dev, *args):
    out = op(*(a.to(dev) if isinstance(a, torch.Tensor) else a for a in args))
    return tuple(None if o is None else o.cpu() for o in out)


# bf16 for every row, fp32 for two (each row costs an interpreted Pallas compile, ~3 s here)
@pytest.mark.parametrize("case,dtype", [(c, torch.bfloat16) for c in ROPE_TYPES]
                         + [(c, torch.float32) for c in ROPE_TYPES if c.label in ("longrope", "proportional")],
                         ids=lambda v: getattr(v, "label", str(v).removeprefix("torch.")))
def test_rope_type_forward_tpu(case, dtype, dev):
    with forced_platform("tpu"), customop.use_config(CONFIG):
        op = case.build(dtype)
    assert op.forward_method_name == "forward_tpu"
    positions, q, k = inputs(case.positions, case.head_size, dtype)
    with torch.no_grad():
        expected = op.forward_native(positions, q, k)
        compare_rotated(on_xla(op.to(dev), dev, positions, q, k), expected, dtype)


def test_offsets_and_empty_batch(dev):
    with forced_platform("tpu"), customop.use_config(CONFIG):
        deepseek = DeepseekScalingRotaryEmbedding(64, 64, 128, 10000.0, False, 4.0, torch.float32)
        longrope = Phi3LongRoPEScaledRotaryEmbedding(64, 64, 256, 64, 10000.0, True, torch.float32, [1.1] * 32,
                                                     [3.0] * 32)
        plain = RotaryEmbedding(64, 32, 64, 10000.0, True, torch.float32)
    positions, q, k = inputs(100, 64, torch.float32, seed=1)
    offsets = torch.arange(7) * 3
    with torch.no_grad():
        for op in (deepseek, longrope):
            expected = op.forward_native(positions, q, k, offsets)
            compare_rotated(on_xla(op.to(dev), dev, positions, q, k, offsets), expected, torch.float32)
        empty = on_xla(plain.to(dev), dev, torch.empty(0, dtype=torch.long), torch.empty(0, 128), torch.empty(0, 64))
    assert empty[0].shape == (0, 128) and empty[1].shape == (0, 64)
