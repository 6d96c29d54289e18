"""The rope types' cos/sin caches (row count and values) against vLLM 0.33's formulas in float64
(``tests/cases/rotary.py``), in every dtype, each class built directly with 0.33's constructor;
the defects of issue 15 (dynamic NTK's rows and base, YaRN's magnitude keys, M-RoPE + YaRN);
M-RoPE's layouts. get_rope's table and call forms: test_rope_get_rope.py; the types on every
forward path: test_rope_types.py."""

from __future__ import annotations

import math

import pytest
import torch

from customop.ops.rotary_embedding import (
    BailingMRotaryEmbedding, DeepseekScalingRotaryEmbedding, DynamicNTKAlphaRotaryEmbedding,
    DynamicNTKScalingRotaryEmbedding, Gemma4RotaryEmbedding, LinearScalingRotaryEmbedding, Llama3RotaryEmbedding,
    Llama4VisionRotaryEmbedding, MRotaryEmbedding, MRotaryEmbeddingInterleaved, NTKScalingRotaryEmbedding,
    Phi3LongRoPEScaledRotaryEmbedding, RotaryEmbedding, YaRNScalingRotaryEmbedding)
from customop.samples.rotary import DTYPES, ROPE_TYPES
from customop.testing import randn
from tests.cases.rotary import (
    assert_cache_matches, assert_rotated, get_mscale64, inv_freq64, rope_cache64, rope_reference, table64,
    yarn_inv_freq64)
from tests.ops.rope_helpers import _compile_off_and_fresh_rope_cache  # noqa: F401  (autouse fixture)
from tests.ops.rope_helpers import BASE, D, build, dtype_id

ORIG = 256
SHORT, LONG = [1.0 + 0.05 * i for i in range(D // 2)], [1.0 + 0.9 * i for i in range(D // 2)]

# ---- every class with vLLM 0.33's constructor: (build(dtype), float64 (table, angles)) ------------------
CLASSES = {
    "default": (lambda dt: RotaryEmbedding(D, D, ORIG, BASE, True, dt),
                lambda: table64(torch.arange(ORIG), inv_freq64(BASE, D))),
    "linear": (lambda dt: LinearScalingRotaryEmbedding(D, D, ORIG, BASE, True, [1.0, 2.5], dt),
               lambda: table64(torch.cat((torch.arange(ORIG), torch.arange(640) / 2.5)), inv_freq64(BASE, D))),
    # 0.33: max_position rows; the base grows only past max_trained_positions (here equal: plain RoPE)
    "dynamic-untrained-equal": (lambda dt: DynamicNTKScalingRotaryEmbedding(D, D, ORIG, ORIG, BASE, True, 2.0, dt),
                                lambda: table64(torch.arange(ORIG), inv_freq64(BASE, D))),
    "dynamic-past-trained": (
        lambda dt: DynamicNTKScalingRotaryEmbedding(D, D, 4 * ORIG, ORIG, BASE, True, 2.0, dt),
        lambda: table64(torch.arange(4 * ORIG), inv_freq64(BASE * (2.0 * 4 - 1.0) ** (D / (D - 2)), D))),
    "dynamic-alpha": (lambda dt: DynamicNTKAlphaRotaryEmbedding(D, D, ORIG, BASE, False, 1000.0, dt),
                      lambda: table64(torch.arange(ORIG), inv_freq64(BASE * 1000.0 ** (D / (D - 2)), D))),
    "ntk-fixed": (lambda dt: NTKScalingRotaryEmbedding(D, 48, ORIG, BASE, True, 4.0, dt),
                  lambda: rope_cache64(D, ORIG, {"rope_type": "ntk", "factor": 4.0, "rope_dim": 48})),
    "ntk-mixed": (lambda dt: NTKScalingRotaryEmbedding(D, D, ORIG, BASE, True, 4.0, dt, 0.75),
                  lambda: rope_cache64(D, ORIG, {"rope_type": "ntk", "factor": 4.0, "mixed_b": 0.75})),
    "yarn": (lambda dt: YaRNScalingRotaryEmbedding(D, D, ORIG, BASE, True, 4.0, dt),
             lambda: table64(torch.arange(4 * ORIG), yarn_inv_freq64(BASE, D, 4.0, ORIG), get_mscale64(4.0))),
    # Mistral's converted configs: attention_factor=1.0 (no temperature at all, x1.28 at factor 16 before)
    "yarn-attention_factor": (
        lambda dt: YaRNScalingRotaryEmbedding(D, D, 64, BASE, True, 16.0, dt, attention_factor=1.0),
        lambda: table64(torch.arange(16 * 64), yarn_inv_freq64(BASE, D, 16.0, 64), 1.0)),
    "yarn-mscale-ratio": (
        lambda dt: YaRNScalingRotaryEmbedding(D, D, ORIG, BASE, True, 4.0, dt, mscale=1.0, mscale_all_dim=0.5),
        lambda: table64(torch.arange(4 * ORIG), yarn_inv_freq64(BASE, D, 4.0, ORIG),
                        get_mscale64(4.0, 1.0) / get_mscale64(4.0, 0.5))),
    "yarn-mscale-alone-ignored": (
        lambda dt: YaRNScalingRotaryEmbedding(D, D, ORIG, BASE, True, 4.0, dt, mscale=3.0),
        lambda: table64(torch.arange(4 * ORIG), yarn_inv_freq64(BASE, D, 4.0, ORIG), get_mscale64(4.0))),
    "yarn-partial-untruncated": (
        lambda dt: YaRNScalingRotaryEmbedding(128, 96, ORIG, BASE, True, 2.5, dt, beta_fast=16, truncate=False),
        lambda: table64(torch.arange(640), yarn_inv_freq64(BASE, 96, 2.5, ORIG, beta_fast=16, truncate=False),
                        get_mscale64(2.5))),
    "llama3": (lambda dt: Llama3RotaryEmbedding(D, D, 1024, 500000.0, True, dt, 8.0, 1.0, 4.0, 512),
               lambda: rope_cache64(D, 1024, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 512,
                                              "rope_theta": 500000.0})),
    "deepseek_yarn": (
        lambda dt: DeepseekScalingRotaryEmbedding(D, D, ORIG, BASE, False, 4.0, dt, mscale=0.707, mscale_all_dim=1.0,
                                                  beta_slow=2),
        lambda: table64(torch.arange(4 * ORIG), yarn_inv_freq64(BASE, D, 4.0, ORIG, beta_slow=2),
                        get_mscale64(4.0, 0.707) / get_mscale64(4.0, 1.0))),
    "mrope": (lambda dt: MRotaryEmbedding(D, D, ORIG, BASE, True, dt, [8, 12, 12]),
              lambda: table64(torch.arange(4 * ORIG), inv_freq64(BASE, D))),
    "mrope-positions_factor-2": (
        lambda dt: MRotaryEmbedding(D, D, ORIG, BASE, True, dt, [8, 12, 12], positions_factor=2),
        lambda: table64(torch.arange(2 * ORIG), inv_freq64(BASE, D))),
    # YaRN's correction range and the rows come from the enlarged (positions_factor x) context
    "mrope-yarn": (
        lambda dt: MRotaryEmbedding(D, D, ORIG, BASE, True, dt, [8, 12, 12], scaling_factor=2.0),
        lambda: table64(torch.arange(8 * ORIG), yarn_inv_freq64(BASE, D, 2.0, 4 * ORIG), get_mscale64(2.0))),
    "mrope-yarn-attention_factor": (
        lambda dt: MRotaryEmbedding(D, D, ORIG, BASE, True, dt, [8, 12, 12], scaling_factor=3.0, attention_factor=0.8),
        lambda: table64(torch.arange(12 * ORIG), yarn_inv_freq64(BASE, D, 3.0, 4 * ORIG), 0.8)),
    "mrope-yarn-mscale-ratio": (
        lambda dt: MRotaryEmbedding(D, D, ORIG, BASE, True, dt, [8, 12, 12], scaling_factor=3.0, mscale=1.0,
                                    mscale_all_dim=0.5),
        lambda: table64(torch.arange(12 * ORIG), yarn_inv_freq64(BASE, D, 3.0, 4 * ORIG),
                        get_mscale64(3.0, 1.0) / get_mscale64(3.0, 0.5))),
    "bailing_mrope": (lambda dt: BailingMRotaryEmbedding(D, D, ORIG, BASE, False, dt, [8, 12, 12]),
                      lambda: table64(torch.arange(4 * ORIG), inv_freq64(BASE, D))),
    "openpangu": (lambda dt: MRotaryEmbeddingInterleaved(D, D, ORIG, BASE, True, dt, [8, 12, 12]),
                  lambda: table64(torch.arange(4 * ORIG), inv_freq64(BASE, D))),
    "proportional": (lambda dt: Gemma4RotaryEmbedding(D, 16, ORIG, BASE, True, dt),
                     lambda: rope_cache64(D, ORIG, {"rope_type": "proportional", "rope_dim": 16})),
    "longrope-long": (
        lambda dt: Phi3LongRoPEScaledRotaryEmbedding(D, D, 4 * ORIG, ORIG, BASE, True, dt, SHORT, LONG),
        lambda: rope_cache64(D, 4 * ORIG, {"rope_type": "longrope", "original_max_position_embeddings": ORIG,
                                           "short_factor": SHORT, "long_factor": LONG})),
    "longrope-given-mscales": (
        lambda dt: Phi3LongRoPEScaledRotaryEmbedding(D, D, 4 * ORIG, ORIG, BASE, True, dt, SHORT, LONG, 0.9, 1.3),
        lambda: rope_cache64(D, 4 * ORIG, {"rope_type": "longrope", "original_max_position_embeddings": ORIG,
                                           "short_factor": SHORT, "long_factor": LONG, "short_mscale": 0.9,
                                           "long_mscale": 1.3})),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("variant", list(CLASSES))
def test_class_cache(variant, dtype):
    make_op, formula = CLASSES[variant]
    op = make_op(dtype)
    want, angles = formula()
    assert op.name == "rotary_embedding" and isinstance(op, RotaryEmbedding)
    assert op.cos_sin_cache.dtype == dtype
    assert_cache_matches(op.cos_sin_cache, want, angles, variant)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", ROPE_TYPES, ids=lambda c: c.label)
def test_get_rope_cache(case, dtype):
    """get_rope's cache for each table row (rows, width, values) against the 0.33 formula."""
    op = case.build(dtype)
    want, angles = rope_cache64(case.head_size, case.max_position, case.rope_parameters)
    assert_cache_matches(op.cos_sin_cache, want, angles, case.label)


# ---- the defects of issue 15, stated on their own -----------------------------------------------------


def test_dynamic_ntk_keeps_max_position_rows_and_base():
    """vLLM 0.33: max_position rows, and the base only grows when max_position passes the trained
    context (pre-0.33: max_position * factor rows at base * (s^2 - s + 1)^(d/(d-2)))."""
    op = DynamicNTKScalingRotaryEmbedding(D, D, 1024, 1024, BASE, True, 4.0, torch.float32)
    assert op.cos_sin_cache.shape == (1024, D)
    assert torch.equal(op.cos_sin_cache, RotaryEmbedding(D, D, 1024, BASE, True, torch.float32).cos_sin_cache)
    grown = DynamicNTKScalingRotaryEmbedding(D, D, 2048, 1024, BASE, True, 4.0, torch.float32)
    assert grown.cos_sin_cache.shape == (2048, D)
    assert grown.scaled_base == pytest.approx(BASE * 5.0 ** (D / (D - 2)))  # 4 * 2048/1024 - 3
    with pytest.raises(ValueError, match="DynamicNTKScalingRotaryEmbedding: .*non-positive"):
        DynamicNTKScalingRotaryEmbedding(D, D, 100, 1024, BASE, True, 4.0, torch.float32)


@pytest.mark.parametrize("keys,magnitude", [
    ({}, get_mscale64(16.0)),
    ({"attention_factor": 1.0}, 1.0),
    ({"attention_factor": 0.5, "mscale": 1.0, "mscale_all_dim": 1.0}, 0.5),  # attention_factor first
    ({"mscale": 1.0, "mscale_all_dim": 0.5}, get_mscale64(16.0, 1.0) / get_mscale64(16.0, 0.5)),
    ({"mscale": 1.0, "mscale_all_dim": 0}, get_mscale64(16.0)),  # both must be non-zero
    ({"attn_factor": 0.5, "extrapolation_factor": 0.0}, get_mscale64(16.0)),  # pre-0.33 keys: ignored
], ids=["default", "attention_factor", "attention_factor-wins", "ratio", "ratio-needs-both", "old-keys-ignored"])
def test_yarn_magnitude_rule(keys, magnitude):
    from customop.ops.rotary_embedding import get_rope

    params = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64, **keys}
    op = get_rope(D, 1024, True, params, torch.float32)
    assert op.mscale == pytest.approx(magnitude, rel=1e-12)
    # the magnitude is in the cache: row 0 is (m, ..., m, 0, ..., 0)
    assert torch.allclose(op.cos_sin_cache[0, : D // 2].double(), torch.full((D // 2,), magnitude, dtype=torch.float64),
                          rtol=2e-7, atol=0)
    mrope = get_rope(D, 1024, True, {**params, "mrope_section": [8, 12, 12]}, torch.float32)
    assert type(mrope) is MRotaryEmbedding and mrope.mscale == pytest.approx(magnitude, rel=1e-12)


def test_linear_scaling_offsets():
    op = LinearScalingRotaryEmbedding(D, D, ORIG, BASE, True, [1.0, 2.5], torch.float32)
    assert op.scaling_factor_to_offset == {1.0: 0, 2.5: ORIG}


def test_llama4_vision_cache():
    """mllama4: [N + 1, 1, rotary_dim] complex64; patch p at (x, y) = (p mod n, p div n) turns by
    cat((x + 1) f, (y + 1) f); the CLS row (last) is 1."""
    patches, rd = 16, 16
    op = Llama4VisionRotaryEmbedding(2 * rd, rd, patches, BASE, False, torch.complex64)
    cache = op.cos_sin_cache
    assert cache.shape == (patches + 1, 1, rd) and cache.dtype == torch.complex64
    f = inv_freq64(BASE, rd)
    p = torch.arange(patches)
    angles = torch.cat(((p % 4 + 1).double()[:, None] * f, (p // 4 + 1).double()[:, None] * f), -1)
    want = torch.polar(torch.ones_like(angles), angles)
    assert torch.allclose(cache[:-1, 0].to(torch.complex128), want, atol=1e-6, rtol=0)
    assert torch.equal(cache[-1], torch.ones(1, rd, dtype=torch.complex64))


# ---- M-RoPE layouts ------------------------------------------------------------------------------


def _section_rows(kind, section, half):
    """Which position row (t=0, h=1, w=2) drives frequency lane j, for each layout."""
    if kind == "sections":
        return [0 if j < section[0] else 1 if j < section[0] + section[1] else 2 for j in range(half)]
    if kind == "interleaved":
        return [1 if j % 3 == 1 and j < 3 * section[1] else 2 if j % 3 == 2 and j < 3 * section[2] else 0
                for j in range(half)]
    if kind == "bailing":  # h/w alternate over the first h + w lanes, t after
        s = section[1] + section[2]
        return [(1 if j % 2 == 0 else 2) if j < s else 0 for j in range(half)]
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["sections", "interleaved", "bailing"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_mrope_layouts(dtype, kind):
    section, tokens = [8, 12, 12], 5
    if kind == "bailing":
        op = build(BailingMRotaryEmbedding, D, D, ORIG, BASE, False, dtype, section)
    else:
        op = build(MRotaryEmbedding, D, D, ORIG, BASE, True, dtype, section, kind == "interleaved")
    gen = torch.Generator().manual_seed(3)
    positions = torch.randint(0, 4 * ORIG, (3, tokens), generator=gen)
    q, k = randn(tokens, 4 * D, dtype=dtype, generator=gen), randn(tokens, 2 * D, dtype=dtype, generator=gen)
    rows = _section_rows(kind, section, D // 2)
    table = op.cos_sin_cache.to(dtype).double()
    cos = torch.stack([table[positions[rows, t], torch.arange(D // 2)] for t in range(tokens)])
    sin = torch.stack([table[positions[rows, t], D // 2 + torch.arange(D // 2)] for t in range(tokens)])
    out_q, out_k = op(positions, q, k)  # native on every platform
    for x, got in ((q, out_q), (k, out_k)):
        want, mag = rope_reference(x, cos, sin, D, op.is_neox_style)
        assert_rotated(got, want, mag, dtype)
    text_q, _ = op(positions[0], q, k)  # 1-D positions: plain RoPE
    assert torch.equal(text_q, build(RotaryEmbedding, D, D, 4 * ORIG, BASE, op.is_neox_style, dtype).forward_native(
        positions[0], q, k)[0])


@pytest.mark.parametrize("section,order", [([2, 3, 3], [0, 1, 2, 1, 2, 1, 2, 0]), ([4, 2, 2], [0, 1, 2, 0, 1, 2, 0, 0]),
                                           ([3, 2], [0, 1, 0, 1, 0])])
def test_openpangu_order_and_rotation(section, order):
    from customop.ops.rotary_embedding.openpangu import interleaved_modalities

    assert interleaved_modalities(section) == order
    rd = 2 * sum(section)
    op = build(MRotaryEmbeddingInterleaved, 32, rd, 64, BASE, True, torch.float32, section)
    gen = torch.Generator().manual_seed(4)
    positions = torch.randint(0, 256, (len(section), 6), generator=gen)
    q = randn(6, 2 * 32, generator=gen)
    table = op.cos_sin_cache.double()
    lanes = order * 2
    cos_sin = torch.stack([table[positions[lanes, t], torch.arange(rd)] for t in range(6)])
    cos, sin = cos_sin.chunk(2, -1)
    got_q, got_k = op(positions, q)
    assert got_k is None
    want, mag = rope_reference(q, cos, sin, 32, True)
    assert_rotated(got_q, want, mag, torch.float32)
    assert math.isclose(len(op.mrope_dim), rd)
