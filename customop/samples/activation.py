"""Random-input builders for the activation ops (``assert_conforms``, ``customop check``).

Small shapes: one row, an odd token count with a non-power-of-two width, and a 3-D input.
"""

from __future__ import annotations

import torch

from customop.testing import Sample, randn, register_samples

#: (leading dims, width of the *output*); gated ops get twice the width as input.
_SHAPES = (((1,), 1), ((7,), 173), ((2, 3), 64))


def _inputs(dtype: torch.dtype, device: str, gen: torch.Generator, gated: bool, scale: float = 1.0):
    for lead, width in _SHAPES:
        shape = (*lead, 2 * width if gated else width)
        label = "x".join(map(str, shape))
        yield label, randn(*shape, dtype=dtype, device=device, scale=scale, generator=gen)


def _simple(op: str, gated: bool, init_kwargs: dict | None = None, scale: float = 1.0) -> None:
    def build(dtype: torch.dtype, device: str, gen: torch.Generator) -> list[Sample]:
        return [Sample(dict(init_kwargs or {}), (x,), label=label)
                for label, x in _inputs(dtype, device, gen, gated, scale)]

    register_samples(op)(build)


_simple("silu_and_mul", gated=True)
_simple("mul_and_silu", gated=True)
_simple("gelu_new", gated=False)
_simple("gelu_fast", gated=False)
_simple("quick_gelu", gated=False)
_simple("relu2", gated=False)
# scale 4: values past +-limit so that the clamps are exercised
_simple("swigluoai_and_mul", gated=True, scale=4.0)


@register_samples("gelu_and_mul")
def _gelu_and_mul(dtype: torch.dtype, device: str, gen: torch.Generator) -> list[Sample]:
    return [Sample({"approximate": approx}, (x,), label=f"{approx} {label}")
            for approx in ("none", "tanh") for label, x in _inputs(dtype, device, gen, gated=True)]


@register_samples("gelu_and_mul_sparse")
def _gelu_and_mul_sparse(dtype: torch.dtype, device: str, gen: torch.Generator) -> list[Sample]:
    return [Sample({"activation_sparsity": p, "approximate": approx}, (x,),
                   label=f"p={p} {approx} {label}")
            for p, approx in ((0.95, "none"), (0.5, "tanh"))
            for label, x in _inputs(dtype, device, gen, gated=True)]


@register_samples("fatrelu_and_mul")
def _fatrelu_and_mul(dtype: torch.dtype, device: str, gen: torch.Generator) -> list[Sample]:
    return [Sample({"threshold": t}, (x,), label=f"threshold={t} {label}")
            for t in (0.0, 0.5) for label, x in _inputs(dtype, device, gen, gated=True)]


@register_samples("xielu")
def _xielu(dtype: torch.dtype, device: str, gen: torch.Generator) -> list[Sample]:
    samples = []
    for label, x in _inputs(dtype, device, gen, gated=False):
        # trained-looking parameters (bf16, like the module's own) instead of the init values
        state = {"alpha_p": randn(1, generator=gen).to(torch.bfloat16),
                 "alpha_n": randn(1, generator=gen).to(torch.bfloat16)}
        samples.append(Sample({}, (x,), state=state, label=label))
    return samples
