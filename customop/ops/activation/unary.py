"""The elementwise activations as CustomOps: the GELU family (erf, tanh, GPT-2's, fast, quick),
``relu2`` and xIELU (trainable ``alpha_p``/``alpha_n``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from customop.backends.cpu import CpuTiers, eager, for_this_cpu
from customop.custom_op import CustomOp
from customop.math.activation import gelu, gelu_fast, gelu_new, gelu_tanh, quick_gelu, relu2, xielu
from customop.ops.activation.base import _Activation
from customop.ops.activation.cpu_tiers import (
    NEVER_COMPILE, QUICK_GELU_MIN_NUMEL, RELU2_BF16_MIN_NUMEL, RELU2_FP16_MIN_NUMEL, RELU2_FP32_MIN_NUMEL,
    STATS_KERNELS_MIN_NUMEL, TANH_GELU_CPU_TIERS,
)


@CustomOp.register("gelu")
class GELU(_Activation):
    """The erf GELU as a CustomOp (vLLM 0.33's ``GELU``), elementwise; what ``get_act_fn("gelu")``
    returns."""

    math_fn = staticmethod(gelu)
    cpu_tiers = CpuTiers(NEVER_COMPILE)


@CustomOp.register("gelu_tanh")
class GELUTanh(_Activation):
    """The tanh GELU as a CustomOp (vLLM 0.33's ``GELUTanh``), elementwise. ``get_act_fn
    ("gelu_pytorch_tanh")`` keeps returning ``nn.GELU(approximate="tanh")``, as vLLM does off ARM
    CPUs."""

    math_fn = staticmethod(gelu_tanh)
    #: ATen's fused tanh-GELU kernel; on AVX2 CPUs (AMD EPYC) the compiled code (without Dynamo)
    #: ties it at 64 x 8192 and is 1.4-6% faster from 128 x 8192 (1M elements), where the eager
    #: tier ran at 0.95-0.99x torch.compile (2 threads, best of 7; BENCHMARKS.md, "issue 18, CPU,
    #: twelfth day"); below, eager is 1.1-1.9x compiled
    cpu_tiers = for_this_cpu(CpuTiers(NEVER_COMPILE), AVX2=CpuTiers(1 << 20, standalone=True))


@CustomOp.register("gelu_new")
class NewGELU(_Activation):
    """GPT-2's tanh GELU, elementwise."""

    math_fn = staticmethod(gelu_new)
    eager_fn = staticmethod(eager.gelu_new)
    cpu_tiers = TANH_GELU_CPU_TIERS


@CustomOp.register("gelu_fast")
class FastGELU(_Activation):
    """The tanh GELU with the constant inlined, elementwise."""

    math_fn = staticmethod(gelu_fast)
    eager_fn = staticmethod(eager.gelu_fast)
    cpu_tiers = TANH_GELU_CPU_TIERS


@CustomOp.register("quick_gelu")
class QuickGELU(_Activation):
    """``x * sigmoid(1.702 x)``, elementwise."""

    math_fn = staticmethod(quick_gelu)
    eager_fn = staticmethod(eager.quick_gelu)
    cpu_tiers = CpuTiers(QUICK_GELU_MIN_NUMEL, standalone=True)


@CustomOp.register("relu2")
class ReLUSquaredActivation(_Activation):
    """``relu(x)^2`` (arXiv 2109.08668). Compiles its native path when disabled."""

    math_fn = staticmethod(relu2)
    eager_fn = staticmethod(eager.relu2)
    compile_native_default = True
    cpu_tiers = CpuTiers(RELU2_FP32_MIN_NUMEL, by_dtype={torch.bfloat16: RELU2_BF16_MIN_NUMEL,
                                                         torch.float16: RELU2_FP16_MIN_NUMEL}, standalone=True)


@CustomOp.register("xielu")
class XIELU(_Activation):
    """xIELU with trainable ``alpha_p``/``alpha_n`` stored in inverse-softplus form, so that
    ``softplus(alpha_p) == alpha_p_init`` and ``beta + softplus(alpha_n) == alpha_n_init`` (up to
    the rounding of ``dtype``, bf16 by default as in vLLM). ``beta`` and ``eps`` are buffers of
    ``dtype`` too; the op uses their rounded values."""

    math_fn = staticmethod(xielu)
    cpu_tiers = CpuTiers(STATS_KERNELS_MIN_NUMEL, standalone=True)

    def __init__(self, alpha_p_init: float = 0.8, alpha_n_init: float = 0.8, beta: float = 0.5,
                 eps: float = -1e-6, dtype: torch.dtype = torch.bfloat16,
                 with_vector_loads: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)

        def inverse_softplus(value: float) -> torch.Tensor:  # log(exp(v) - 1), in dtype like vLLM
            return torch.log(torch.exp(torch.tensor(value, dtype=dtype)) - 1).unsqueeze(0)

        self.alpha_p = nn.Parameter(inverse_softplus(alpha_p_init))
        self.alpha_n = nn.Parameter(inverse_softplus(alpha_n_init - beta))
        self.register_buffer("beta", torch.tensor(beta, dtype=dtype))
        self.register_buffer("eps", torch.tensor(eps, dtype=dtype))
        self.with_vector_loads = with_vector_loads  # vLLM's CUDA-extension flag; no effect here
        self._read_scalars()

    def _read_scalars(self) -> None:
        # beta and eps reach the kernel as host floats, read here rather than per call (a sync)
        self._beta, self._eps = float(self.beta), float(self.eps)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._read_scalars()  # a checkpoint may carry its own beta/eps buffers

    def math_args(self) -> tuple[Any, ...]:
        return (F.softplus(self.alpha_p), self.beta + F.softplus(self.alpha_n), self._beta, self._eps)

    def forward_kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self.alpha_p.device != x.device:
            raise ValueError(f"customop xielu: x is on {x.device} but the parameters are on "
                             f"{self.alpha_p.device}; move the module with .to(x.device)")
        return super().forward_kernel(x)
