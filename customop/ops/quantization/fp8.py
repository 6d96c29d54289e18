"""fp8 constants: the dtype of the current platform, its clamp range and the smallest scale.

e4m3fn saturates at 448 (``finfo.max``). e4m3fnuz (ROCm MI300) can represent 240, but vLLM
clamps it at **224** on purpose, for accuracy (research/op-semantics.md D.4); we do the same, so
quantized values and scales match vLLM's bit for bit. Other fp8 dtypes use ``finfo.max``.

``MIN_SCALE = 1 / (MAX * 512)`` keeps an all-zero row or group from getting a zero scale (whose
reciprocal would be inf).
"""

from __future__ import annotations

import torch

FNUZ_MAX = 224.0


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """The clamp bound of ``fp8_dtype``: 448 for e4m3fn, 224 for e4m3fnuz, else ``finfo.max``."""
    if fp8_dtype == torch.float8_e4m3fnuz:
        return FNUZ_MAX
    return float(torch.finfo(fp8_dtype).max)


def fp8_min_scale(fp8_dtype: torch.dtype) -> float:
    """The lower clamp of dynamic scales: ``1 / (fp8_max * 512)``."""
    return 1.0 / (fp8_max(fp8_dtype) * 512.0)


def current_fp8_dtype() -> torch.dtype:
    """The fp8 dtype of the current platform (e4m3fn; e4m3fnuz on MI300-class ROCm)."""
    from customop.platforms import current_platform

    return current_platform().fp8_dtype()
