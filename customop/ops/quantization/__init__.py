"""fp8 activation quantization: ``QuantFP8`` (``quant_fp8``), ``GroupShape``, the fp8 constants
and the fused ``rms_norm_quant_fp8``. The math is in ``customop/math/quant.py``.
"""

from customop.math.fp8 import fp8_max, fp8_min_scale
from customop.ops.quantization.group_shape import GroupShape
from customop.ops.quantization.input_quant_fp8 import QuantFP8, current_fp8_dtype, quant_fp8
from customop.ops.quantization.rms_norm_quant import rms_norm_quant_fp8

__all__ = [
    "GroupShape",
    "QuantFP8",
    "current_fp8_dtype",
    "fp8_max",
    "fp8_min_scale",
    "quant_fp8",
    "rms_norm_quant_fp8",
]
