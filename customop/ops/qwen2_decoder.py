"""``CustomQwen2Decoder`` (``qwen2_decoder``): the Qwen2 decoder stack DeepSeek-OCR-2 uses as a vision
encoder, with vLLM 0.33's constructor, built from customop's own ops.

vLLM builds a Hugging Face ``Qwen2Model`` (no vLLM kernels) and deletes its token embedding; here
every layer is customop's ``RMSNorm``, ``ReplicatedLinear`` (q/k/v with bias, o without; SwiGLU's
gate/up/down), a ``RotaryEmbedding`` (neox style, ``rope_theta``) and ``SiluAndMul``, so
each of them runs its own platform path. Parameter names follow HF's ``Qwen2Model`` under
``model.`` (``model.layers.0.self_attn.q_proj.weight``, ..., ``model.norm.weight``), as vLLM's
module has them, so its checkpoints load as is.

``forward(inputs_embeds [B, S, hidden], token_type_ids=None, attention_mask=None)`` returns a
one-element tuple ``(last_hidden_state [B, S, hidden],)`` (vLLM returns HF's output object, whose
``[0]`` is that tensor). Positions are ``0..S-1``; the mask is ``customop/math/qwen2_decoder.py``'s,
built from ``token_type_ids`` (``[B, S]``: 0 = image, bidirectional; 1 = query, causal on the
queries; as vLLM builds it), or, when they are None, from vLLM's own layout (the first ``S // 2``
tokens images); ``attention_mask`` (``[B, S]``, 1 = keep) additionally hides padded keys. The layer
has no platform code of its own: its sub-ops have theirs, so every ``forward_*`` is the same
composition.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from customop.custom_op import CustomOp
from customop.math.qwen2_decoder import additive_mask
from customop.ops.activation import SiluAndMul
from customop.ops.layernorm import RMSNorm
from customop.ops.linear import ReplicatedLinear
from customop.ops.rotary_embedding import RotaryEmbedding

_OP = "customop.qwen2_decoder"


def _linear(n_in: int, n_out: int, bias: bool, dtype: torch.dtype) -> ReplicatedLinear:
    return ReplicatedLinear(n_in, n_out, bias=bias, params_dtype=dtype, return_bias=False, disable_tp=True)


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q_proj = _linear(hidden, heads * self.head_dim, True, dtype)
        self.k_proj = _linear(hidden, kv_heads * self.head_dim, True, dtype)
        self.v_proj = _linear(hidden, kv_heads * self.head_dim, True, dtype)
        self.o_proj = _linear(heads * self.head_dim, hidden, False, dtype)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, rope: nn.Module, mask: torch.Tensor) -> torch.Tensor:
        b, s, _ = h.shape
        q, k = rope(positions, self.q_proj(h).reshape(b * s, -1), self.k_proj(h).reshape(b * s, -1))
        q, k, v = (t.reshape(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, self.v_proj(h)))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class _Mlp(nn.Module):
    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = _linear(hidden, intermediate, False, dtype)
        self.up_proj = _linear(hidden, intermediate, False, dtype)
        self.down_proj = _linear(intermediate, hidden, False, dtype)
        self.act_fn = SiluAndMul()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(torch.cat((self.gate_proj(h), self.up_proj(h)), dim=-1)))


class _Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, intermediate: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = _Attention(hidden, heads, kv_heads, dtype)
        self.mlp = _Mlp(hidden, intermediate, dtype)
        self.input_layernorm = RMSNorm(hidden, eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype=dtype)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, rope: nn.Module, mask: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), positions, rope, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class _Model(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, eps: float,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(hidden, heads, kv_heads, intermediate, eps, dtype) for _ in range(layers))
        self.norm = RMSNorm(hidden, eps, dtype=dtype)


@CustomOp.register("qwen2_decoder")
class CustomQwen2Decoder(CustomOp):
    """The Qwen2 stack of DeepSeek-OCR-2's vision encoder (vLLM's constructor; ``vocab_size``,
    ``attn_implementation``, ``attention_dropout``, ``initializer_range`` are accepted and unused:
    there is no embedding, attention is SDPA, inference has no dropout, weights come from the
    checkpoint). ``params_dtype`` (customop's) sets the parameters' dtype."""

    def __init__(self, decoder_layer: int = 24, max_position_embeddings: int = 131072, hidden_dimension: int = 896,
                 num_attention_heads: int = 14, num_key_value_heads: int = 2, intermediate_size: int = 4864,
                 vocab_size: int = 151936, attn_implementation: str = "sdpa", rms_norm_eps: float = 1e-6,
                 rope_theta: float = 1000000.0, attention_dropout: float = 0.0, hidden_act: str = "silu",
                 initializer_range: float = 0.02, *, params_dtype: torch.dtype | None = None,
                 enforce_enable: bool = False) -> None:
        if hidden_dimension % num_attention_heads or num_attention_heads % num_key_value_heads:
            raise ValueError(f"{_OP}: num_attention_heads={num_attention_heads} must divide hidden_dimension="
                             f"{hidden_dimension} and be divisible by num_key_value_heads={num_key_value_heads}")
        if hidden_act != "silu":
            raise ValueError(f"{_OP}: hidden_act={hidden_act!r}; the Qwen2 MLP here is SwiGLU ('silu')")
        super().__init__(enforce_enable=enforce_enable)
        dtype = params_dtype or torch.get_default_dtype()
        self.hidden_size, self.max_position_embeddings = hidden_dimension, max_position_embeddings
        self.model = _Model(decoder_layer, hidden_dimension, num_attention_heads, num_key_value_heads,
                            intermediate_size, rms_norm_eps, dtype)
        head_dim = hidden_dimension // num_attention_heads
        # its own instance, not get_rope's shared one: a decoder built on the meta device must not
        # leave a meta cos/sin cache behind for every later get_rope caller with these arguments
        self.rotary_emb = RotaryEmbedding(head_dim, head_dim, max_position_embeddings, rope_theta,
                                          is_neox_style=True, dtype=torch.float32)

    def check_input(self, x: Any, attention_mask: Any, token_type_ids: Any = None) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{_OP}: inputs_embeds must be a torch.Tensor, got {type(x).__name__}")
        weight = self.model.norm.weight
        if x.dtype != weight.dtype:
            raise TypeError(f"{_OP}: inputs_embeds has dtype {x.dtype}, expected the weights' {weight.dtype}")
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"{_OP}: inputs_embeds has shape {tuple(x.shape)}, expected [batch, seq_len, {self.hidden_size}]")
        if x.shape[1] > self.max_position_embeddings:
            raise ValueError(f"{_OP}: {x.shape[1]} tokens exceed max_position_embeddings={self.max_position_embeddings}")
        if attention_mask is not None and tuple(attention_mask.shape) != tuple(x.shape[:2]):
            raise ValueError(f"{_OP}: attention_mask has shape {tuple(attention_mask.shape)}, expected {tuple(x.shape[:2])}")
        if token_type_ids is not None and (not isinstance(token_type_ids, torch.Tensor)
                                           or tuple(token_type_ids.shape) != tuple(x.shape[:2])
                                           or token_type_ids.is_floating_point()):
            got = tuple(token_type_ids.shape) if isinstance(token_type_ids, torch.Tensor) else type(token_type_ids).__name__
            raise ValueError(f"{_OP}: token_type_ids must be an integer tensor of shape {tuple(x.shape[:2])} "
                             f"(0 = image, 1 = query), got {got}")

    def forward_native(self, inputs_embeds: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                       attention_mask: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor]:
        self.check_input(inputs_embeds, attention_mask, token_type_ids)
        b, s, _ = inputs_embeds.shape
        mask = additive_mask(s, inputs_embeds.dtype, inputs_embeds.device, attention_mask, token_type_ids)
        positions = torch.arange(s, device=inputs_embeds.device).repeat(b)
        h = inputs_embeds
        for layer in self.model.layers:
            h = layer(h, positions, self.rotary_emb, mask)
        return (self.model.norm(h),)
