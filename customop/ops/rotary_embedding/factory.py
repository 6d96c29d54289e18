"""``get_rope``: the RoPE module a model config asks for, one shared instance per argument set."""

from __future__ import annotations

from typing import Any

import torch

from customop.ops.rotary_embedding.base import RotaryEmbedding
from customop.ops.rotary_embedding.deepseek_yarn import DeepseekScalingRotaryEmbedding
from customop.ops.rotary_embedding.dual_chunk import DualChunkRotaryEmbedding
from customop.ops.rotary_embedding.dynamic_ntk import DynamicNTKScalingRotaryEmbedding
from customop.ops.rotary_embedding.linear_scaling import LinearScalingRotaryEmbedding
from customop.ops.rotary_embedding.llama3 import Llama3RotaryEmbedding
from customop.ops.rotary_embedding.mrope import MRotaryEmbedding
from customop.ops.rotary_embedding.yarn import YaRNScalingRotaryEmbedding

#: ``rope_type`` values get_rope builds. HF's legacy ``"mrope"`` means default with sections;
#: ``deepseek_llama_scaling`` is vLLM's alias of ``deepseek_yarn``.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "deepseek_yarn")
_ALIASES = {"mrope": "default", "deepseek_llama_scaling": "deepseek_yarn"}

_YARN_KEYS = ("extrapolation_factor", "attn_factor", "beta_fast", "beta_slow", "apply_yarn_scaling", "truncate")
_DEEPSEEK_KEYS = ("extrapolation_factor", "attn_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")

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
        raise ValueError(f"get_rope: rope type {rope_type!r} needs {key!r} in its parameters, got {sorted(params)}")
    return params[key]


def get_rope(head_size: int, rotary_dim: int | None = None, max_position: int | None = None,
             base: float | None = None, is_neox_style: bool = True,
             rope_scaling: dict[str, Any] | None = None, dtype: torch.dtype | None = None,
             partial_rotary_factor: float = 1.0, dual_chunk_attention_config: dict[str, Any] | None = None,
             *, rope_parameters: dict[str, Any] | None = None) -> torch.nn.Module:
    """The RoPE module for a model config (vLLM's signature; ``rope_parameters``, the
    transformers-v5 dict that also carries ``rope_theta`` and ``partial_rotary_factor``, is
    accepted in place of ``rope_scaling``).

    ``rotary_dim`` defaults to ``head_size`` and is multiplied by ``partial_rotary_factor``;
    ``base`` defaults to ``rope_theta`` or 10000; ``dtype`` to torch's default. The rope type is
    ``rope_type`` (or HF's legacy ``type``); unknown types raise ``ValueError`` listing the known
    ones. Instances are shared: equal arguments (and the same enable state and platform, which
    fix the forward path at construction) return the same module.
    """
    if rope_scaling is not None and rope_parameters is not None:
        raise ValueError("get_rope: pass rope_scaling or rope_parameters, not both")
    if max_position is None:
        raise ValueError("get_rope: max_position is required")
    params = dict(rope_parameters if rope_parameters is not None else rope_scaling or {})
    if base is None:
        base = params.get("rope_theta", 10000)
    if partial_rotary_factor == 1.0:
        partial_rotary_factor = params.get("partial_rotary_factor", 1.0)
    if not 0.0 < partial_rotary_factor <= 1.0:
        raise ValueError(f"get_rope: partial_rotary_factor must be in (0, 1], got {partial_rotary_factor}")
    rotary_dim = head_size if rotary_dim is None else rotary_dim
    if partial_rotary_factor < 1.0:
        rotary_dim = int(rotary_dim * partial_rotary_factor)
    dtype = torch.get_default_dtype() if dtype is None else dtype
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = _ALIASES.get(rope_type, rope_type)
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"get_rope: unknown rope type {rope_type!r}; known: {', '.join(ROPE_TYPES)}")

    from customop.platforms import current_platform

    key = (head_size, rotary_dim, max_position, base, is_neox_style, _frozen(params), dtype,
           _frozen(dual_chunk_attention_config), RotaryEmbedding.enabled(), current_platform().name)
    if key not in _ROPE_CACHE:
        _ROPE_CACHE[key] = _build(rope_type, params, head_size, rotary_dim, max_position, base, is_neox_style,
                                  dtype, dual_chunk_attention_config)
    return _ROPE_CACHE[key]


def _build(rope_type: str, params: dict[str, Any], head_size: int, rotary_dim: int, max_position: int,
           base: float, is_neox_style: bool, dtype: torch.dtype,
           dual_chunk: dict[str, Any] | None) -> torch.nn.Module:
    dims = (head_size, rotary_dim)
    if dual_chunk is not None:
        chunk = {k: v for k, v in dual_chunk.items() if k in ("chunk_size", "local_size")}
        return DualChunkRotaryEmbedding(*dims, max_position, base, is_neox_style, dtype, **chunk)
    if rope_type == "default":
        if "mrope_section" in params:
            return MRotaryEmbedding(*dims, max_position, base, is_neox_style, dtype,
                                    mrope_section=params["mrope_section"],
                                    mrope_interleaved=params.get("mrope_interleaved", False))
        return RotaryEmbedding(*dims, max_position, base, is_neox_style, dtype)
    factor = _required(params, "factor", rope_type)
    if rope_type == "linear":
        return LinearScalingRotaryEmbedding(*dims, max_position, base, is_neox_style, factor, dtype)
    if rope_type == "dynamic":
        return DynamicNTKScalingRotaryEmbedding(*dims, max_position, base, is_neox_style, factor, dtype)
    if rope_type == "llama3":
        return Llama3RotaryEmbedding(*dims, max_position, base, is_neox_style, dtype, factor,
                                     _required(params, "low_freq_factor", rope_type),
                                     _required(params, "high_freq_factor", rope_type),
                                     _required(params, "original_max_position_embeddings", rope_type))
    original = _required(params, "original_max_position_embeddings", rope_type)
    if rope_type == "yarn":
        extra = {k: v for k, v in params.items() if k in _YARN_KEYS}
        if "mrope_section" in params:
            extra.pop("apply_yarn_scaling", None)
            return MRotaryEmbedding(*dims, original, base, is_neox_style, dtype,
                                    mrope_section=params["mrope_section"],
                                    mrope_interleaved=params.get("mrope_interleaved", False),
                                    scaling_factor=factor, **extra)
        return YaRNScalingRotaryEmbedding(*dims, original, base, is_neox_style, factor, dtype, **extra)
    extra = {k: v for k, v in params.items() if k in _DEEPSEEK_KEYS}
    return DeepseekScalingRotaryEmbedding(*dims, original, base, is_neox_style, factor, dtype, **extra)
