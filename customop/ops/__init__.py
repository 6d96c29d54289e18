"""The in-tree op library: one module per family, vLLM's class names and registered names.

Importing this package registers every op (``CustomOp.op_registry``) and defines the
``torch.ops.customop.*`` kernel entry points (schemas and fakes) that backends fill.
"""

from customop.ops import activation, layernorm, linear, logits_processor, quantization, rotary_embedding, vocab_parallel_embedding  # noqa: F401
from customop.ops import attention  # noqa: F401  (mm_encoder_attn)
from customop.ops import conv  # noqa: F401  (conv2d, conv3d)
from customop.ops import qwen2_decoder  # noqa: F401  (CustomQwen2Decoder)
from customop.ops import mla  # noqa: F401  (multi_head_latent_attention)
from customop.ops import moe  # noqa: F401  (mixture of experts)
from customop.ops import mamba  # noqa: F401  (state-space mixers: mamba_mixer, mamba_mixer2, short_conv)
from customop.ops import _library  # noqa: F401  (after the families: it uses their math)
