"""``get_rope``: the RoPE module a model config asks for, one shared instance per argument set.

vLLM 0.33's signature and table: everything about the rope (``rope_theta``, ``rope_type``,
``partial_rotary_factor``, ``rope_dim`` and the type's own keys) travels in ``rope_parameters``,
Hugging Face's v5 config field. Which class each type builds and which keys it reads:

=============================================  ==================================  ==================================
``rope_type`` (and condition)                  class                               keys read
=============================================  ==================================  ==================================
any, ``dual_chunk_attention_config`` given     DualChunkRotaryEmbedding            ``chunk_size``, ``local_size`` (DCA)
``bailing_mrope``                              BailingMRotaryEmbedding             ``mrope_section``
``default`` + ``mrope_section``                MRotaryEmbedding                    ``mrope_interleaved``
``default`` + ``use_fope``                     FourierRotaryEmbedding              ``num_key_value_heads``,
                                                                                   ``num_inv_freq``, ``fope_sep_head``,
                                                                                   ``fope_init_factor``
``default``                                    RotaryEmbedding
``proportional``                               Gemma4RotaryEmbedding
``llama3``                                     Llama3RotaryEmbedding               ``factor``, ``low_freq_factor``,
                                                                                   ``high_freq_factor``,
                                                                                   ``original_max_position_embeddings``
``mllama4``                                    Llama4VisionRotaryEmbedding
``linear``                                     LinearScalingRotaryEmbedding        ``factor`` (a number or a list)
``ntk``                                        NTKScalingRotaryEmbedding           ``factor``, ``mixed_b``
``dynamic`` + ``alpha`` (checked first)        DynamicNTKAlphaRotaryEmbedding      ``alpha``
``dynamic`` + ``factor``                       DynamicNTKScalingRotaryEmbedding    ``factor``, ``max_trained_positions``
``yarn`` (+ ``mrope_section``: M-RoPE)         YaRNScalingRotaryEmbedding          ``factor``,
                                                                                   ``original_max_position_embeddings``,
                                                                                   ``beta_fast``, ``beta_slow``,
                                                                                   ``mscale``, ``mscale_all_dim``,
                                                                                   ``attention_factor``, ``truncate``
``deepseek_yarn``, ``deepseek_llama_scaling``  DeepseekScalingRotaryEmbedding      ``factor``,
                                                                                   ``original_max_position_embeddings``,
                                                                                   ``beta_fast``, ``beta_slow``,
                                                                                   ``mscale``, ``mscale_all_dim``
``longrope``                                   Phi3LongRoPEScaledRotaryEmbedding   ``short_factor``, ``long_factor``,
                                                                                   ``original_max_position_embeddings``,
                                                                                   ``short_mscale``, ``long_mscale``,
                                                                                   ``max_model_len`` (customop's)
``openpangu`` (+ ``mrope_section``)            MRotaryEmbeddingInterleaved         ``mrope_interleaved`` (must be true)
=============================================  ==================================  ==================================

DeepSeek-YaRN with a true ``is_deepseek_v4`` builds DeepseekV4ScalingRotaryEmbedding instead.
YaRN, M-RoPE + YaRN and DeepSeek-YaRN are built with ``original_max_position_embeddings`` as their
context; ``max_position`` is then unused. Keys a type does not read are ignored (as in vLLM:
YaRN's older ``extrapolation_factor``/``attn_factor`` do nothing). A missing key raises
``ValueError`` naming it (vLLM: ``KeyError``).
"""

from __future__ import annotations

import numbers
import warnings
from typing import Any

import torch

from customop.ops.rotary_embedding.bailing_mrope import BailingMRotaryEmbedding
from customop.ops.rotary_embedding.base import RotaryEmbedding
from customop.ops.rotary_embedding.deepseek_yarn import DeepseekScalingRotaryEmbedding, DeepseekV4ScalingRotaryEmbedding
from customop.ops.rotary_embedding.dual_chunk import DualChunkRotaryEmbedding
from customop.ops.rotary_embedding.fope import FourierRotaryEmbedding
from customop.ops.rotary_embedding.dynamic_ntk import DynamicNTKAlphaRotaryEmbedding, DynamicNTKScalingRotaryEmbedding
from customop.ops.rotary_embedding.linear_scaling import LinearScalingRotaryEmbedding
from customop.ops.rotary_embedding.llama3 import Llama3RotaryEmbedding
from customop.ops.rotary_embedding.llama4_vision import Llama4VisionRotaryEmbedding
from customop.ops.rotary_embedding.longrope import Phi3LongRoPEScaledRotaryEmbedding
from customop.ops.rotary_embedding.mrope import MRotaryEmbedding
from customop.ops.rotary_embedding.ntk import NTKScalingRotaryEmbedding
from customop.ops.rotary_embedding.openpangu import MRotaryEmbeddingInterleaved
from customop.ops.rotary_embedding.proportional import Gemma4RotaryEmbedding
from customop.ops.rotary_embedding.yarn import YaRNScalingRotaryEmbedding

#: ``rope_type`` values get_rope builds (vLLM 0.33's table, in its order).
ROPE_TYPES = ("default", "bailing_mrope", "proportional", "llama3", "mllama4", "linear", "ntk", "dynamic", "yarn",
              "deepseek_yarn", "deepseek_llama_scaling", "longrope", "openpangu")
#: Hugging Face's legacy ``type`` values, renamed as vLLM's config loader renames them.
_LEGACY_TYPES = {"su": "longrope", "mrope": "default"}

_YARN_KEYS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")
_DEEPSEEK_KEYS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")

_ROPE_CACHE: dict[tuple, torch.nn.Module] = {}


def clear_rope_cache() -> None:
    """Forgets the shared instances (tests, or after changing the config or platform)."""
    _ROPE_CACHE.clear()


def _frozen(value: Any) -> Any:
    """A hashable copy of a config value (lists become tuples, dicts sorted item tuples)."""
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


def _required(params: dict[str, Any], key: str, rope_type: str) -> Any:
    if key not in params:
        raise ValueError(f"get_rope: rope type {rope_type!r} needs {key!r} in rope_parameters, got {sorted(params)}")
    return params[key]


def _normalise_legacy_type(params: dict[str, Any]) -> dict[str, Any]:
    """HF's older ``type`` key as vLLM's config loader rewrites it before get_rope sees it (customop
    has no config loader, so get_rope does it): copied to ``rope_type`` when that is absent,
    ``su`` -> ``longrope``, ``mrope`` -> ``default``."""
    if "type" not in params or "rope_type" in params:
        return params
    params = dict(params)
    legacy = params.pop("type")
    params["rope_type"] = _LEGACY_TYPES.get(legacy, legacy)
    return params


def _legacy_arguments(params: dict[str, Any] | None, legacy: dict[str, Any]) -> dict[str, Any] | None:
    """The pre-0.33 keywords (``rotary_dim``, ``base``, ``rope_scaling``, ``partial_rotary_factor``)
    folded into ``rope_parameters``, with a DeprecationWarning."""
    unknown = set(legacy) - {"rotary_dim", "base", "rope_scaling", "partial_rotary_factor"}
    if unknown:
        raise TypeError(f"get_rope() got unexpected keyword argument(s) {sorted(unknown)}")
    warnings.warn("get_rope: the keywords rotary_dim, base, rope_scaling and partial_rotary_factor are "
                  "deprecated; pass rope_parameters={'rope_theta': ..., 'rope_type': ..., "
                  "'partial_rotary_factor' or 'rope_dim': ..., <the type's keys>} (vLLM 0.33's form)",
                  DeprecationWarning, stacklevel=3)
    scaling = legacy.get("rope_scaling")
    if scaling is not None and params is not None:
        raise ValueError("get_rope: pass rope_scaling or rope_parameters, not both")
    merged = dict(params if params is not None else scaling or {})
    if legacy.get("base") is not None:
        merged["rope_theta"] = legacy["base"]
    factor = legacy.get("partial_rotary_factor", merged.get("partial_rotary_factor", 1.0))
    if not 0.0 < factor <= 1.0:
        raise ValueError(f"get_rope: partial_rotary_factor must be in (0, 1], got {factor}")
    merged["partial_rotary_factor"] = factor
    if legacy.get("rotary_dim") is not None:  # the old meaning: rotary_dim scaled by the factor
        merged["rope_dim"] = int(legacy["rotary_dim"] * factor)
    return merged


def get_rope(head_size: int, max_position: int, is_neox_style: bool = True,
             rope_parameters: dict[str, Any] | None = None, dtype: torch.dtype | None = None,
             dual_chunk_attention_config: dict[str, Any] | None = None, mrope_positions_factor: int = 4,
             **legacy: Any) -> torch.nn.Module:
    """The RoPE module for a model config, with vLLM 0.33's signature and table (module docstring).

    From ``rope_parameters`` (None is ``{}``): ``rope_theta`` (10000), ``rope_type`` ("default";
    HF's legacy ``type`` is honoured when ``rope_type`` is absent), the rotary dim: ``rope_dim`` if
    set, else ``int(head_size * partial_rotary_factor)`` with the factor in ``(0, 1]``. ``dtype``
    defaults to torch's default dtype at the call. An unknown type raises ``ValueError`` listing the
    known ones. Instances are shared: equal arguments (and the same enable state and platform,
    which fix the forward path at construction) return the same module.

    The pre-0.33 keywords ``rotary_dim``, ``base``, ``rope_scaling`` and ``partial_rotary_factor``
    still work, with a ``DeprecationWarning``.
    """
    if legacy:
        rope_parameters = _legacy_arguments(rope_parameters, legacy)
    if rope_parameters is not None and not isinstance(rope_parameters, dict):
        raise TypeError(f"get_rope: rope_parameters must be a dict or None, got {type(rope_parameters).__name__} "
                        "(vLLM 0.33's order: head_size, max_position, is_neox_style, rope_parameters, dtype, ...)")
    if isinstance(max_position, bool) or not isinstance(max_position, numbers.Integral):
        raise TypeError(f"get_rope: max_position must be an int, got {max_position!r}")
    if not isinstance(is_neox_style, bool):  # catches a pre-0.33 positional call (rotary_dim, max_position, ...)
        raise TypeError(f"get_rope: is_neox_style must be a bool, got {is_neox_style!r} (vLLM 0.33's order: "
                        "head_size, max_position, is_neox_style, rope_parameters, dtype, ...)")
    params = _normalise_legacy_type(dict(rope_parameters or {}))
    base = params.get("rope_theta", 10000)
    rope_type = params.get("rope_type", "default")
    if params.get("rope_dim"):
        rotary_dim = params["rope_dim"]
    else:
        factor = params.get("partial_rotary_factor", 1.0)
        if not 0.0 < factor <= 1.0:
            raise ValueError(f"get_rope: partial_rotary_factor must be in (0, 1], got {factor}")
        rotary_dim = int(head_size * factor)
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if dual_chunk_attention_config is None and rope_type not in ROPE_TYPES:
        raise ValueError(f"get_rope: unknown rope type {rope_type!r}; known: {', '.join(ROPE_TYPES)}")

    from customop.platforms import current_platform

    dca = None if dual_chunk_attention_config is None else {
        k: v for k, v in dual_chunk_attention_config.items() if k != "sparse_attention_config"}
    key = (head_size, rotary_dim, max_position, is_neox_style, _frozen(params), _frozen(dca), dtype,
           mrope_positions_factor, RotaryEmbedding.enabled(), current_platform().name)
    if key not in _ROPE_CACHE:
        _ROPE_CACHE[key] = _build(rope_type, params, head_size, rotary_dim, max_position, base, is_neox_style,
                                  dtype, dca, mrope_positions_factor)
    return _ROPE_CACHE[key]


def _build(rope_type: str, params: dict[str, Any], head_size: int, rotary_dim: int, max_position: int,
           base: float, is_neox_style: bool, dtype: torch.dtype, dual_chunk: dict[str, Any] | None,
           positions_factor: int) -> torch.nn.Module:
    dims = (head_size, rotary_dim)
    if dual_chunk is not None:
        chunk = {k: v for k, v in dual_chunk.items() if k in ("chunk_size", "local_size")}
        return DualChunkRotaryEmbedding(*dims, max_position, base, is_neox_style, dtype, **chunk)
    mrope = {"mrope_section": params.get("mrope_section"), "mrope_interleaved": params.get("mrope_interleaved", False)}
    if rope_type == "bailing_mrope":
        return BailingMRotaryEmbedding(*dims, max_position, base, is_neox_style, dtype,
                                       _required(params, "mrope_section", rope_type))
    if rope_type == "default":
        if "mrope_section" in params:
            return MRotaryEmbedding(*dims, max_position, base, is_neox_style, dtype, **mrope,
                                    positions_factor=positions_factor)
        if params.get("use_fope"):
            fope = {k: _required(params, k, "default with use_fope")
                    for k in ("num_key_value_heads", "num_inv_freq", "fope_sep_head", "fope_init_factor")}
            return FourierRotaryEmbedding(*dims, max_position, base, is_neox_style, dtype, False, **fope)
        return RotaryEmbedding(*dims, max_position, base, is_neox_style, dtype)
    if rope_type == "proportional":
        return Gemma4RotaryEmbedding(*dims, max_position, base, is_neox_style, dtype)
    if rope_type == "mllama4":
        return Llama4VisionRotaryEmbedding(*dims, max_position, base, is_neox_style, dtype)
    if rope_type == "openpangu":
        if "mrope_section" not in params or not mrope["mrope_interleaved"]:
            raise ValueError("get_rope: rope type 'openpangu' needs mrope_section and mrope_interleaved=True")
        return MRotaryEmbeddingInterleaved(*dims, max_position, base, is_neox_style, dtype, **mrope)
    if rope_type == "longrope":
        extra = {k: params[k] for k in ("short_mscale", "long_mscale") if k in params}
        return Phi3LongRoPEScaledRotaryEmbedding(
            *dims, max_position, _required(params, "original_max_position_embeddings", rope_type), base,
            is_neox_style, dtype, _required(params, "short_factor", rope_type),
            _required(params, "long_factor", rope_type), **extra, max_model_len=params.get("max_model_len"))
    if rope_type == "dynamic":
        if "alpha" in params:
            return DynamicNTKAlphaRotaryEmbedding(*dims, max_position, base, is_neox_style, params["alpha"], dtype)
        if "factor" not in params:
            raise ValueError("get_rope: rope type 'dynamic' needs 'alpha' or 'factor' in rope_parameters, "
                             f"got {sorted(params)}")
        return DynamicNTKScalingRotaryEmbedding(*dims, max_position, params.get("max_trained_positions", max_position),
                                                base, is_neox_style, params["factor"], dtype)
    factor = _required(params, "factor", rope_type)
    if rope_type == "linear":
        return LinearScalingRotaryEmbedding(*dims, max_position, base, is_neox_style, factor, dtype)
    if rope_type == "ntk":
        return NTKScalingRotaryEmbedding(*dims, max_position, base, is_neox_style, factor, dtype, params.get("mixed_b"))
    if rope_type == "llama3":
        return Llama3RotaryEmbedding(*dims, max_position, base, is_neox_style, dtype, factor,
                                     _required(params, "low_freq_factor", rope_type),
                                     _required(params, "high_freq_factor", rope_type),
                                     _required(params, "original_max_position_embeddings", rope_type))
    original = _required(params, "original_max_position_embeddings", rope_type)
    if rope_type == "yarn":
        extra = {k: v for k, v in params.items() if k in _YARN_KEYS}
        if "mrope_section" in params:
            return MRotaryEmbedding(*dims, original, base, is_neox_style, dtype, **mrope,
                                    positions_factor=positions_factor, scaling_factor=factor, **extra)
        return YaRNScalingRotaryEmbedding(*dims, original, base, is_neox_style, factor, dtype, **extra)
    extra = {k: v for k, v in params.items() if k in _DEEPSEEK_KEYS}  # deepseek_yarn, deepseek_llama_scaling
    cls = DeepseekV4ScalingRotaryEmbedding if params.get("is_deepseek_v4") else DeepseekScalingRotaryEmbedding
    return cls(*dims, original, base, is_neox_style, factor, dtype, **extra)
