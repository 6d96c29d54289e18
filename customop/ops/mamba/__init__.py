"""The state-space family (vLLM 0.33's names): ``MambaMixer`` (mamba_mixer), ``MambaMixer2``
(mamba_mixer2), ``Mixer2RMSNormGated`` (mixer2_gated_rms_norm), ``ShortConv`` (short_conv), and
``MambaMetadata``, the batch description their forwards take. The math is
``customop/math/mamba.py``; docs/mamba.md says how to lay out the caches and the batch.
"""

from customop.math.mamba import NULL_BLOCK_ID, PAD_SLOT_ID, MambaMetadata
from customop.ops.mamba.mixer import MambaMixer
from customop.ops.mamba.mixer2 import MambaMixer2, Mixer2RMSNormGated
from customop.ops.mamba.short_conv import ShortConv

__all__ = ["NULL_BLOCK_ID", "PAD_SLOT_ID", "MambaMetadata", "MambaMixer", "MambaMixer2", "Mixer2RMSNormGated",
           "ShortConv"]
