"""Launch configurations of the MoE kernels: a table per problem shape, read at run time, never
autotuned on the request path (an autotune times every candidate on the first call of a shape:
seconds of warm-up inside a request, and a host sync).

A key is ``(device kind, E_local, N = I per rank, K = H, top_k, dtype)``; its value is a tuple of
``(max_tokens, MoEConfig)`` rows in increasing ``max_tokens``; a call with T tokens takes the
first row with ``max_tokens >= T`` (the last row beyond). ``MoEConfig`` holds the token block
(``block_m``, shared by the alignment and both GEMMs) and one ``GemmConfig`` per GEMM, plus the
route: the Triton grouped GEMM or the ``torch._grouped_mm`` pipeline (``path``).

``TABLE`` is filled from measurements: ``python -m customop.benchmarks.specs.moe --tune`` on the
GPU times ``candidates`` for the benchmark shapes and prints rows to paste here. Shapes without
a row run ``default_config``: block sizes from the tokens each expert receives, Triton
everywhere (on the H200 the ``grouped_mm`` candidate won no shape tuned so far).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    block_m: int
    gemm1: GemmConfig
    gemm2: GemmConfig
    #: "triton" (align + two grouped GEMMs + the top-k sum) or "grouped_mm" (torch._grouped_mm)
    path: str = "triton"

    def __post_init__(self) -> None:
        for value in (self.block_m, self.gemm1.block_n, self.gemm1.block_k, self.gemm2.block_n, self.gemm2.block_k):
            if value < 16 or value & (value - 1):
                raise ValueError(f"MoEConfig: block sizes must be powers of two >= 16 (tl.dot), got {self}")
        if self.path not in ("triton", "grouped_mm"):
            raise ValueError(f"MoEConfig: path must be 'triton' or 'grouped_mm', got {self.path!r}")


Key = tuple[str, int, int, int, int, str]
#: (device kind, E_local, I, H, top_k, dtype name) -> ((max_tokens, MoEConfig), ...)
TABLE: dict[Key, tuple[tuple[int, MoEConfig], ...]] = {}

_G = GemmConfig
#: H200 (sm_90, torch 2.11, triton 3.6), bf16, ``--tune``: the best of the candidates per token
#: count (us per call in CUDA graphs). Token counts between two rows take the larger row's config;
#: beyond the last row, the last row. Mixtral T=256 / 4096: 2026-12-01 (25 candidates; default_config
#: took 6319 us at 4096). The rest: 2026-12-02, ``--tune --jobs 10/12`` with the decode candidates
#: (31 at T=1 and 16): Mixtral T=1 174.5 us (the 2026-12-01 row 190.1, default_config 213).
TABLE[("cuda", 8, 14336, 4096, 2, "bfloat16")] = (
    (1, MoEConfig(16, _G(64, 128, 8, 4, 4), _G(32, 128, 8, 4, 4))),  # 174.5 us
    (16, MoEConfig(16, _G(64, 256, 8, 8, 3), _G(64, 256, 8, 8, 3))),  # 651.1 us (all 8 experts' weights)
    (256, MoEConfig(128, _G(64, 64, 8, 8, 3), _G(128, 64, 8, 8, 3))),  # 811.8 us
    (4096, MoEConfig(128, _G(128, 64, 8, 8, 3), _G(128, 64, 8, 8, 3))),  # 5998.6 us
    (16384, MoEConfig(128, _G(128, 64, 8, 8, 3), _G(128, 64, 8, 8, 3))),  # 22878 us (505 TFLOP/s)
)
#: Qwen3-30B-A3B, 2026-12-02 (T=1: 32.5 us on default_config the day before; the weight-read
#: floor of the 8 experts touched is ~17.8 us)
TABLE[("cuda", 128, 768, 2048, 8, "bfloat16")] = (
    (1, MoEConfig(16, _G(64, 128, 8, 4, 4), _G(32, 128, 8, 4, 4))),  # 26.2 us
    (16, MoEConfig(16, _G(64, 128, 8, 4, 3), _G(64, 128, 8, 4, 3))),  # 187.5 us
    (256, MoEConfig(32, _G(64, 128, 8, 4, 3), _G(64, 128, 8, 4, 3))),  # 309.7 us
    (4096, MoEConfig(128, _G(128, 64, 8, 8, 3), _G(128, 64, 8, 8, 3))),  # 914.5 us
    (16384, MoEConfig(128, _G(128, 64, 8, 8, 3), _G(128, 64, 8, 8, 3))),  # 2965 us
)

_override: list[MoEConfig] = []


def default_config(tokens: int, num_experts: int, n: int, k: int, top_k: int, dtype: torch.dtype) -> MoEConfig:
    """The rule for shapes without a row. The token block follows the rows each expert gets on
    average (``T * top_k / E``): decode sizes pad every used expert's few rows to one block, so a
    small block wastes least; prefill sizes want large blocks for weight reuse. GEMM1 keeps two
    accumulators (gate and up), hence its narrower N block (128 x 128 with two accumulators
    spills on sm_90). fp32 halves the K block (registers)."""
    per_expert = tokens * top_k / max(num_experts, 1)
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64 if per_expert <= 192 else 128
    block_k = 32 if dtype == torch.float32 else 64
    warps = 4 if block_m <= 32 else 8
    gemm1 = GemmConfig(block_n=64, block_k=block_k, num_warps=warps)
    gemm2 = GemmConfig(block_n=64 if block_m <= 32 else 128, block_k=block_k, num_warps=warps)
    return MoEConfig(block_m, gemm1, gemm2)


def device_kind(device: torch.device) -> str:
    if device.type == "cuda":
        return "hip" if torch.version.hip else "cuda"
    return device.type


def config(device: torch.device, tokens: int, num_experts: int, n: int, k: int, top_k: int,
           dtype: torch.dtype) -> MoEConfig:
    """The configuration a launch uses: an override (benchmarks, tests), the table's row, or
    ``default_config``."""
    return lookup(device, tokens, num_experts, n, k, top_k, dtype)[0]


def lookup(device: torch.device, tokens: int, num_experts: int, n: int, k: int, top_k: int,
           dtype: torch.dtype) -> tuple[MoEConfig, str]:
    """``config`` and where it came from: ``"override"``, ``"table"`` or ``"default"``."""
    if _override:
        return _override[-1], "override"
    rows = TABLE.get((device_kind(device), num_experts, n, k, top_k, str(dtype).removeprefix("torch.")))
    if rows:
        return next((cfg for max_tokens, cfg in rows if tokens <= max_tokens), rows[-1][1]), "table"
    return default_config(tokens, num_experts, n, k, top_k, dtype), "default"


def grouped_mm_applies(device: torch.device, dtype: torch.dtype, hidden: int, inter: int) -> bool:
    """torch._grouped_mm's CUDA kernel takes bf16 with 16-byte aligned rows on sm90+ (a
    ``grouped_mm`` config falls back to the Triton route elsewhere)."""
    return (hasattr(torch, "_grouped_mm") and device.type == "cuda" and dtype == torch.bfloat16
            and hidden % 8 == 0 and inter % 8 == 0 and torch.cuda.get_device_capability(device) >= (9, 0))


def sparse_decode(tokens: int, num_experts: int, top_k: int, has_map: bool) -> bool:
    """The GEMMs' one-block-per-slot shortcut (every slot likely its own expert): no alignment."""
    return not has_map and tokens * top_k * 4 <= num_experts


def route(device: torch.device, tokens: int, num_experts: int, n: int, k: int, top_k: int,
          dtype: torch.dtype, has_map: bool = False) -> str:
    """What ``fused_experts`` runs for this shape, in words (``customop info``); reads only this
    table, never triton (``torch.cuda`` only for a ``grouped_mm`` row's device check)."""
    if tokens == 0:
        return "none (no tokens)"
    cfg, source = lookup(device, tokens, num_experts, n, k, top_k, dtype)
    if cfg.path == "grouped_mm" and grouped_mm_applies(device, dtype, k, n):
        return f"torch._grouped_mm ({source})"
    g1, g2 = cfg.gemm1, cfg.gemm2
    block = "sparse decode" if sparse_decode(tokens, num_experts, top_k, has_map) else f"block_m={cfg.block_m}"
    return (f"triton {block}, gemm1 {g1.block_n}x{g1.block_k} w{g1.num_warps}, "
            f"gemm2 {g2.block_n}x{g2.block_k} w{g2.num_warps} ({source})")


@contextlib.contextmanager
def override(cfg: MoEConfig) -> Iterator[MoEConfig]:
    """Every MoE launch inside the block uses ``cfg`` (for the tuning sweep and the tests)."""
    _override.append(cfg)
    try:
        yield cfg
    finally:
        _override.pop()


def candidates(tokens: int, num_experts: int, top_k: int) -> list[MoEConfig]:
    """The configurations the tuning sweep times for one shape."""
    out = []
    for block_m in (16, 32, 64, 128):
        if block_m > 16 and tokens * top_k < block_m * 2:
            continue  # fewer rows than two blocks: a bigger block only adds padding
        shapes = [(64, 64, 64, 4, 3), (64, 128, 64, 4, 4), (64, 128, 64, 8, 3),
                  (64, 64, 128, 4, 3), (128, 128, 64, 8, 3), (32, 64, 64, 4, 4)]
        if tokens * top_k <= 64:  # decode: weight-read bound; narrow N blocks put more programs on the
            # SMs (Mixtral's GEMM2 has 64 blocks of 64 columns per expert), deep K tiles more bytes in flight
            shapes += [(32, 32, 128, 4, 4), (64, 32, 128, 4, 4), (32, 32, 256, 4, 3), (64, 32, 256, 8, 3),
                       (32, 16, 256, 4, 4), (64, 64, 256, 8, 3)]
        for bn1, bn2, bk, warps, stages in shapes:
            out.append(MoEConfig(block_m, GemmConfig(bn1, bk, 8, warps, stages), GemmConfig(bn2, bk, 8, warps, stages)))
    out.append(dataclasses.replace(default_config(tokens, num_experts, 0, 0, top_k, torch.bfloat16), path="grouped_mm"))
    return out
