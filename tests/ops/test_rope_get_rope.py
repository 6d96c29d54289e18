"""get_rope with vLLM 0.33's signature: the call forms (positional and keyword), what each
rope_parameters dict builds (its table), the rotary-dim and base keys, sharing, the pre-0.33
keyword form (deprecated), and the errors."""

from __future__ import annotations

import warnings

import pytest
import torch

from customop.ops.rotary_embedding import (
    ROPE_TYPES, BailingMRotaryEmbedding, DeepseekScalingRotaryEmbedding, DeepseekV4ScalingRotaryEmbedding,
    DualChunkRotaryEmbedding, FourierRotaryEmbedding,
    DynamicNTKAlphaRotaryEmbedding, DynamicNTKScalingRotaryEmbedding, Gemma4RotaryEmbedding,
    LinearScalingRotaryEmbedding, Llama3RotaryEmbedding, Llama4VisionRotaryEmbedding, MRotaryEmbedding,
    MRotaryEmbeddingInterleaved, NTKScalingRotaryEmbedding, Phi3LongRoPEScaledRotaryEmbedding, RotaryEmbedding,
    YaRNScalingRotaryEmbedding, get_rope)
from tests.ops.rope_helpers import _compile_off_and_fresh_rope_cache  # noqa: F401  (autouse fixture)
from tests.ops.rope_helpers import D

YARN = {"factor": 4.0, "original_max_position_embeddings": 256}
TABLE = [
    (None, RotaryEmbedding),
    ({"rope_type": "default", "rope_theta": 1e6}, RotaryEmbedding),
    ({"rope_type": "linear", "factor": 2.0}, LinearScalingRotaryEmbedding),
    ({"rope_type": "dynamic", "factor": 2.0}, DynamicNTKScalingRotaryEmbedding),
    ({"rope_type": "dynamic", "alpha": 1000.0, "factor": 2.0}, DynamicNTKAlphaRotaryEmbedding),
    ({"rope_type": "ntk", "factor": 2.0, "mixed_b": 0.5}, NTKScalingRotaryEmbedding),
    ({"rope_type": "yarn", **YARN, "beta_fast": 16, "mscale": 1.0, "mscale_all_dim": 0.5}, YaRNScalingRotaryEmbedding),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 512}, Llama3RotaryEmbedding),
    ({"rope_type": "deepseek_yarn", **YARN, "mscale": 1.0, "mscale_all_dim": 1.0}, DeepseekScalingRotaryEmbedding),
    ({"rope_type": "deepseek_llama_scaling", **YARN}, DeepseekScalingRotaryEmbedding),
    ({"rope_type": "longrope", "original_max_position_embeddings": 256, "short_factor": [1.0] * 32,
      "long_factor": [2.0] * 32}, Phi3LongRoPEScaledRotaryEmbedding),
    ({"rope_type": "proportional", "partial_rotary_factor": 0.25}, Gemma4RotaryEmbedding),
    ({"rope_type": "mllama4", "partial_rotary_factor": 0.5}, Llama4VisionRotaryEmbedding),
    ({"rope_type": "default", "mrope_section": [8, 12, 12]}, MRotaryEmbedding),
    ({"rope_type": "yarn", **YARN, "mrope_section": [8, 12, 12], "mrope_interleaved": True}, MRotaryEmbedding),
    ({"rope_type": "bailing_mrope", "mrope_section": [8, 12, 12]}, BailingMRotaryEmbedding),
    ({"rope_type": "openpangu", "mrope_section": [8, 12, 12], "mrope_interleaved": True}, MRotaryEmbeddingInterleaved),
    ({"rope_type": "deepseek_yarn", **YARN, "is_deepseek_v4": True}, DeepseekV4ScalingRotaryEmbedding),
    ({"use_fope": True, "num_key_value_heads": 2, "num_inv_freq": 8, "fope_sep_head": True, "fope_init_factor": 0.1},
     FourierRotaryEmbedding),
]
IDS = ["none", "default", "linear", "dynamic", "dynamic-alpha", "ntk", "yarn", "llama3", "deepseek_yarn",
       "deepseek_llama_scaling", "longrope", "proportional", "mllama4", "mrope", "mrope-yarn", "bailing_mrope",
       "openpangu", "deepseek_v4", "fope"]


@pytest.mark.parametrize("params,cls", TABLE, ids=IDS)
def test_table_builds_and_shares(params, cls):
    rope = get_rope(D, 1024, True, params, torch.float32)  # 0.33's positional form
    assert type(rope) is cls and rope.cos_sin_cache.shape[0] > 0
    same = get_rope(head_size=D, max_position=1024, is_neox_style=True,  # ... and its keyword form
                    rope_parameters=None if params is None else dict(params), dtype=torch.float32)
    assert same is rope
    if cls is not Phi3LongRoPEScaledRotaryEmbedding:  # NeoX only
        assert get_rope(D, 1024, False, params, torch.float32) is not rope
    assert get_rope(D, 1024, True, params, torch.bfloat16) is not rope


def test_known_types_are_vllm_033s_table():
    assert set(ROPE_TYPES) == {"default", "bailing_mrope", "proportional", "llama3", "mllama4", "linear", "ntk",
                               "dynamic", "yarn", "deepseek_yarn", "deepseek_llama_scaling", "longrope", "openpangu"}


def test_rope_parameters_keys():
    rope = get_rope(128, 1024, rope_parameters={"rope_theta": 1e6, "partial_rotary_factor": 0.5})
    assert (rope.rotary_dim, rope.base, rope.dtype, rope.is_neox_style) == (64, 1e6, torch.get_default_dtype(), True)
    assert get_rope(128, 1024, True, {"partial_rotary_factor": 0.3}).rotary_dim == 38  # int(), truncated
    # rope_dim wins over partial_rotary_factor, which is then not even checked (as in vLLM)
    assert get_rope(128, 1024, True, {"rope_dim": 96, "partial_rotary_factor": 7.0}).rotary_dim == 96
    assert get_rope(D, 1024, True, {"rope_type": "default"}).base == 10000
    yarn = get_rope(D, 99999, True, {"rope_type": "yarn", **YARN})  # max_position unused: the original context
    assert yarn.max_position_embeddings == 256 and yarn.cos_sin_cache.shape[0] == 1024
    # HF's legacy "type" (renamed as vLLM's config loader does): su -> longrope, mrope -> default
    assert type(get_rope(D, 1024, True, {"type": "linear", "factor": 2.0})) is LinearScalingRotaryEmbedding
    assert type(get_rope(D, 1024, True, {"type": "mrope", "mrope_section": [8, 12, 12]})) is MRotaryEmbedding


def test_dynamic_reads_max_trained_positions():
    rope = get_rope(D, 2048, True, {"rope_type": "dynamic", "factor": 2.0, "max_trained_positions": 1024})
    assert rope.cos_sin_cache.shape[0] == 2048 and rope.max_trained_positions == 1024
    assert rope.scaled_base == pytest.approx(10000 * 3.0 ** (D / (D - 2)))
    plain = get_rope(D, 2048, True, {"rope_type": "dynamic", "factor": 2.0})
    assert plain.scaled_base == 10000 and plain.cos_sin_cache.shape[0] == 2048


def test_mrope_positions_factor_and_dual_chunk():
    assert get_rope(D, 100, True, {"mrope_section": [8, 12, 12]}).cos_sin_cache.shape[0] == 400
    mrope = get_rope(D, 100, True, {"mrope_section": [8, 12, 12]}, mrope_positions_factor=2)
    assert mrope.cos_sin_cache.shape[0] == 200 and mrope.positions_factor == 2
    dca = {"chunk_size": 64, "local_size": 8, "original_max_position_embeddings": 512,
           "sparse_attention_config": {"a": [1]}}  # left out of the key, as in vLLM (and unhashable)
    dual = get_rope(D, 1024, True, {"rope_type": "yarn"}, None, dca)
    assert type(dual) is DualChunkRotaryEmbedding and (dual.chunk_size, dual.local_size) == (64, 8)


def test_longrope_switch():
    params = {"rope_type": "longrope", "original_max_position_embeddings": 256, "short_factor": [1.0] * 32,
              "long_factor": [2.0] * 32}
    assert get_rope(D, 1024, True, params).use_long_rope
    assert not get_rope(D, 1024, True, {**params, "max_model_len": 256}).use_long_rope
    assert get_rope(D, 1024, True, params).long_short_cos_sin_cache.shape == (256 + 1024, D)


def test_pre_033_keyword_form_warns_and_still_works():
    with pytest.warns(DeprecationWarning, match="get_rope: the keywords rotary_dim, base, rope_scaling"):
        old = get_rope(128, rotary_dim=128, max_position=1024, base=1e6, is_neox_style=True,
                       rope_scaling={"rope_type": "yarn", **YARN}, dtype=torch.float32, partial_rotary_factor=0.5)
    new = get_rope(128, 1024, True, {"rope_type": "yarn", **YARN, "rope_theta": 1e6, "rope_dim": 64}, torch.float32)
    assert type(old) is YaRNScalingRotaryEmbedding and (old.rotary_dim, old.base) == (64, 1e6)
    assert torch.equal(old.cos_sin_cache, new.cos_sin_cache)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the 0.33 forms do not warn
        get_rope(128, 1024, True, {"rope_theta": 1e6})


def test_errors():
    with pytest.raises(ValueError, match=r"get_rope: unknown rope type 'su'; known: default, bailing_mrope, "
                                         r"proportional, .*, longrope, openpangu"):
        get_rope(D, 1024, True, {"rope_type": "su"})
    with pytest.raises(ValueError, match="get_rope: rope type 'linear' needs 'factor'"):
        get_rope(D, 1024, True, {"rope_type": "linear"})
    with pytest.raises(ValueError, match="get_rope: rope type 'dynamic' needs 'alpha' or 'factor'"):
        get_rope(D, 1024, True, {"rope_type": "dynamic"})
    with pytest.raises(ValueError, match="get_rope: partial_rotary_factor must be in"):
        get_rope(D, 1024, True, {"partial_rotary_factor": 1.5})
    with pytest.raises(ValueError, match="openpangu"):
        get_rope(D, 1024, True, {"rope_type": "openpangu", "mrope_section": [8, 12, 12]})
    with pytest.raises(ValueError, match="get_rope: rope type 'default with use_fope' needs 'num_key_value_heads'"):
        get_rope(D, 1024, True, {"use_fope": True})
    # the pre-0.33 positional order gets a clear error, not "unhashable type"
    with pytest.raises(TypeError, match="get_rope: rope_parameters must be a dict"):
        get_rope(D, D, True, 10000.0, True, None, torch.float32)
    with pytest.raises(TypeError, match="get_rope: is_neox_style must be a bool, got 1024"):
        get_rope(D, D, 1024)  # old: rotary_dim, max_position; new: max_position, is_neox_style
    with pytest.raises(TypeError, match="unexpected keyword"):
        get_rope(D, 1024, rope_paramters={})
