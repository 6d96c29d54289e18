"""fp8 facts, each written once: which e4m3 variant a GPU computes in, the clamp bound of each
fp8 dtype, and the smallest dynamic scale.

- e4m3fn (NVIDIA, AMD MI350/gfx950, RDNA4): saturates at 448 (``finfo.max``).
- e4m3fnuz (AMD MI300, gfx940-942): exponent bias 8, no infinities, finite max 240; vLLM clamps it
  at **224** on purpose (accuracy), and so do we, so that quantized values and scales match
  vLLM's bit for bit. Other fp8 dtypes use ``finfo.max``.
- ``min_scale = 1 / (fp8_max * 512)`` keeps an all-zero row or group from getting a zero scale
  (whose reciprocal would be inf).
"""

from __future__ import annotations

import torch

#: AMD architectures (``gcnArchName`` prefixes) that implement only the fnuz variant of e4m3.
FNUZ_ARCHS = ("gfx940", "gfx941", "gfx942")
FNUZ_MAX = 224.0


def fp8_dtype_for_arch(arch: str) -> torch.dtype:
    """The e4m3 variant a GPU architecture computes in (``""``, i.e. not ROCm: e4m3fn)."""
    return torch.float8_e4m3fnuz if arch.startswith(FNUZ_ARCHS) else torch.float8_e4m3fn


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """The clamp bound of ``fp8_dtype``: 448 for e4m3fn, 224 for e4m3fnuz, else ``finfo.max``."""
    if fp8_dtype == torch.float8_e4m3fnuz:
        return FNUZ_MAX
    return float(torch.finfo(fp8_dtype).max)


def fp8_min_scale(fp8_dtype: torch.dtype) -> float:
    """The lower clamp of dynamic scales: ``1 / (fp8_max * 512)``."""
    return 1.0 / (fp8_max(fp8_dtype) * 512.0)
