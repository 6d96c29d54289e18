"""The state-space specs' models and the SSM inputs (decode and prefill), shared by the specs
(``mamba``) and the launch sweeps (``_mamba_sweep``). A helper module: the runner's spec
collection skips names with a leading underscore.
"""

from __future__ import annotations

from typing import Any

import torch

from customop.benchmarks.specs import Shape
from customop.math import mamba as spec

#: (label, heads, head_dim, state, groups)
MODELS = (("mamba2-2.7b", 80, 64, 128, 1), ("nemotron-h", 128, 64, 128, 8))
CHUNK = 256


def _shape(tokens: int, model, requests: int = 1, quick: bool = False) -> Shape:
    label, H, P, N, G = model
    return Shape(tokens, H * P, f"{label} {tokens}" + (f"/{requests}" if requests > 1 else ""),
                 {"heads": H, "head_dim": P, "state": N, "groups": G, "requests": requests}, quick)


def _ints(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def _decode_inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    e, B = shape.extra, shape.tokens
    H, P, N, G = e["heads"], e["head_dim"], e["state"], e["groups"]

    def r(*s):
        return torch.randn(*s, device=device).to(dtype)

    return {"state": torch.randn(B + 1, H, P, N, device=device), "x": r(B, H, P), "dt": r(B, H),
            "A": -(0.5 + torch.rand(H, device=device)), "B": r(B, G, N), "C": r(B, G, N), "D": r(H),
            "dt_bias": r(H), "slots": torch.arange(1, B + 1, dtype=torch.int32, device=device)}


def _decode_args(i):
    dt4, A4, D4, b4 = spec.ssd_head_form(i["dt"], i["A"], i["D"], i["dt_bias"], i["x"].shape[2], i["B"].shape[2])
    return i["state"], i["x"], dt4, A4, i["B"], i["C"], D4, None, b4, i["slots"], True, spec.NULL_BLOCK_ID


def _prefill_inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    i = _decode_inputs(Shape(shape.tokens, shape.hidden, extra=shape.extra), dtype, device)
    S = min(shape.extra["requests"], shape.tokens)
    if shape.tokens % S:
        raise ValueError(f"ssd_chunk_scan spec: {shape.tokens} tokens do not split into {S} equal requests")
    lens = [shape.tokens // S] * S
    i["state"] = torch.zeros(S + 1, *i["state"].shape[1:], device=device)
    i["qsl"] = _ints([0, *lens], device).cumsum(0, dtype=torch.int32)
    i["slots"], i["init"] = i["slots"][:S], torch.zeros(S, dtype=torch.bool, device=device)
    return i
