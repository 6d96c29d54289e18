"""A patched Llama's prefill and static-cache decode on the Triton kernels (interpreter tier).

The rotary, rms_norm and silu_and_mul launchers run as the CPU kernels of their ``customop::``
ops (forced CUDA platform, every op enabled), on Llama-3's head layout (heads of 128). Decode at
batch > 1 is the case that broke on the H200: ``ApplyRotaryEmb`` passed the launcher a stride-0
``positions`` view of one element, and the kernel read positions past it (here: a segfault or
wrong logits; on the GPU: an illegal memory access in benchmarks/transformers_e2e.py at b=64).
The reference is the unpatched model on an identical cache.
"""

from __future__ import annotations

import pytest
import torch

from customop import Config, use_config
from customop.testing import forced_platform

transformers = pytest.importorskip("transformers",
                                   reason="transformers is not installed (the test and hf extras bring it)")

from customop.integrations import transformers as hf  # noqa: E402
from tests.backends.triton.conftest import as_cpu_kernel  # noqa: E402
from tests.integrations.test_transformers import ALL_OPS, assert_logits_close, build  # noqa: E402

pytestmark = pytest.mark.interpret


def _cache(model, batch: int) -> object:
    config = model.config
    cache = transformers.StaticCache(config=config, max_cache_len=16)
    cache.early_initialization(batch_size=batch, num_heads=config.num_key_value_heads, head_dim=config.head_dim,
                               dtype=torch.float32, device=torch.device("cpu"))
    return cache


def _prefill_and_decode(model, prompt: torch.Tensor, steps: list[torch.Tensor]) -> list[torch.Tensor]:
    cache = _cache(model, prompt.shape[0])
    with torch.no_grad():
        out = [model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1).logits]
        out += [model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits for ids in steps]
    return out


@pytest.mark.parametrize("batch", [1, 3])
def test_static_cache_decode_on_the_kernels(batch):
    from customop.backends.triton import activation, layernorm, rotary

    model = build("llama", head_dim=128)  # 4 query / 2 KV heads of 128, hidden 64
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(3, 128, (batch, 5), generator=g)
    steps = [torch.randint(3, 128, (batch, 1), generator=g) for _ in range(2)]
    want = _prefill_and_decode(model, prompt, steps)
    with forced_platform("cuda"), use_config(Config(custom_ops=ALL_OPS)):
        hf.patch(model)
    try:
        with (as_cpu_kernel("rotary_embedding", rotary.rotary_embedding) as rotary_calls,
              as_cpu_kernel("rms_norm", layernorm.rms_norm) as norm_calls,
              as_cpu_kernel("silu_and_mul", activation.silu_and_mul) as act_calls):
            got = _prefill_and_decode(model, prompt, steps)
    finally:
        hf.unpatch(model)
    # per forward: q and k per layer; two norms per layer and the final one; one MLP per layer
    assert (len(rotary_calls), len(norm_calls), len(act_calls)) == (3 * 4, 3 * 5, 3 * 2)
    for i, (g_, w) in enumerate(zip(got, want)):
        assert_logits_close(g_, w, f"batch {batch}, {'prefill' if i == 0 else f'decode step {i}'}")
