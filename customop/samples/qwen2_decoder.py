"""The qwen2_decoder case table: tiny Qwen2 stacks (every parameter random, so a path that drops one
fails) over even and odd sequence lengths, with and without a ``[B, S]`` attention mask, for every
tier and ``customop check``. The float64 references are the tests' (``tests/cases/qwen2_decoder.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from customop.ops.qwen2_decoder import CustomQwen2Decoder
from customop.testing import FLOAT_DTYPES, Sample, randn, register_samples


@dataclasses.dataclass(frozen=True)
class DecoderCase:
    label: str
    init: dict[str, Any]
    #: (batch, seq_len) per tier
    shapes: dict[str, tuple[tuple[int, int], ...]]
    #: pass a [B, S] attention mask with the last ``padded`` keys of row 0 masked
    padded: int = 0

    def init_kwargs(self, dtype: torch.dtype) -> dict[str, Any]:
        return {**self.init, "params_dtype": dtype}

    def shapes_of_parameters(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's name and shape (the layout of ``CustomQwen2Decoder``, computed
        without building one: the real config has half a billion parameters)."""
        cfg = {"decoder_layer": 24, "hidden_dimension": 896, "num_attention_heads": 14, "num_key_value_heads": 2,
               "intermediate_size": 4864, **self.init}
        hid, inter = cfg["hidden_dimension"], cfg["intermediate_size"]
        kv = cfg["num_key_value_heads"] * hid // cfg["num_attention_heads"]
        shapes = {"model.norm.weight": (hid,)}
        for i in range(cfg["decoder_layer"]):
            pre = f"model.layers.{i}."
            shapes.update({pre + "self_attn.q_proj.weight": (hid, hid), pre + "self_attn.q_proj.bias": (hid,),
                           pre + "self_attn.k_proj.weight": (kv, hid), pre + "self_attn.k_proj.bias": (kv,),
                           pre + "self_attn.v_proj.weight": (kv, hid), pre + "self_attn.v_proj.bias": (kv,),
                           pre + "self_attn.o_proj.weight": (hid, hid), pre + "mlp.gate_proj.weight": (inter, hid),
                           pre + "mlp.up_proj.weight": (inter, hid), pre + "mlp.down_proj.weight": (hid, inter),
                           pre + "input_layernorm.weight": (hid,), pre + "post_attention_layernorm.weight": (hid,)})
        return shapes

    def state(self, dtype: torch.dtype, device: str | torch.device = "cpu",
              generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """Random values for every parameter."""
        state = {}
        for name, shape in self.shapes_of_parameters().items():
            if name.endswith("norm.weight"):
                state[name] = 1.0 + randn(*shape, dtype=dtype, device=device, scale=0.2, generator=generator)
            else:
                scale = 0.1 if name.endswith("bias") else shape[-1] ** -0.5
                state[name] = randn(*shape, dtype=dtype, device=device, scale=scale, generator=generator)
        return state

    def build(self, dtype: torch.dtype, device: str | torch.device = "cpu", generator: torch.Generator | None = None):
        op = CustomQwen2Decoder(**self.init_kwargs(dtype)).to(device)
        op.requires_grad_(False)
        op.load_state_dict(self.state(dtype, device, generator), strict=True)
        return op

    def inputs(self, batch: int, seq: int, dtype: torch.dtype, device: str | torch.device = "cpu",
               generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = randn(batch, seq, self.init["hidden_dimension"], dtype=dtype, device=device, generator=generator)
        mask = None
        if self.padded:
            mask = torch.ones(batch, seq, dtype=torch.long, device=device)
            mask[0, seq - self.padded:] = 0
        return x, mask


_TINY = {"decoder_layer": 2, "max_position_embeddings": 64, "hidden_dimension": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 96, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0}
CASES = (
    DecoderCase("tiny gqa", _TINY, {"check": ((1, 8),), "small": ((1, 8), (2, 7), (1, 2))}),
    DecoderCase("tiny gqa padded", _TINY, {"check": ((2, 10),), "small": ((2, 10),)}, padded=3),
    DecoderCase("mqa 1 layer", {**_TINY, "decoder_layer": 1, "num_key_value_heads": 1, "hidden_dimension": 48,
                                "num_attention_heads": 3, "intermediate_size": 80}, {"check": ((1, 6),), "small": ((3, 12),)}),
)
#: the GPU tier: DeepSeek-OCR-2's decoder (24 layers of 896, 14 heads, 2 KV heads) over 2 x 144 and
#: 2 x 256 tokens (image tokens + learned queries)
BY_LABEL = {case.label: case for case in CASES}
REAL_CASES = (DecoderCase("deepseek-ocr-2", {"max_position_embeddings": 4096}, {"real": ((2, 288), (1, 512))}),)
DTYPES = FLOAT_DTYPES


@register_samples("qwen2_decoder", DTYPES)
def _samples(dtype: torch.dtype, device: str, gen: torch.Generator) -> list[Sample]:
    samples = []
    for case in CASES:
        for batch, seq in case.shapes["check"]:
            x, mask = case.inputs(batch, seq, dtype, device, gen)
            samples.append(Sample(case.init_kwargs(dtype), (x,), {"attention_mask": mask},
                                  state=case.state(dtype, device, gen), label=f"{case.label} {batch}x{seq}"))
    return samples
