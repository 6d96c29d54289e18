"""Norms: RMSNorm (+ fused residual add), GemmaRMSNorm, RMSNormGated, LayerNorm,
NemotronLayerNorm1P (+ fused residual add) and FusedRMSNormGated (+ fused residual add).

The math (``customop/math/layernorm.py``, re-exported here) follows vLLM's, rounding order
included, because checkpoints are trained against it.

In-place contract (fused residual add): the kernel paths (``forward_cuda``/``forward_hip``/
``forward_xpu``/``forward_tpu``) write the normalised output into ``x`` and the new residual into ``residual`` and
return those two tensors; ``forward_native`` and ``forward_cpu`` return new tensors and leave the
inputs alone. Either may happen, so **callers must use the returned tensors**.

One module per role: ``checks`` (input checks and the helpers every op shares), ``cpu_tiers`` (the
CPU path's measured thresholds), ``rms`` (RMSNorm, GemmaRMSNorm, RMSNormGated), ``layer``
(LayerNorm, NemotronLayerNorm1P) and ``fused_gated`` (FusedRMSNormGated); importing this package
registers the ops in that order. Every name is re-exported here; a test that patches a
module-level name patches it in the module that uses it.
"""

from customop.math.layernorm import (  # noqa: F401  (the spec, re-exported here)
    fused_add_nemotron_layer_norm, fused_add_rms_norm, fused_add_rms_norm_gated, fused_rms_norm_gated,
    gemma_fused_add_rms_norm, gemma_rms_norm, layer_norm, nemotron_layer_norm, rms_norm, rms_norm_gated,
)
from customop.ops.layernorm.checks import (  # noqa: F401  (private names: tests use them)
    _autograd_records, _check_affine, _check_float, _check_like, _check_norm_inputs, _last_dim_contiguous,
    _norm_inputs_pass, _weight,
)
from customop.ops.layernorm.cpu_tiers import (  # noqa: F401  (_NORM_THRESHOLDS, as before)
    FUSED_ADD_LAYER_NORM_CPU_TIERS, FUSED_RMS_NORM_GATED_CPU_TIERS, GEMMA_RMS_NORM_CPU_TIERS, LAYER_NORM_CPU_TIERS,
    NORM_CPU_TIERS, RMS_NORM_CPU_TIERS, RMS_NORM_GATED_CPU_TIERS, _NORM_THRESHOLDS,
)
from customop.ops.layernorm.rms import _GATE_ACTIVATIONS, GemmaRMSNorm, RMSNorm, RMSNormGated  # noqa: F401
from customop.ops.layernorm.layer import LayerNorm, NemotronLayerNorm1P, _autocast_dtype  # noqa: F401
from customop.ops.layernorm.fused_gated import FusedRMSNormGated

__all__ = [
    "FUSED_ADD_LAYER_NORM_CPU_TIERS",
    "FUSED_RMS_NORM_GATED_CPU_TIERS",
    "FusedRMSNormGated",
    "GEMMA_RMS_NORM_CPU_TIERS",
    "GemmaRMSNorm",
    "LAYER_NORM_CPU_TIERS",
    "LayerNorm",
    "NORM_CPU_TIERS",
    "NemotronLayerNorm1P",
    "RMSNorm",
    "RMSNormGated",
    "RMS_NORM_CPU_TIERS",
    "RMS_NORM_GATED_CPU_TIERS",
    "fused_add_nemotron_layer_norm",
    "fused_add_rms_norm",
    "fused_add_rms_norm_gated",
    "fused_rms_norm_gated",
    "gemma_fused_add_rms_norm",
    "gemma_rms_norm",
    "layer_norm",
    "nemotron_layer_norm",
    "rms_norm",
    "rms_norm_gated",
]
