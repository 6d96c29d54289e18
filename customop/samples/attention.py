"""The attention family's case tables (``mm_encoder_attn``; ``rel_pos_attention`` at the end): what
every tier runs, and ``customop check``.

- ``CASES``: head layouts: every head size vLLM's vision encoders use (64, 72, 80, 96, 128), full
  multi-head, grouped (GQA) and single-key-head (MQA) attention, the 3-D ``[B, S, H * D]`` and 4-D
  ``[B, S, H, D]`` call forms, the default and an explicit scale.
- ``SIZES``: per tier, ``Packing(batch, lengths)``: ``lengths`` are the segments of each row's
  sequence (``cu_seqlens``), or ``None`` with ``seq_len`` for rows without ``cu_seqlens`` (each
  row one segment). ``"check"``: ``customop check`` / ``assert_conforms``. ``"small"``: the paths
  emulated on a CPU: a one-token sequence, lengths 1 and 7 and odd mixes with an empty segment,
  64 segments, two batch rows sharing one ``cu_seqlens``. ``"real"``: the GPU tier (with
  ``REAL_CASES``, ViT head layouts): 16384 tokens in 4, 16 and 64 segments, 1024 and 4096
  tokens, an uneven mix, three rows without ``cu_seqlens``.
- ``DTYPES``.

The float64 references are the tests' (``tests/cases/attention.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch

from customop.custom_op import CustomOp
from customop.ops.attention import MMEncoderAttention
from customop.testing import FLOAT_DTYPES, Sample, randn, register_samples


@dataclasses.dataclass(frozen=True)
class Packing:
    """``batch`` rows of one packed sequence each: the segments ``lengths`` (``cu_seqlens``), or
    ``seq_len`` tokens in one segment per row when ``lengths`` is None."""

    batch: int
    lengths: tuple[int, ...] | None
    seq_len: int = 0

    @property
    def tokens(self) -> int:
        return sum(self.lengths) if self.lengths is not None else self.seq_len

    @property
    def label(self) -> str:
        if self.lengths is None:
            return f"{self.batch}x{self.seq_len} no cu_seqlens"
        shown = ",".join(map(str, self.lengths[:6])) + (",..." if len(self.lengths) > 6 else "")
        return f"{self.batch}x[{shown}] ({len(self.lengths)} segments)"

    def cu_seqlens(self, device: str | torch.device = "cpu") -> torch.Tensor | None:
        if self.lengths is None:
            return None
        return torch.tensor(list(itertools.accumulate(self.lengths, initial=0)), dtype=torch.int32, device=device)

    @property
    def max_seqlen(self) -> int:
        return max(self.lengths) if self.lengths is not None else self.seq_len


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    label: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    four_d: bool = False  # the [B, S, H, D] call form (else [B, S, H * D])
    scale: float | None = None

    def init_kwargs(self) -> dict[str, Any]:
        kwargs = {"num_heads": self.num_heads, "head_size": self.head_size, "num_kv_heads": self.num_kv_heads}
        return kwargs if self.scale is None else {**kwargs, "scale": self.scale}

    def build(self, **kwargs: Any) -> MMEncoderAttention:
        """The op (the caller's config decides its dispatch); ``kwargs`` go to the constructor."""
        return MMEncoderAttention(**self.init_kwargs(), **kwargs)

    def shape(self, packing: Packing, heads: int) -> tuple[int, ...]:
        rows = (packing.batch, packing.tokens)
        return (*rows, heads, self.head_size) if self.four_d else (*rows, heads * self.head_size)

    def inputs(self, packing: Packing, dtype: torch.dtype, device: str | torch.device = "cpu",
               generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Random ``(query, key, value)``. Queries and keys at standard deviation 2, so that the
        softmax is peaked (a kernel that mixes segments or drops a key moves the output)."""
        q = randn(*self.shape(packing, self.num_heads), dtype=dtype, device=device, scale=2.0, generator=generator)
        k, v = (randn(*self.shape(packing, self.num_kv_heads), dtype=dtype, device=device, scale=s, generator=generator)
                for s in (2.0, 1.0))
        return q, k, v


CASES = (
    AttentionCase("mha d64", 4, 4, 64),
    AttentionCase("gqa d72", 4, 2, 72),
    AttentionCase("mqa d80 4d", 4, 1, 80, four_d=True),
    AttentionCase("gqa d96 4d scale", 6, 2, 96, four_d=True, scale=0.05),
    AttentionCase("mha d128", 2, 2, 128),
)
BY_LABEL = {case.label: case for case in CASES}
#: the GPU tier's and the benchmarks' layouts: ViT heads (Qwen2-VL: 16 x 80; SigLIP-style 16 x 64)
#: and a grouped one with the widest head
REAL_CASES = (
    AttentionCase("vit 16x80", 16, 16, 80),
    AttentionCase("vit 16x64", 16, 16, 64),
    AttentionCase("gqa 16/4x128 4d", 16, 4, 128, four_d=True),
)

#: 64 segments of 1 to 3 tokens
_MANY = tuple(1 + i % 3 for i in range(64))
SIZES: dict[str, tuple[Packing, ...]] = {
    "check": (Packing(1, (1, 7)), Packing(1, (16,)), Packing(2, None, 5)),
    "small": (Packing(1, (1,)), Packing(1, (7,)), Packing(1, (1, 7, 0, 33, 20)), Packing(1, _MANY),
              Packing(2, (3, 1, 9)), Packing(2, None, 37)),
    "real": (Packing(1, (4096,) * 4), Packing(1, (1024,) * 16), Packing(1, (256,) * 64), Packing(1, (1024,)),
             Packing(1, (4096,)), Packing(1, (1, 7, 4095, 777, 64, 3000)), Packing(3, None, 1025)),
}
DTYPES = FLOAT_DTYPES


@register_samples("mm_encoder_attn", DTYPES)
def _samples(dtype: torch.dtype, device: str, gen: torch.Generator) -> list[Sample]:
    samples = []
    for case, packing in itertools.product(CASES, SIZES["check"]):
        q, k, v = case.inputs(packing, dtype, device, gen)
        kwargs = {}
        if packing.lengths is not None:
            # vLLM passes max_seqlen as a 0-d tensor, kept on the CPU to avoid a device sync
            kwargs = {"cu_seqlens": packing.cu_seqlens(device), "max_seqlen": torch.tensor(packing.max_seqlen)}
        samples.append(Sample(case.init_kwargs(), (q, k, v), kwargs, label=f"{case.label} {packing.label}"))
    return samples


# ---- rel_pos_attention -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RelPosCase:
    """A ``RelPosAttention`` variant and its ``[B, H, W, dim]`` inputs per tier. A grid other than
    ``input_size`` makes the op interpolate its position tables."""

    label: str
    init: dict[str, Any]
    shapes: dict[str, tuple[tuple[int, int, int, int], ...]]

    def init_kwargs(self, dtype: torch.dtype) -> dict[str, Any]:
        return {**self.init, "params_dtype": dtype}

    def state(self, dtype: torch.dtype, device: str | torch.device = "cpu",
              generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """Random weights in the op's parameter names (the position tables too: zeros would hide them)."""
        dim, heads = self.init["dim"], self.init.get("num_heads", 8)
        r = lambda *shape, scale: randn(*shape, dtype=dtype, device=device, scale=scale, generator=generator)  # noqa: E731
        state = {"qkv.weight": r(3 * dim, dim, scale=dim ** -0.5), "proj.weight": r(dim, dim, scale=dim ** -0.5),
                 "proj.bias": r(dim, scale=0.1)}
        if self.init.get("qkv_bias", True):
            state["qkv.bias"] = r(3 * dim, scale=0.1)
        if self.init.get("use_rel_pos"):
            h, w = self.init["input_size"]
            state["rel_pos_h"] = r(2 * h - 1, dim // heads, scale=0.3)
            state["rel_pos_w"] = r(2 * w - 1, dim // heads, scale=0.3)
        return state

    def build(self, dtype: torch.dtype, device: str | torch.device = "cpu",
              generator: torch.Generator | None = None, **kwargs: Any):
        op = CustomOp.op_registry["rel_pos_attention"](**self.init_kwargs(dtype), **kwargs).to(device)
        op.requires_grad_(False)
        op.load_state_dict(self.state(dtype, device, generator))
        return op


REL_POS_CASES = (
    RelPosCase("rel_pos 8x8", {"dim": 64, "num_heads": 4, "use_rel_pos": True, "input_size": (8, 8)},
               {"check": ((1, 8, 8, 64),), "small": ((2, 8, 8, 64),)}),
    # 6 x 10 on tables for 8 x 8: the height table shrinks (15 -> 11 rows), the width one grows (15 -> 19)
    RelPosCase("rel_pos interpolated", {"dim": 64, "num_heads": 4, "use_rel_pos": True, "input_size": (8, 8)},
               {"check": ((1, 6, 10, 64),), "small": ((1, 6, 10, 64), (1, 1, 7, 64), (2, 7, 5, 64), (1, 1, 1, 64))}),
    # odd grids on their own tables (no interpolation): 7 x 5, and one token on 1-row tables
    RelPosCase("rel_pos 7x5", {"dim": 64, "num_heads": 4, "use_rel_pos": True, "input_size": (7, 5)},
               {"check": ((1, 7, 5, 64),), "small": ((2, 7, 5, 64),)}),
    RelPosCase("rel_pos 1x1", {"dim": 32, "num_heads": 2, "use_rel_pos": True, "input_size": (1, 1)},
               {"check": ((1, 1, 1, 32),), "small": ((2, 1, 1, 32),)}),
    RelPosCase("rel_pos no qkv bias", {"dim": 32, "num_heads": 2, "qkv_bias": False, "use_rel_pos": True,
                                       "input_size": (4, 6)}, {"check": ((1, 4, 6, 32),), "small": ((3, 4, 6, 32),)}),
    RelPosCase("plain", {"dim": 48, "num_heads": 3}, {"check": ((2, 4, 7, 48),), "small": ((2, 4, 7, 48), (1, 1, 1, 48))}),
)
#: the GPU tier: SAM ViT-B's global blocks (64 x 64 tokens) and windowed ones (14 x 14 windows)
REL_POS_REAL = (
    RelPosCase("sam global 64x64", {"dim": 768, "num_heads": 12, "use_rel_pos": True, "input_size": (64, 64)},
               {"real": ((1, 64, 64, 768),)}),
    RelPosCase("sam window 14x14", {"dim": 768, "num_heads": 12, "use_rel_pos": True, "input_size": (14, 14)},
               {"real": ((25, 14, 14, 768),)}),
)


@register_samples("rel_pos_attention", DTYPES)
def _rel_pos_samples(dtype: torch.dtype, device: str, gen: torch.Generator) -> list[Sample]:
    return [Sample(case.init_kwargs(dtype), (randn(*shape, dtype=dtype, device=device, generator=gen),),
                   state=case.state(dtype, device, gen), label=f"{case.label} {'x'.join(map(str, shape))}")
            for case in REL_POS_CASES for shape in case.shapes["check"]]
