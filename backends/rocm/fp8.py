"""fp8 on AMD GPUs: which e4m3 variant each architecture computes in, its clamp bound, and what
the shared Triton quant kernels (backends/triton/quant.py, fused_norm_quant.py) do there.

Written for ROCm and **not run on AMD hardware** (none is reachable here). What was checked
without one: every quant and rotary kernel compiles for gfx942 (MI300) through Triton's AMD
backend with the fnuz output type (tests/backends/triton/test_aot_rotary_quant.py).

- MI300 (gfx940/941/942) implements only the *fnuz* e4m3 (``torch.float8_e4m3fnuz``, Triton's
  ``fp8e4b8``): exponent bias 8, no infinities, one NaN (0x80), finite max 240. vLLM clamps at
  **224**, not 240, on purpose (accuracy; research/op-semantics.md D.4); the ops pass
  ``fp8_max=224`` to the kernels (customop/ops/quantization/fp8.py), which use it as given.
- MI350 (gfx950) and RDNA4 (gfx12) implement the OCP e4m3 (``torch.float8_e4m3fn``, max 448),
  as NVIDIA does.
- The kernels take the fp8 type from the output tensor (``q_ptr.dtype.element_ty``), so the same
  source emits the fnuz conversion on MI300; asking for the other variant fails to compile there
  ("type fp8e4nv not supported in this architecture"), which ``check_fp8_dtype`` turns into an
  error naming the architecture and the dtype to use.
- Scales stay fp32 and every division is IEEE (``div_rn``) on both vendors, so the scales do not
  depend on the GPU; the fp8 rounding is the hardware's round-to-nearest-even on both.

Wave-64 tuning: a wavefront is 64 lanes, twice a CUDA warp, so the kernels keep the same lanes
per program with half the warps: ``_tuning`` halves ``num_warps`` for the ``hip`` device kind
(rows, tile and flat configs, i.e. every quant kernel) and rotary.py's warp table has ``hip: 2``.
Block sizes are the CUDA ones; none was timed on an AMD GPU.
"""

from __future__ import annotations

import torch

#: the clamp bound the ops pass for each fp8 dtype (224 for fnuz: vLLM's choice, not finfo's 240)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 224.0}

#: architectures (``gcnArchName`` prefixes) whose fp8 is the fnuz variant
FNUZ_ARCHS = ("gfx940", "gfx941", "gfx942")


def arch_of(device: torch.device) -> str:
    """The device's gfx architecture name (``gfx942:sramecc+:xnack-`` -> ``gfx942``), or ``""``
    when torch was not built for ROCm."""
    if not torch.version.hip or device.type != "cuda":
        return ""
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "gcnArchName", "").split(":")[0]


def fp8_dtype_for(arch: str) -> torch.dtype:
    """The e4m3 variant the architecture computes in."""
    return torch.float8_e4m3fnuz if arch.startswith(FNUZ_ARCHS) else torch.float8_e4m3fn


def check_fp8_dtype(device: torch.device, out_dtype: torch.dtype) -> None:
    """Raises ValueError when ``out_dtype`` is not the fp8 variant ``device`` computes in (only on
    ROCm; on other devices it does nothing)."""
    arch = arch_of(device)
    if arch and out_dtype in FP8_MAX and out_dtype != fp8_dtype_for(arch):
        raise ValueError(f"fp8 quant: {arch} computes in {fp8_dtype_for(arch)}, not {out_dtype}; "
                         f"quantize to {fp8_dtype_for(arch)} with fp8_max={FP8_MAX[fp8_dtype_for(arch)]}")
