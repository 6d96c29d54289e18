"""``torch.ops.customop.*`` entry points of the activation family: schemas, reference bodies, fakes.

Torch-only. Each body is the pure function from ``customop.ops.activation`` (so the op runs on any
device until a backend registers a kernel with ``torch.library.register_kernel``). Contract for
kernels: outputs are new, contiguous tensors of ``x``'s dtype and device; ``x`` is not mutated.
The gated ops return ``x.shape[:-1] + (x.shape[-1] // 2,)``, the elementwise ones ``x.shape``.
The schemas are fixed: backends are written against them.
"""

from __future__ import annotations

import torch

from customop.ops import activation as act


#: the gated (``*_and_mul``) ops, in definition order: backends that serve every gated op the same
#: way read this instead of keeping their own list (the TPU backend does)
GATED: list[str] = []


def _define(name: str, schema: str, reference, gated: bool) -> None:
    """Defines ``customop::<name>`` with ``reference`` as its body and a shape-only fake."""
    if gated:
        GATED.append(name)

    def body(x: torch.Tensor, *args):
        return reference(x, *args).contiguous()

    def fake(x: torch.Tensor, *args):
        shape = (*x.shape[:-1], x.shape[-1] // 2) if gated else x.shape
        return x.new_empty(shape)

    op = torch.library.custom_op(f"customop::{name}", body, mutates_args=(), schema=schema)
    op.register_fake(fake)


_define("silu_and_mul", "(Tensor x) -> Tensor", act.silu_and_mul, gated=True)
_define("mul_and_silu", "(Tensor x) -> Tensor", act.mul_and_silu, gated=True)
_define("gelu_and_mul", "(Tensor x, str approximate) -> Tensor", act.gelu_and_mul, gated=True)
_define("gelu_and_mul_sparse", "(Tensor x, float std_multiplier, str approximate) -> Tensor",
        act.gelu_and_mul_sparse, gated=True)
_define("fatrelu_and_mul", "(Tensor x, float threshold) -> Tensor", act.fatrelu_and_mul, gated=True)
_define("swigluoai_and_mul", "(Tensor x, float alpha, float limit) -> Tensor", act.swigluoai_and_mul, gated=True)
_define("swiglustep_and_mul", "(Tensor x, float limit) -> Tensor", act.swiglustep_and_mul, gated=True)
_define("silu_and_mul_with_clamp", "(Tensor x, float swiglu_limit, float alpha, float beta) -> Tensor",
        act.silu_and_mul_with_clamp, gated=True)
# linear_beta None: the up half is used as it is
_define("situ_and_mul", "(Tensor x, float beta, float? linear_beta) -> Tensor", act.situ_and_mul, gated=True)
_define("gelu", "(Tensor x) -> Tensor", act.gelu, gated=False)
_define("gelu_tanh", "(Tensor x) -> Tensor", act.gelu_tanh, gated=False)
_define("gelu_new", "(Tensor x) -> Tensor", act.gelu_new, gated=False)
_define("gelu_fast", "(Tensor x) -> Tensor", act.gelu_fast, gated=False)
_define("quick_gelu", "(Tensor x) -> Tensor", act.quick_gelu, gated=False)
_define("relu2", "(Tensor x) -> Tensor", act.relu2, gated=False)
# alpha_p = softplus(p) and alpha_n = beta + softplus(n), as 1-element tensors (no host sync).
_define("xielu", "(Tensor x, Tensor alpha_p, Tensor alpha_n, float beta, float eps) -> Tensor",
        act.xielu, gated=False)
