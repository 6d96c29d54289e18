"""Rotary position embeddings: ``RotaryEmbedding`` and its scaling variants, ``get_rope``,
``ApplyRotaryEmb`` and ``DualChunkRotaryEmbedding`` (vLLM 0.33's class and registered names).

One module per role: ``customop.math.rotary`` (the pure math and input checks), ``base`` (the op),
one module per rope type, ``apply_rotary``, ``dual_chunk``, ``factory`` (``get_rope`` and its table).
"""

from customop.math.rotary import apply_rotary_emb, rotary_embedding, rotate
from customop.ops.rotary_embedding.base import RotaryEmbedding
from customop.ops.rotary_embedding.apply_rotary import ApplyRotaryEmb
from customop.ops.rotary_embedding.linear_scaling import LinearScalingRotaryEmbedding
from customop.ops.rotary_embedding.dynamic_ntk import DynamicNTKAlphaRotaryEmbedding, DynamicNTKScalingRotaryEmbedding
from customop.ops.rotary_embedding.ntk import NTKScalingRotaryEmbedding
from customop.ops.rotary_embedding.yarn import YaRNScalingRotaryEmbedding, yarn_get_mscale
from customop.ops.rotary_embedding.llama3 import Llama3RotaryEmbedding
from customop.ops.rotary_embedding.llama4_vision import Llama4VisionRotaryEmbedding
from customop.ops.rotary_embedding.deepseek_yarn import DeepseekScalingRotaryEmbedding, DeepseekV4ScalingRotaryEmbedding
from customop.ops.rotary_embedding.fope import FourierRotaryEmbedding
from customop.ops.rotary_embedding.longrope import Phi3LongRoPEScaledRotaryEmbedding
from customop.ops.rotary_embedding.proportional import Gemma4RotaryEmbedding
from customop.ops.rotary_embedding.mrope import MRotaryEmbedding
from customop.ops.rotary_embedding.bailing_mrope import BailingMRotaryEmbedding
from customop.ops.rotary_embedding.openpangu import MRotaryEmbeddingInterleaved
from customop.ops.rotary_embedding.dual_chunk import DualChunkRotaryEmbedding
from customop.ops.rotary_embedding.factory import ROPE_TYPES, clear_rope_cache, get_rope

__all__ = [
    "ApplyRotaryEmb",
    "BailingMRotaryEmbedding",
    "DeepseekScalingRotaryEmbedding",
    "DeepseekV4ScalingRotaryEmbedding",
    "DualChunkRotaryEmbedding",
    "DynamicNTKAlphaRotaryEmbedding",
    "DynamicNTKScalingRotaryEmbedding",
    "FourierRotaryEmbedding",
    "Gemma4RotaryEmbedding",
    "Llama3RotaryEmbedding",
    "Llama4VisionRotaryEmbedding",
    "LinearScalingRotaryEmbedding",
    "MRotaryEmbedding",
    "MRotaryEmbeddingInterleaved",
    "NTKScalingRotaryEmbedding",
    "Phi3LongRoPEScaledRotaryEmbedding",
    "ROPE_TYPES",
    "RotaryEmbedding",
    "YaRNScalingRotaryEmbedding",
    "apply_rotary_emb",
    "clear_rope_cache",
    "get_rope",
    "rotary_embedding",
    "rotate",
    "yarn_get_mscale",
]
