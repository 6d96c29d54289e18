"""Sample builders for the rotary family (``assert_conforms``, ``customop check``)."""

from __future__ import annotations

import torch

from customop.testing import Sample, assert_close, randn, register_samples

MAX_POS = 4096


def compare_rotated(actual, expected, dtype: torch.dtype) -> None:
    """The dtype's tolerance plus one rounding of each product ``x * cos``: paths that keep the
    products in fp32 (compiled, kernels) and ones that round them to the dtype (eager) may differ
    by that much, which for |x| ~ 4 exceeds a bf16 ulp of the result."""
    tensors = [t for t in (actual if isinstance(actual, (tuple, list)) else (actual,)) if t is not None]
    magnitude = max((float(t.detach().abs().max()) for t in tensors if t.numel()), default=0.0)
    atol = 2 * torch.finfo(dtype).eps * magnitude if dtype != torch.float32 else None
    assert_close(actual, expected, dtype, atol=atol)


def _positions(tokens: int, gen: torch.Generator, device: str) -> torch.Tensor:
    return torch.randint(0, MAX_POS, (tokens,), generator=gen).to(device)


@register_samples("rotary_embedding")
def rotary_embedding_samples(dtype: torch.dtype, device: str, gen: torch.Generator) -> list[Sample]:
    samples = []
    # (tokens, q heads, kv heads, head_size, rotary_dim, neox, with key)
    # Two samples only: each (dtype, style, key or not) is one compiled specialization on the CPU,
    # and torch.compile's default recompile limit is 8.
    for tokens, heads, kv_heads, head, rot, neox, with_key in (
        (17, 32, 8, 128, 128, True, True),  # Llama-3-8B heads
        (3, 3, 1, 64, 32, False, False),    # odd head count, partial rotary, GPT-J, key=None
    ):
        q = randn(tokens, heads * head, dtype=dtype, device=device, generator=gen)
        k = randn(tokens, kv_heads * head, dtype=dtype, device=device, generator=gen) if with_key else None
        samples.append(Sample(
            init_kwargs=dict(head_size=head, rotary_dim=rot, max_position_embeddings=MAX_POS, base=10000.0,
                             is_neox_style=neox, dtype=dtype),
            args=(_positions(tokens, gen, device), q, k), compare=compare_rotated,
            label=f"T={tokens} H={heads}{f'/{kv_heads}' if with_key else ' key=None'} D={head} rot={rot} "
                  f"{'neox' if neox else 'gptj'}"))
    return samples


@register_samples("apply_rotary_emb")
def apply_rotary_emb_samples(dtype: torch.dtype, device: str, gen: torch.Generator) -> list[Sample]:
    samples = []
    for shape, rot, neox, fp32 in (((2, 5, 3, 64), 64, True, False), ((7, 4, 32), 16, False, True),
                                   ((1, 9, 2, 80), 40, True, False)):
        x = randn(*shape, dtype=dtype, device=device, generator=gen)
        angles = torch.rand(shape[-3], rot // 2, generator=gen) * 6.3
        samples.append(Sample(
            init_kwargs=dict(enforce_enable=False, is_neox_style=neox, enable_fp32_compute=fp32),
            args=(x, angles.cos().to(device), angles.sin().to(device)), compare=compare_rotated,
            label=f"x={shape} rot={rot} {'neox' if neox else 'gptj'}{' fp32' if fp32 else ''}"))
    return samples


@register_samples("dual_chunk_rotary_embedding")
def dual_chunk_samples(dtype: torch.dtype, device: str, gen: torch.Generator) -> list[Sample]:
    tokens, heads, kv_heads, head = 6, 2, 1, 32
    return [Sample(
        init_kwargs=dict(head_size=head, rotary_dim=head, max_position_embeddings=64, base=10000.0,
                         is_neox_style=True, dtype=dtype, chunk_size=16, local_size=4),
        args=(torch.randint(0, 64, (tokens,), generator=gen).to(device),
              randn(tokens, heads * head, dtype=dtype, device=device, generator=gen),
              randn(tokens, kv_heads * head, dtype=dtype, device=device, generator=gen)),
        compare=compare_rotated, label=f"T={tokens} chunk 16/local 4")]
