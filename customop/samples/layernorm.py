"""Sample inputs for the norms family (``assert_conforms`` and ``customop check``).

Weights are random (not the ones/zeros init) so that a path which ignores or misplaces the weight
fails. Shapes: a single token, odd sizes, and one 3-D input; all small enough to run eagerly in
``forward_cpu`` except the last, which crosses the compile thresholds to cover the compiled path.
"""

from __future__ import annotations

import torch

from customop.ops.layernorm import RMS_NORM_CPU_TIERS
from customop.testing import Sample, randn, register_samples

#: (leading dims, hidden)
_SHAPES = (((1,), 64), ((5,), 97), ((2, 3), 128))
_LARGE = ((int(RMS_NORM_CPU_TIERS.compile_from(torch.float32)) // 1024 + 3,), 1024)


def _rand(shape, dtype, device, gen) -> torch.Tensor:
    return randn(*shape, dtype=dtype, device=device, generator=gen)


@register_samples("rms_norm")
def rms_norm_samples(dtype: torch.dtype, device: str, gen: torch.Generator) -> list[Sample]:
    samples = []
    for lead, h in (*_SHAPES, _LARGE):
        x, residual = _rand((*lead, h), dtype, device, gen), _rand((*lead, h), dtype, device, gen)
        state = {"weight": _rand((h,), dtype, device, gen)}
        init = {"hidden_size": h, "dtype": dtype}
        samples.append(Sample(init, (x,), state=state, label=f"x{tuple(x.shape)}"))
        samples.append(Sample(init, (x, residual), state=state, label=f"x{tuple(x.shape)}+residual"))
    x = _rand((3, 96), dtype, device, gen)
    samples.append(Sample({"hidden_size": 96, "var_hidden_size": 64, "dtype": dtype}, (x,),
                          state={"weight": _rand((96,), dtype, device, gen)}, label="var_hidden_size=64"))
    samples.append(Sample({"hidden_size": 96, "has_weight": False}, (x, x.flip(0)), label="has_weight=False+residual"))
    samples.append(Sample({"hidden_size": 96}, (x, x.flip(0)), state={"weight": _rand((96,), torch.float32, device, gen)},
                          label="fp32 weight+residual"))
    return samples


@register_samples("gemma_rms_norm")
def gemma_rms_norm_samples(dtype: torch.dtype, device: str, gen: torch.Generator) -> list[Sample]:
    samples = []
    for lead, h in (*_SHAPES, _LARGE):
        x, residual = _rand((*lead, h), dtype, device, gen), _rand((*lead, h), dtype, device, gen)
        state = {"weight": _rand((h,), torch.float32, device, gen) * 0.5}  # offsets around 0
        samples.append(Sample({"hidden_size": h}, (x,), state=state, label=f"x{tuple(x.shape)}"))
        samples.append(Sample({"hidden_size": h}, (x, residual), state=state, label=f"x{tuple(x.shape)}+residual"))
    return samples


@register_samples("rms_norm_gated")
def rms_norm_gated_samples(dtype: torch.dtype, device: str, gen: torch.Generator) -> list[Sample]:
    samples = []
    variants = (
        {"group_size": None, "norm_before_gate": False, "activation": "swish"},
        {"group_size": 32, "norm_before_gate": True, "activation": "sigmoid"},
        {"group_size": 16, "norm_before_gate": False, "activation": "silu"},
        {"group_size": 128, "norm_before_gate": False, "activation": "swish"},
    )
    shapes = [(*lead, 128) for lead, _ in _SHAPES] + [(*_LARGE[0], _LARGE[1])]  # hidden divisible by each group
    for shape, variant in zip(shapes, variants):
        h = shape[-1]
        x, z = _rand(shape, dtype, device, gen), _rand(shape, dtype, device, gen)
        init = {"hidden_size": h, "dtype": dtype, **variant}
        state = {"weight": _rand((h,), dtype, device, gen)}
        label = f"x{tuple(shape)} group={variant['group_size']} {variant['activation']}" + (
            " norm-then-gate" if variant["norm_before_gate"] else "")
        samples.append(Sample(init, (x, z), state=state, label=label))
        samples.append(Sample(init, (x,), state=state, label=f"{label} no z"))
    return samples
