"""``MambaMixer2`` and ``ShortConv`` against transformers' own layers (``Mamba2Mixer``,
``Lfm2ShortConv``) built from a tiny random config, with the same weights loaded into customop's
op through its ``weight_loader``s (the checkpoint's names and layouts; only ``A_log`` is renamed
``A``, whose loader takes ``-exp``).

The batch is a varlen prefill of two requests for customop (``query_start_loc``); transformers runs
each request alone (batch 1, no padding mask) with its own cache. Compared in fp32, and for
``ShortConv`` in float64 too: the outputs and the final conv and SSM states (transformers keeps
``K`` conv columns, customop ``K - 1``: the last ``K - 1`` are compared). A second test continues
the same requests with a second prefill chunk (``has_initial_state``) and one decode token, against
transformers continuing from its cache. No float64 run of ``Mamba2Mixer``: transformers accepts
float64 there, but its torch path computes the gated norm and the chunked scan in fp32
(``.float()``, ``.to(torch.float32)``) and keeps the SSM state in fp32, so it agrees only to fp32
precision (about 1e-7 relative); ``Lfm2ShortConv`` has no such casts and agrees to about 1e-16.

Semantics checked to agree (so no tolerance is loosened): the gated norm normalises per group of
``intermediate_size / n_groups`` lanes after the ``silu(gate)`` product in both (vLLM 0.33's
``Mixer2RMSNormGated`` does the same), and transformers' time-step clamp uses
``config.time_step_limit``, whose default ``(0, inf)`` is a no-op after softplus. vLLM 0.33's
``MambaMixer2`` takes no time-step limit and always scans with ``dt_limit=(0.0, inf)``, so a
checkpoint with a finite ``time_step_limit`` would differ in transformers' chunked prefill only
(its decode step does not clamp); the configs here keep the default.

No download: the configs are built in place and transformers' torch fallbacks run (no
``mamba_ssm`` / ``causal_conv1d`` / hub kernels in this environment). The sizes are tiny; the
first request (37 tokens) passes customop's CPU chunked-form threshold (32) and spans several of
transformers' chunks with a padded last one, the second (2 tokens) is shorter than the conv window.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
cache_utils = pytest.importorskip("transformers.cache_utils")

from customop.config import Config, use_config  # noqa: E402
from customop.ops.mamba import MambaMetadata, MambaMixer2, ShortConv  # noqa: E402

PATHS = ["forward_native", "forward_cpu", "forward_kernel"]
LENS = (37, 2)
SLOTS = (2, 1)  # slot 0 is the null block; one slot per request
#: per dtype of the compared tensor, relative to the largest magnitude of the expected one
RTOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def _close(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert got.shape == expected.shape, f"{what}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    assert got.dtype == expected.dtype, f"{what}: dtype {got.dtype} != {expected.dtype}"
    rtol = RTOL[got.dtype]
    scale = expected.abs().max().item()
    err = (got - expected).abs().max().item()
    assert err <= rtol * max(scale, 1e-6), f"{what}: max |diff| {err:.3g} > {rtol} x max |expected| {scale:.3g}"


def _hf_cache():
    """A one-layer transformers cache holding a conv and a recurrent state."""
    return cache_utils.Cache(layers=[cache_utils.LinearAttentionLayer()])


def _randomise(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Random checkpoint values with O(1) activations: unit-gain projections, decays A in
    [0.5, 4], steps softplus(dt_bias) around 0.05-0.5."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            u = torch.rand(p.shape, generator=gen)
            if name == "A_log":
                value = torch.log(0.5 + 3.5 * u)
            elif name == "dt_bias":
                step = 0.05 + 0.45 * u
                value = step + torch.log(-torch.expm1(-step))
            elif name in ("D", "norm.weight"):
                value = 1.0 + 0.3 * torch.randn(p.shape, generator=gen)
            elif name.endswith("bias"):
                value = 0.2 * torch.randn(p.shape, generator=gen)
            elif name.startswith("conv"):
                value = 0.5 * torch.randn(p.shape, generator=gen)
            else:
                value = torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5
            p.copy_(value)


def _load(op: torch.nn.Module, hf: torch.nn.Module, renames: dict[str, str]) -> None:
    """Every transformers parameter into customop's op through the op's loaders, as a checkpoint
    would be loaded; every op parameter must be covered."""
    loaded = set()
    for name, value in hf.named_parameters():
        target = renames.get(name, name)
        param = op.get_parameter(target)
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            param.data.copy_(value.detach())
        else:
            loader(param, value.detach().clone())
        loaded.add(target)
    missing = {n for n, _ in op.named_parameters()} - loaded
    assert not missing, f"customop parameters with no transformers counterpart: {sorted(missing)}"


def _poisoned_caches(op, n_slots: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Caches full of NaN: prefills without an initial state must not read them."""
    return [torch.full((n_slots, *shape), float("nan"), dtype=dtype) for shape in op.get_state_shape()]


def _hf_conv_state(cache) -> torch.Tensor:
    return cache.layers[0].conv_states[0]  # (1, C, K)


def _hf_ssm_state(cache) -> torch.Tensor:
    return cache.layers[0].recurrent_states[0]  # (1, heads, head_dim, N)


def _check_conv_state(conv_cache: torch.Tensor, slot: int, hf_cache, k: int, what: str) -> None:
    # customop keeps the last K-1 inputs oldest first as (K-1, C); transformers K of them as (C, K)
    _close(conv_cache[slot], _hf_conv_state(hf_cache)[0, :, -(k - 1):].T, f"{what}: conv state")


# ---- Mamba-2 ----------------------------------------------------------------------------------------


def _mamba2_pair(n_groups: int, seed: int = 0):
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

    config = transformers.Mamba2Config(
        hidden_size=16, expand=2, num_heads=8, head_dim=4, state_size=8, n_groups=n_groups, conv_kernel=4,
        chunk_size=8, use_conv_bias=True, use_bias=True, layer_norm_epsilon=1e-5, num_hidden_layers=1,
        vocab_size=32)
    assert tuple(config.time_step_limit) == (0.0, float("inf"))  # vLLM's fixed dt_limit (docstring)
    hf = Mamba2Mixer(config, layer_idx=0).eval()
    _randomise(hf, torch.Generator().manual_seed(seed))
    with use_config(Config(custom_ops=["all"])):
        op = MambaMixer2(hidden_size=16, ssm_state_size=8, conv_kernel_size=4, intermediate_size=32,
                         use_conv_bias=True, use_bias=True, n_groups=n_groups, num_heads=8, head_dim=4,
                         rms_norm_eps=1e-5, params_dtype=torch.float32)
    _load(op, hf, {"A_log": "A"})
    return config, hf, op


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n_groups", [1, 2])
def test_mamba_mixer2_prefill_matches_transformers(path, n_groups):
    config, hf, op = _mamba2_pair(n_groups)
    h = torch.randn(sum(LENS), config.hidden_size, generator=torch.Generator().manual_seed(1))
    conv_cache, ssm_cache = _poisoned_caches(op, 3)
    meta = MambaMetadata.build(prefill_lens=LENS, prefill_slots=SLOTS, has_initial_state=(False, False),
                               chunk_size=8)
    with torch.no_grad():
        out = getattr(op, path)(h, conv_cache, ssm_cache, meta)
        starts = [0, LENS[0]]
        for i, (start, n, slot) in enumerate(zip(starts, LENS, SLOTS)):
            cache = _hf_cache()
            expected = hf(h[None, start:start + n], cache=cache)[0]
            what = f"{path}, {n_groups} groups, request {i} ({n} tokens)"
            _close(out[start:start + n], expected, f"{what}: output")
            _check_conv_state(conv_cache, slot, cache, config.conv_kernel, what)
            _close(ssm_cache[slot], _hf_ssm_state(cache)[0], f"{what}: SSM state")


@pytest.mark.parametrize("path", PATHS)
def test_mamba_mixer2_continues_like_transformers(path):
    """A second prefill chunk from the cached states, then one decode token: the same as
    transformers continuing each request from its cache (its chunked and its recurrent step)."""
    config, hf, op = _mamba2_pair(n_groups=2, seed=2)
    gen = torch.Generator().manual_seed(3)
    first, second = (5, 3), (6, 4)  # request 1's first chunk is shorter than the conv window
    parts = [torch.randn(sum(lens), config.hidden_size, generator=gen) for lens in (first, second)]
    step = torch.randn(2, config.hidden_size, generator=gen)
    conv_cache, ssm_cache = _poisoned_caches(op, 3)
    with torch.no_grad():
        op.forward_native(parts[0], conv_cache, ssm_cache,
                          MambaMetadata.build(prefill_lens=first, prefill_slots=SLOTS, has_initial_state=(False, False),
                                              chunk_size=4))
        out2 = getattr(op, path)(parts[1], conv_cache, ssm_cache,
                                 MambaMetadata.build(prefill_lens=second, prefill_slots=SLOTS,
                                                     has_initial_state=(True, True), chunk_size=4))
        out3 = getattr(op, path)(step, conv_cache, ssm_cache, MambaMetadata.build(decode_slots=SLOTS))
        for i, slot in enumerate(SLOTS):
            cache = _hf_cache()
            a, b = sum(first[:i]), sum(second[:i])
            hf(parts[0][None, a:a + first[i]], cache=cache)
            what = f"{path}, request {i}"
            _close(out2[b:b + second[i]], hf(parts[1][None, b:b + second[i]], cache=cache)[0],
                   f"{what}: second chunk")
            _close(out3[i:i + 1], hf(step[None, i:i + 1], cache=cache)[0], f"{what}: decode step")
            _check_conv_state(conv_cache, slot, cache, config.conv_kernel, what)
            _close(ssm_cache[slot], _hf_ssm_state(cache)[0], f"{what}: SSM state")


# ---- LFM2 short conv ------------------------------------------------------------------------------


def _short_conv_pair(seed: int = 0, dtype: torch.dtype = torch.float32):
    from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

    config = transformers.Lfm2Config(hidden_size=12, conv_L_cache=3, conv_bias=True, num_hidden_layers=1,
                                     layer_types=["conv"], num_attention_heads=2, num_key_value_heads=1,
                                     intermediate_size=16, vocab_size=32)
    hf = Lfm2ShortConv(config, layer_idx=0).eval().to(dtype)
    _randomise(hf, torch.Generator().manual_seed(seed))
    with use_config(Config(custom_ops=["all"])):
        op = ShortConv(config, dim=config.hidden_size, layer_idx=0, params_dtype=dtype)
    _load(op, hf, {})
    return config, hf, op


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("path", PATHS)
def test_short_conv_prefill_matches_transformers(path, dtype):
    config, hf, op = _short_conv_pair(dtype=dtype)
    h = torch.randn(sum(LENS), config.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    (conv_cache,) = _poisoned_caches(op, 3, dtype)
    meta = MambaMetadata.build(prefill_lens=LENS, prefill_slots=SLOTS, has_initial_state=(False, False))
    with torch.no_grad():
        out = getattr(op, path)(h, conv_cache, meta)
        for i, (start, n, slot) in enumerate(zip([0, LENS[0]], LENS, SLOTS)):
            cache = _hf_cache()
            expected = hf(h[None, start:start + n], cache=cache)[0]
            what = f"{path}, request {i} ({n} tokens)"
            _close(out[start:start + n], expected, f"{what}: output")
            _check_conv_state(conv_cache, slot, cache, config.conv_L_cache, what)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("path", PATHS)
def test_short_conv_continues_like_transformers(path, dtype):
    config, hf, op = _short_conv_pair(seed=2, dtype=dtype)
    gen = torch.Generator().manual_seed(3)
    first, second = (4, 1), (3, 5)
    parts = [torch.randn(sum(lens), config.hidden_size, generator=gen).to(dtype) for lens in (first, second)]
    step = torch.randn(2, config.hidden_size, generator=gen).to(dtype)
    (conv_cache,) = _poisoned_caches(op, 3, dtype)
    with torch.no_grad():
        op.forward_native(parts[0], conv_cache, MambaMetadata.build(prefill_lens=first, prefill_slots=SLOTS,
                                                                    has_initial_state=(False, False)))
        out2 = getattr(op, path)(parts[1], conv_cache, MambaMetadata.build(prefill_lens=second, prefill_slots=SLOTS,
                                                                           has_initial_state=(True, True)))
        out3 = getattr(op, path)(step, conv_cache, MambaMetadata.build(decode_slots=SLOTS))
        for i, slot in enumerate(SLOTS):
            cache = _hf_cache()
            a, b = sum(first[:i]), sum(second[:i])
            hf(parts[0][None, a:a + first[i]], cache=cache)
            what = f"{path}, request {i}"
            _close(out2[b:b + second[i]], hf(parts[1][None, b:b + second[i]], cache=cache)[0],
                   f"{what}: second chunk")
            _close(out3[i:i + 1], hf(step[None, i:i + 1], cache=cache)[0], f"{what}: decode step")
            _check_conv_state(conv_cache, slot, cache, config.conv_L_cache, what)
