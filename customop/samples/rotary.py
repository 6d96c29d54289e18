"""The rotary family's case table: what every tier runs, and ``customop check`` too.

- ``SIZES``: RotaryEmbedding's rows per tier, each a head geometry with a token count (tokens,
  query heads, key heads or ``None`` for ``key=None``, head size, rotary dim). ``"check"``:
  ``customop check`` / ``assert_conforms``, two rows with their style fixed (each (dtype, style,
  key or not) is one compiled specialization of the CPU path, and torch.compile's default
  recompile limit is 8). ``"small"``: the paths emulated on a CPU: one token, odd token and head
  counts, partial rotary, a rotary dim whose half is not a power of two (masked pairs), more
  query heads than one kernel tile holds (the looped path), ``key=None``. ``"tpu"``: the TPU
  tier (Pallas in interpret mode, the XLA CPU device): heads of 128 lanes; one token, and odd
  tokens with partial rotary and ``key=None``. ``"real"``: the GPU
  tier, up to 32768 tokens of Llama-3-8B's 32 + 8 heads of 128.
- ``STYLES``: NeoX and GPT-J pairing; every row not fixing its style runs both.
- ``ROPE_TYPES``: get_rope's rope types (vLLM 0.33's table) that run RotaryEmbedding's paths,
  each a ``rope_parameters`` dict with its head size and context.
- ``APPLY``: ApplyRotaryEmb's rows (input shape, rotary dim, style); each runs with and without
  ``enable_fp32_compute``. ``DUAL_CHUNK``: DualChunkRotaryEmbedding's.
- ``DTYPES``.

The float64 references are the tests' (``tests/cases/rotary.py``; ``tests/cases/__init__.py``
says why they are not shipped). A tier chooses only the path under test and one of ``SIZES``.
"""

from __future__ import annotations

import dataclasses

import torch

from customop.ops.rotary_embedding import ApplyRotaryEmb, RotaryEmbedding, get_rope
from customop.testing import FLOAT_DTYPES, Sample, assert_close, randn, register_samples

MAX_POS = 4096
BASE = 10000.0
STYLES = (True, False)  # is_neox_style
DTYPES = FLOAT_DTYPES


def compare_rotated(actual, expected, dtype: torch.dtype) -> None:
    """The dtype's tolerance plus one rounding of each product ``x * cos``: paths that keep the
    products in fp32 (compiled, kernels) and ones that round them to the dtype (eager) may differ
    by that much, which for |x| ~ 4 exceeds a bf16 ulp of the result."""
    tensors = [t for t in (actual if isinstance(actual, (tuple, list)) else (actual,)) if t is not None]
    magnitude = max((float(t.detach().abs().max()) for t in tensors if t.numel()), default=0.0)
    atol = 2 * torch.finfo(dtype).eps * magnitude if dtype != torch.float32 else None
    assert_close(actual, expected, dtype, atol=atol)


def style_id(is_neox: bool) -> str:
    return "neox" if is_neox else "gptj"


@dataclasses.dataclass(frozen=True)
class RopeCase:
    label: str
    tokens: int
    heads: int
    kv_heads: int | None  # None: key=None
    head_size: int
    rotary_dim: int
    #: a row that fixes its style (the check rows); None: every tier runs both ``STYLES``
    neox: bool | None = None

    def styles(self) -> tuple[bool, ...]:
        return STYLES if self.neox is None else (self.neox,)

    def build(self, is_neox: bool, dtype: torch.dtype, max_pos: int = MAX_POS) -> RotaryEmbedding:
        """The op (the caller's config decides its dispatch); its cache is in ``dtype``."""
        return RotaryEmbedding(**self.init_kwargs(is_neox, dtype, max_pos))

    def init_kwargs(self, is_neox: bool, dtype: torch.dtype, max_pos: int = MAX_POS) -> dict:
        return dict(head_size=self.head_size, rotary_dim=self.rotary_dim, max_position_embeddings=max_pos,
                    base=BASE, is_neox_style=is_neox, dtype=dtype)

    def inputs(self, dtype: torch.dtype, device: str | torch.device = "cpu", generator: torch.Generator | None = None,
               max_pos: int = MAX_POS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(positions, query ``[T, heads * head_size]``, key ``[T, kv_heads * head_size]`` or None)."""
        positions = torch.randint(0, max_pos, (self.tokens,), generator=generator).to(device)
        q = randn(self.tokens, self.heads * self.head_size, dtype=dtype, device=device, generator=generator)
        k = None if self.kv_heads is None else randn(self.tokens, self.kv_heads * self.head_size, dtype=dtype,
                                                     device=device, generator=generator)
        return positions, q, k


SIZES: dict[str, tuple[RopeCase, ...]] = {
    "check": (RopeCase("T17 32+8 heads of 128", 17, 32, 8, 128, 128, neox=True),  # Llama-3-8B's heads
              RopeCase("T3 3 heads of 64 rot 32 key=None", 3, 3, None, 64, 32, neox=False)),
    "small": (
        RopeCase("decode 32+8x128", 1, 32, 8, 128, 128),
        RopeCase("decode 4+2x64", 1, 4, 2, 64, 64),
        RopeCase("T33 32+8x128", 33, 32, 8, 128, 128),
        RopeCase("odd heads 5+3x64", 5, 5, 3, 64, 64),
        RopeCase("partial 3+1x128 rot 64", 7, 3, 1, 128, 64),
        RopeCase("odd rotary 8+2x128 rot 96", 33, 8, 2, 128, 96),  # 48 pairs: masked
        RopeCase("many heads 48+4x128", 3, 48, 4, 128, 128),  # more than a 32-head tile: looped
        RopeCase("key None 4x64", 9, 4, None, 64, 64),
    ),
    "tpu": (
        RopeCase("tpu decode 4+2x128", 1, 4, 2, 128, 128),
        RopeCase("tpu partial key None T7 3x128 rot 64", 7, 3, None, 128, 64),
    ),
    "real": (
        RopeCase("T1 32+8x128", 1, 32, 8, 128, 128),
        RopeCase("T16 32+8x128", 16, 32, 8, 128, 128),
        RopeCase("T256 32+8x128", 256, 32, 8, 128, 128),
        RopeCase("T4096 32+8x128", 4096, 32, 8, 128, 128),
        RopeCase("T32768 32+8x128", 32768, 32, 8, 128, 128),
        RopeCase("partial T4096 32+8x128 rot 64", 4096, 32, 8, 128, 64),
        RopeCase("odd rotary T3000 28+4x128 rot 96", 3000, 28, 4, 128, 96),
        RopeCase("many heads T5 64+8x64", 5, 64, 8, 64, 64),
        RopeCase("key None T1024 16x256 rot 128", 1024, 16, None, 256, 128),
    ),
}
BY_LABEL = {case.label: case for rows in SIZES.values() for case in rows}


@dataclasses.dataclass(frozen=True)
class ApplyCase:
    label: str
    shape: tuple[int, ...]  # x: [batch?, seq, heads, head_size]
    rotary_dim: int
    neox: bool

    def build(self, fp32_compute: bool, enforce_enable: bool = False) -> ApplyRotaryEmb:
        return ApplyRotaryEmb(enforce_enable, self.neox, fp32_compute)

    def inputs(self, dtype: torch.dtype, device: str | torch.device = "cpu",
               generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x, cos, sin): fp32 cos/sin of random angles in [0, 6.3), one row per sequence position."""
        x = randn(*self.shape, dtype=dtype, device=device, generator=generator)
        angles = torch.rand(self.shape[-3], self.rotary_dim // 2, generator=generator, dtype=torch.float64) * 6.3
        return x, angles.cos().float().to(device), angles.sin().float().to(device)


APPLY = (
    ApplyCase("2x5x3x64 neox", (2, 5, 3, 64), 64, True),
    ApplyCase("7x4x32 rot 16 gptj", (7, 4, 32), 16, False),  # 3-D x, partial rotary
    ApplyCase("1x9x2x80 rot 40 neox", (1, 9, 2, 80), 40, True),
)

@dataclasses.dataclass(frozen=True)
class RopeTypeCase:
    """One row of get_rope's table (vLLM 0.33's rope types): ``get_rope(head_size, max_position,
    is_neox, rope_parameters, dtype)``. ``positions`` is the exclusive upper bound of the positions
    the rows' inputs use (the cache rows a model reaches)."""

    label: str
    head_size: int
    max_position: int
    is_neox: bool
    rope_parameters: dict
    positions: int

    def build(self, dtype: torch.dtype) -> RotaryEmbedding:
        return get_rope(self.head_size, self.max_position, self.is_neox, self.rope_parameters, dtype)


_SHORT = [1.0 + 0.05 * i for i in range(32)]
_LONG = [1.0 + 0.9 * i for i in range(32)]
#: get_rope's rope types other than "default" that run RotaryEmbedding's paths (kernels included):
#: small heads, a few hundred positions, odd factors.
ROPE_TYPES = (
    RopeTypeCase("linear", 64, 256, True, {"rope_type": "linear", "factor": [1.0, 2.5]}, 256),
    RopeTypeCase("dynamic", 64, 512, True, {"rope_type": "dynamic", "factor": 2.0, "max_trained_positions": 256}, 512),
    RopeTypeCase("dynamic alpha", 64, 256, False, {"rope_type": "dynamic", "alpha": 1000.0, "factor": 3.0}, 256),
    RopeTypeCase("ntk", 64, 256, True, {"rope_type": "ntk", "factor": 4.0}, 256),
    RopeTypeCase("ntk mixed", 64, 256, False, {"rope_type": "ntk", "factor": 4.0, "mixed_b": 0.75}, 256),
    RopeTypeCase("yarn attention_factor", 64, 4096, True, {
        "rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64, "attention_factor": 1.0}, 1024),
    RopeTypeCase("yarn mscale partial", 128, 4096, True, {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "mscale": 1.0,
        "mscale_all_dim": 0.5, "beta_fast": 16, "partial_rotary_factor": 0.75}, 512),
    RopeTypeCase("llama3", 64, 1024, True, {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128, "rope_theta": 500000.0}, 1024),
    RopeTypeCase("deepseek_yarn", 64, 4096, False, {
        "rope_type": "deepseek_yarn", "factor": 4.0, "original_max_position_embeddings": 128, "mscale": 0.707,
        "mscale_all_dim": 1.0}, 512),
    RopeTypeCase("longrope", 64, 256, True, {
        "rope_type": "longrope", "original_max_position_embeddings": 64, "short_factor": _SHORT,
        "long_factor": _LONG}, 256),
    RopeTypeCase("proportional", 64, 256, True, {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                                 "rope_theta": 1e6}, 256),
)

#: DualChunkRotaryEmbedding: (tokens, heads, kv heads, head size, chunk size, local size)
DUAL_CHUNK = ((6, 2, 1, 32, 16, 4),)


@register_samples("rotary_embedding")
def rotary_embedding_samples(dtype: torch.dtype, device: str, gen: torch.Generator) -> list[Sample]:
    return [Sample(init_kwargs=case.init_kwargs(is_neox, dtype), args=case.inputs(dtype, device, gen),
                   compare=compare_rotated, label=f"{case.label} {style_id(is_neox)}")
            for case in SIZES["check"] for is_neox in case.styles()]


@register_samples("apply_rotary_emb")
def apply_rotary_emb_samples(dtype: torch.dtype, device: str, gen: torch.Generator) -> list[Sample]:
    return [Sample(init_kwargs=dict(enforce_enable=False, is_neox_style=case.neox, enable_fp32_compute=fp32),
                   args=case.inputs(dtype, device, gen), compare=compare_rotated,
                   label=f"{case.label}{' fp32' if fp32 else ''}")
            for case in APPLY for fp32 in (False, True)]


@register_samples("dual_chunk_rotary_embedding")
def dual_chunk_samples(dtype: torch.dtype, device: str, gen: torch.Generator) -> list[Sample]:
    return [Sample(
        init_kwargs=dict(head_size=head, rotary_dim=head, max_position_embeddings=64, base=BASE,
                         is_neox_style=True, dtype=dtype, chunk_size=chunk, local_size=local),
        args=(torch.randint(0, 64, (tokens,), generator=gen).to(device),
              randn(tokens, heads * head, dtype=dtype, device=device, generator=gen),
              randn(tokens, kv_heads * head, dtype=dtype, device=device, generator=gen)),
        compare=compare_rotated, label=f"T={tokens} chunk {chunk}/local {local}")
        for tokens, heads, kv_heads, head, chunk, local in DUAL_CHUNK]
