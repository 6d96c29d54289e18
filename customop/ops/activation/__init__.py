"""Activations: gated units (``*_and_mul``) and elementwise GELU variants, with vLLM's class names
and registered names.

Gated ops split the last dimension: ``d = x.shape[-1] // 2``, gate ``a = x[..., :d]``, up
``b = x[..., d:]`` (``swigluoai_and_mul`` interleaves them instead), and return
``x.shape[:-1] + (d,)``. The spec computes in the input dtype, as vLLM's native paths do;
forward_cpu's compiled kernels keep bf16/fp16 intermediates in fp32 (Inductor's rule), so they
round once instead of at every step: closer to float64, not bit-equal to eager.

The math itself (the spec) is in ``customop/math/activation.py`` and re-exported here.

One module per role: ``cpu_tiers`` (the CPU path's measured thresholds), ``base`` (input checks,
``_Activation``), ``gated`` and ``unary`` (the op classes; importing this package registers them,
gated first), ``factory`` (``get_act_fn``, ``get_act_and_mul_fn``). Every name is re-exported
here; a test that patches a module-level name patches it in the module that uses it.
"""

from customop.math.activation import (
    fatrelu_and_mul, gelu, gelu_and_mul, gelu_and_mul_sparse, gelu_fast, gelu_new, gelu_tanh, mul_and_silu,
    quick_gelu, relu2, silu_and_mul, silu_and_mul_with_clamp, situ_and_mul, swiglustep_and_mul, swigluoai_and_mul,
    swigluoai_on_halves, xielu,
)
from customop.ops.activation.cpu_tiers import (  # noqa: F401  (_low_precision_from, for tests)
    FEW_KERNELS_MIN_NUMEL, GATED_FEW_KERNELS_FP32_MIN_NUMEL, GATED_FEW_KERNELS_LOW_PRECISION_MIN_NUMEL,
    GELU_AND_MUL_LOW_PRECISION_MIN_NUMEL, MANY_KERNELS_MIN_NUMEL, NEVER_COMPILE, QUICK_GELU_MIN_NUMEL,
    RELU2_BF16_MIN_NUMEL, RELU2_FP16_MIN_NUMEL, RELU2_FP32_MIN_NUMEL, SILU_GATED_CPU_TIERS, STATS_KERNELS_MIN_NUMEL,
    TANH_GELU_CPU_TIERS, _low_precision_from,
)
from customop.ops.activation.base import (  # noqa: F401  (private names: tests and customop.warmup use them)
    _CPU_DTYPES, _KERNEL_DTYPES, _Activation, _check_input, _checked_approximate,
)
from customop.ops.activation.gated import (  # noqa: F401  (the private helpers, for tests)
    SITU_BAND_CPU_TIERS, FatreluAndMul, GeluAndMul, GeluAndMulSparse, MulAndSilu, SiluAndMul, SiluAndMulWithClamp,
    SituAndMul, SwigluOAIAndMul, SwigluStepAndMul, _LOW_PRECISION, _ROUNDING_TIERS, _SWIGLUOAI_BAND,
    _WIDTH_CLASS_SAMPLES, _deinterleave, _rounding_tiers, _width_class_samples,
    gelu_and_mul_sparse_rounded_statistics, gelu_and_mul_sparse_two_pass,
)
from customop.ops.activation.unary import GELU, XIELU, FastGELU, GELUTanh, NewGELU, QuickGELU, ReLUSquaredActivation
from customop.ops.activation.factory import (  # noqa: F401  (the shared instances, for tests)
    ACTIVATIONS, ACTIVATIONS_AND_MUL, _shared, _shared_instance, clear_shared_activations, get_act_and_mul_fn,
    get_act_fn,
)

__all__ = [
    "ACTIVATIONS",
    "ACTIVATIONS_AND_MUL",
    "FEW_KERNELS_MIN_NUMEL",
    "GATED_FEW_KERNELS_FP32_MIN_NUMEL",
    "GATED_FEW_KERNELS_LOW_PRECISION_MIN_NUMEL",
    "GELU",
    "GELUTanh",
    "GELU_AND_MUL_LOW_PRECISION_MIN_NUMEL",
    "FastGELU",
    "FatreluAndMul",
    "GeluAndMul",
    "GeluAndMulSparse",
    "MANY_KERNELS_MIN_NUMEL",
    "MulAndSilu",
    "NEVER_COMPILE",
    "NewGELU",
    "QUICK_GELU_MIN_NUMEL",
    "QuickGELU",
    "RELU2_BF16_MIN_NUMEL",
    "RELU2_FP16_MIN_NUMEL",
    "RELU2_FP32_MIN_NUMEL",
    "ReLUSquaredActivation",
    "SILU_GATED_CPU_TIERS",
    "SITU_BAND_CPU_TIERS",
    "STATS_KERNELS_MIN_NUMEL",
    "SiluAndMul",
    "SiluAndMulWithClamp",
    "SituAndMul",
    "SwigluOAIAndMul",
    "SwigluStepAndMul",
    "TANH_GELU_CPU_TIERS",
    "XIELU",
    "clear_shared_activations",
    "fatrelu_and_mul",
    "gelu",
    "gelu_and_mul",
    "gelu_and_mul_sparse",
    "gelu_and_mul_sparse_rounded_statistics",
    "gelu_and_mul_sparse_two_pass",
    "gelu_fast",
    "gelu_new",
    "gelu_tanh",
    "get_act_and_mul_fn",
    "get_act_fn",
    "mul_and_silu",
    "quick_gelu",
    "relu2",
    "silu_and_mul",
    "silu_and_mul_with_clamp",
    "situ_and_mul",
    "swiglustep_and_mul",
    "swigluoai_and_mul",
    "swigluoai_on_halves",
    "xielu",
]
