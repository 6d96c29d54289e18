"""The rotary scaling variants (linear, dynamic NTK, YaRN, Llama-3, DeepSeek-YaRN), get_rope and
M-RoPE: each cache against its formula in float64, written here."""

from __future__ import annotations

import math

import pytest
import torch

from customop.ops.rotary_embedding import (
    DeepseekScalingRotaryEmbedding, DynamicNTKScalingRotaryEmbedding, LinearScalingRotaryEmbedding,
    DualChunkRotaryEmbedding, Llama3RotaryEmbedding, MRotaryEmbedding, RotaryEmbedding, YaRNScalingRotaryEmbedding,
    get_rope)
from customop.testing import randn
from tests.ops.rope_helpers import _compile_off_and_fresh_rope_cache  # noqa: F401  (autouse fixture)
from tests.cases.rotary import EPS32, assert_rotated, inv_freq64, rope_reference
from tests.ops.rope_helpers import BASE, D, build, dtype_id

# ---- scaling variants: each cache against its formula in float64 --------------------------------


def yarn_inv_freq64(base, d, factor, original, beta_fast=32, beta_slow=1, extrapolation=1.0):
    def turns_at(rotations):  # the pair index whose wavelength fits `rotations` times in `original`
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(turns_at(beta_fast)), 0), min(math.ceil(turns_at(beta_slow)), d - 1)
    plain = inv_freq64(base, d)
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
    keep = (1 - ramp) * extrapolation
    return plain / factor * (1 - keep) + plain * keep


def llama3_inv_freq64(base, d, factor, low_ff, high_ff, original):
    out = []
    for f in inv_freq64(base, d).tolist():
        wavelen = 2 * math.pi / f
        if wavelen < original / high_ff:
            out.append(f)
        elif wavelen > original / low_ff:
            out.append(f / factor)
        else:
            a = (original / wavelen - low_ff) / (high_ff - low_ff)
            out.append((1 - a) * f / factor + a * f)
    return torch.tensor(out, dtype=torch.float64)


def table64(t, inv_freq, mscale=1.0):
    angles = t.double()[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), -1) * mscale, angles


def mscale(s, m=1.0):
    return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1


ORIG = 256
VARIANTS = {
    "default": (lambda: RotaryEmbedding(D, D, ORIG, BASE, True, torch.float32),
                lambda: table64(torch.arange(ORIG), inv_freq64(BASE, D))),
    "linear": (lambda: LinearScalingRotaryEmbedding(D, D, ORIG, BASE, True, [1.0, 2.5], torch.float32),
               lambda: table64(torch.cat((torch.arange(ORIG), torch.arange(640) / 2.5)), inv_freq64(BASE, D))),
    "dynamic": (lambda: DynamicNTKScalingRotaryEmbedding(D, D, ORIG, BASE, True, 2.0, torch.float32),
                lambda: table64(torch.arange(2 * ORIG), inv_freq64(BASE * 3.0 ** (D / (D - 2)), D))),
    "yarn": (lambda: YaRNScalingRotaryEmbedding(D, D, ORIG, BASE, True, 4.0, torch.float32, attn_factor=0.9),
             lambda: table64(torch.arange(4 * ORIG), yarn_inv_freq64(BASE, D, 4.0, ORIG), mscale(4.0) * 0.9)),
    "yarn-partial-rotary": (
        lambda: YaRNScalingRotaryEmbedding(128, 96, ORIG, BASE, True, 2.0, torch.float32, beta_fast=16),
        lambda: table64(torch.arange(2 * ORIG), yarn_inv_freq64(BASE, 96, 2.0, ORIG, beta_fast=16), mscale(2.0))),
    "llama3": (lambda: Llama3RotaryEmbedding(D, D, 1024, 500000.0, True, torch.float32, 8.0, 1.0, 4.0, 512),
               lambda: table64(torch.arange(1024), llama3_inv_freq64(500000.0, D, 8.0, 1.0, 4.0, 512))),
    "deepseek_yarn": (
        lambda: DeepseekScalingRotaryEmbedding(D, D, ORIG, BASE, False, 4.0, torch.float32, mscale=0.707,
                                               mscale_all_dim=1.0, beta_slow=2),
        lambda: table64(torch.arange(4 * ORIG), yarn_inv_freq64(BASE, D, 4.0, ORIG, beta_slow=2),
                        mscale(4.0, 0.707) / mscale(4.0, 1.0))),
    "mrope": (lambda: MRotaryEmbedding(D, D, ORIG, BASE, True, torch.float32, [8, 12, 12]),
              lambda: table64(torch.arange(4 * ORIG), inv_freq64(BASE, D))),
    "mrope-yarn": (  # vLLM computes YaRN's correction range from the 4x cache length
        lambda: MRotaryEmbedding(D, D, ORIG, BASE, True, torch.float32, [8, 12, 12], scaling_factor=2.0),
        lambda: table64(torch.arange(8 * ORIG), yarn_inv_freq64(BASE, D, 2.0, 4 * ORIG), mscale(2.0))),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_scaling_variant_cache(variant):
    make_op, formula = VARIANTS[variant]
    op = make_op()
    want, angles = formula()
    assert op.name == "rotary_embedding" and isinstance(op, RotaryEmbedding)
    assert op.cos_sin_cache.shape == want.shape and op.cos_sin_cache.dtype == torch.float32
    # fp32 arithmetic (as in vLLM and HF): the angle is off by a few ulps of itself, cos/sin by
    # that plus their own rounding.
    scale = want.abs().max()
    bound = scale * (8 * EPS32 * torch.cat((angles, angles), -1) + 4 * EPS32)
    err = (op.cos_sin_cache.double() - want).abs()
    assert (err <= bound).all(), f"{variant}: max err {float(err.max()):.3g}, worst excess {float((err - bound).max()):.3g}"


def test_linear_scaling_offsets():
    op = LinearScalingRotaryEmbedding(D, D, ORIG, BASE, True, [1.0, 2.5], torch.float32)
    assert op.scaling_factor_to_offset == {1.0: 0, 2.5: ORIG}


# ---- get_rope ----------------------------------------------------------------------------------


@pytest.mark.parametrize("params,cls", [
    (None, RotaryEmbedding),
    ({"rope_type": "linear", "factor": 2.0}, LinearScalingRotaryEmbedding),
    ({"type": "dynamic", "factor": 2.0}, DynamicNTKScalingRotaryEmbedding),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 16,
      "mscale": 3.0}, YaRNScalingRotaryEmbedding),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 512}, Llama3RotaryEmbedding),
    ({"rope_type": "deepseek_yarn", "factor": 4.0, "original_max_position_embeddings": 256, "mscale": 1.0,
      "mscale_all_dim": 1.0}, DeepseekScalingRotaryEmbedding),
    ({"type": "mrope", "mrope_section": [8, 12, 12]}, MRotaryEmbedding),
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256,
      "mrope_section": [8, 12, 12], "mrope_interleaved": True}, MRotaryEmbedding),
], ids=["default", "linear", "dynamic", "yarn", "llama3", "deepseek_yarn", "mrope", "mrope-yarn"])
def test_get_rope_builds_and_shares(params, cls):
    rope = get_rope(D, D, 1024, BASE, True, params, torch.float32)
    assert type(rope) is cls
    assert get_rope(D, D, 1024, BASE, True, None if params is None else dict(params), torch.float32) is rope
    assert get_rope(D, D, 1024, BASE, False, params, torch.float32) is not rope


def test_get_rope_parameters_form_and_partial_rotary():
    rope = get_rope(128, max_position=1024, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                              "partial_rotary_factor": 0.5})
    assert (rope.rotary_dim, rope.base, rope.dtype) == (64, 1e6, torch.get_default_dtype())
    assert get_rope(128, 128, 1024, 1e6, True, partial_rotary_factor=0.25).rotary_dim == 32
    dual = get_rope(D, D, 1024, BASE, True, dual_chunk_attention_config={"chunk_size": 64, "local_size": 8,
                                                                         "original_max_position_embeddings": 512})
    assert type(dual) is DualChunkRotaryEmbedding and (dual.chunk_size, dual.local_size) == (64, 8)


def test_get_rope_errors():
    with pytest.raises(ValueError, match=r"unknown rope type 'su'; known: default, linear, dynamic, yarn"):
        get_rope(D, D, 1024, BASE, True, {"rope_type": "su"})
    with pytest.raises(ValueError, match="'factor'"):
        get_rope(D, D, 1024, BASE, True, {"rope_type": "linear"})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        get_rope(D, D, 1024, BASE, True, partial_rotary_factor=1.5)


# ---- M-RoPE ------------------------------------------------------------------------------------


@pytest.mark.parametrize("interleaved", [False, True], ids=["sections", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_mrope_sections(dtype, interleaved):
    section, tokens = [8, 12, 12], 5
    op = build(MRotaryEmbedding, D, D, ORIG, BASE, True, dtype, section, interleaved)
    gen = torch.Generator().manual_seed(3)
    positions = torch.randint(0, 4 * ORIG, (3, tokens), generator=gen)
    q, k = randn(tokens, 4 * D, dtype=dtype, generator=gen), randn(tokens, 2 * D, dtype=dtype, generator=gen)

    def row_of(j):  # which of (t, h, w) drives frequency lane j
        if interleaved:
            return 1 if j % 3 == 1 and j < 3 * section[1] else 2 if j % 3 == 2 and j < 3 * section[2] else 0
        return 0 if j < section[0] else 1 if j < section[0] + section[1] else 2

    table = op.cos_sin_cache.double()
    cos = torch.stack([torch.stack([table[positions[row_of(j), t], j] for j in range(D // 2)]) for t in range(tokens)])
    sin = torch.stack([torch.stack([table[positions[row_of(j), t], D // 2 + j] for j in range(D // 2)])
                       for t in range(tokens)])
    out_q, out_k = op(positions, q, k)  # native on every platform
    for x, got in ((q, out_q), (k, out_k)):
        want, mag = rope_reference(x, cos, sin, D, True)
        assert_rotated(got, want, mag, dtype)
    text_q, _ = op(positions[0], q, k)  # 1-D positions: plain RoPE
    assert torch.equal(text_q, build(RotaryEmbedding, D, D, 4 * ORIG, BASE, True, dtype).forward_native(
        positions[0], q, k)[0])
