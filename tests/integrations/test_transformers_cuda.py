"""``patch`` on CUDA (the H200 tier, ``pytest -m cuda tests/integrations``): the replacements run
``forward_cuda``, i.e. the Triton kernels, inside Hugging Face models; the same tiny models as
test_transformers.py, moved to the GPU."""

from __future__ import annotations

import pytest
import torch

from tests.integrations.test_transformers import ARCHS, assert_logits_close, build, hf, inputs, logits, transformers

pytestmark = pytest.mark.cuda


def _on_cuda(arch: str, dtype: torch.dtype):
    return build(arch, dtype).cuda()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("arch", ARCHS)
def test_patched_model_on_the_kernels(arch, dtype):
    model = _on_cuda(arch, dtype)
    ids = inputs().cuda()
    want = logits(model, ids)
    report = hf.patch(model)
    try:
        assert report and all("forward_cuda" in text for text in report.values()), report
        assert_logits_close(logits(model, ids), want, f"{arch} cuda")
    finally:
        hf.unpatch(model)
    assert torch.equal(logits(model, ids), want)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3_moe"])
def test_greedy_decoding_on_the_kernels(arch):
    model = _on_cuda(arch, torch.float32)
    ids = inputs(seq=6).cuda()
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    with torch.no_grad():
        want = model.generate(ids, **kwargs)
        hf.patch(model)
        try:
            got = model.generate(ids, **kwargs)
        finally:
            hf.unpatch(model)
    assert torch.equal(got, want)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_inductor_fullgraph_on_the_kernels(arch):
    model = _on_cuda(arch, torch.bfloat16)
    ids = inputs().cuda()
    hf.patch(model)
    try:
        want = logits(model, ids)
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)
        with torch.no_grad():
            got = compiled(ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
        assert_logits_close(got, want, f"{arch} inductor")
    finally:
        hf.unpatch(model)
        torch._dynamo.reset()


def test_decode_step_replays_from_a_cuda_graph():
    """A patched decode step against a static cache captures and replays (what the end-to-end
    benchmark times); the replay writes the same logits as the eager step."""
    model = _on_cuda("llama", torch.bfloat16)
    config = model.config
    hf.patch(model)
    try:
        cache = transformers.StaticCache(config=config, max_cache_len=64)
        cache.early_initialization(batch_size=4, num_heads=config.num_key_value_heads, head_dim=16,
                                   dtype=torch.bfloat16, device=torch.device("cuda"))
        ids = inputs(batch=4, seq=1).cuda()

        def step():
            return model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits

        def reset(length=8):
            for layer in cache.layers:
                layer.cumulative_length.fill_(length)

        with torch.no_grad():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    reset()
                    want = step().clone()
            torch.cuda.current_stream().wait_stream(stream)
            reset()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = step()
            reset()
            graph.replay()
            torch.cuda.synchronize()
        assert torch.equal(out, want)
    finally:
        hf.unpatch(model)


@pytest.mark.parametrize("batch", [1, 4, 64])
def test_static_cache_decode_matches_the_model(batch):
    """Prefill and decode steps against a static cache at Llama-3's head layout (heads of 128),
    patched against unpatched on identical caches: at batch > 1 a decode step gave the rotary
    kernel a stride-0 positions view (an illegal memory access in benchmarks/transformers_e2e.py
    at b=64; tests/integrations/test_transformers_decode_kernels.py is the interpreter twin)."""
    model = build("llama", torch.bfloat16, head_dim=128).cuda()
    config = model.config
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(3, 128, (batch, 5), generator=g).cuda()
    steps = [torch.randint(3, 128, (batch, 1), generator=g).cuda() for _ in range(3)]

    def run():
        cache = transformers.StaticCache(config=config, max_cache_len=16)
        cache.early_initialization(batch_size=batch, num_heads=config.num_key_value_heads, head_dim=128,
                                   dtype=torch.bfloat16, device=torch.device("cuda"))
        with torch.no_grad():
            out = [model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1).logits]
            out += [model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits for ids in steps]
        torch.cuda.synchronize()
        return out

    want = run()
    hf.patch(model)
    try:
        got = run()
    finally:
        hf.unpatch(model)
    for i, (g_, w) in enumerate(zip(got, want)):
        assert_logits_close(g_, w, f"batch {batch}, step {i}")
