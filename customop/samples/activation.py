"""The activation family's case table: what every tier runs, and ``customop check`` too.

- ``CASES``: every op variant with its constructor arguments; a label is the variant's test id.
- ``SIZES``: the inputs of each tier as ``(*leading dims, output width)`` (a gated op takes twice
  the width). ``"check"``: ``customop check`` and ``assert_conforms`` (tiny: a run checks every
  op in every dtype). ``"small"``: the paths emulated on a CPU (native, CPU, the Triton
  interpreter): one row, odd sizes (7 rows of 4231 lanes, 33 of 100: masked tails, several rows per
  program) and a 3-D input. ``"tpu"``: the TPU tier (Pallas in interpret mode, the XLA CPU
  device): lane counts in multiples of 128, one row and a 3-D input of 15 rows. ``"real"``: the
  GPU tier, up to 32768 tokens; the gated ops at Llama-3-8B's intermediate size 14336, the
  elementwise ones at hidden sizes.
- ``DTYPES``: every dtype the ops take.

The table ships with the library so that ``customop check`` and a vendor's ``assert_conforms``
run the variants the project's own tests run. The float64 references that judge them are the
tests' (``tests/cases/activation.py`` says why they are kept out of the library). A tier chooses
only the path under test and one of ``SIZES``; a new op is one row here and one reference there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from customop.custom_op import CustomOp
from customop.ops import activation as _ops  # noqa: F401  (registers the op classes)
from customop.testing import FLOAT_DTYPES, Sample, randn, register_samples


@dataclasses.dataclass(frozen=True)
class ActivationCase:
    label: str
    #: the registered op name: also the name of its ``customop::`` op and of its Triton launcher
    op: str
    init: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: the inputs' standard deviation (4: past the clamp limit of the swiglu variants)
    scale: float = 1.0

    @property
    def op_class(self) -> type[CustomOp]:
        return CustomOp.op_registry[self.op]

    @property
    def gated(self) -> bool:
        return self.op_class.gated

    def build(self, **kwargs: Any) -> CustomOp:
        """The op (the caller's config decides its dispatch); ``kwargs`` go to ``CustomOp``."""
        return self.op_class(**self.init, **kwargs)

    def shapes(self, size: str) -> tuple[tuple[int, ...], ...]:
        """The input shapes of ``SIZES[size]`` for this op."""
        sizes = SIZES[size]
        if isinstance(sizes, dict):
            sizes = sizes["gated" if self.gated else "elementwise"]
        return tuple((*s[:-1], 2 * s[-1] if self.gated else s[-1]) for s in sizes)

    def input(self, shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device = "cpu",
              generator: torch.Generator | None = None) -> torch.Tensor:
        return randn(*shape, dtype=dtype, device=device, scale=self.scale, generator=generator)


CASES = (
    ActivationCase("silu_and_mul", "silu_and_mul"),
    ActivationCase("mul_and_silu", "mul_and_silu"),
    ActivationCase("gelu_and_mul[none]", "gelu_and_mul", {"approximate": "none"}),
    ActivationCase("gelu_and_mul[tanh]", "gelu_and_mul", {"approximate": "tanh"}),
    # p = 0.95: a positive std multiplier (cutoff above the row mean); p = 0.3: a negative one
    ActivationCase("gelu_and_mul_sparse[0.95]", "gelu_and_mul_sparse", {"activation_sparsity": 0.95}),
    ActivationCase("gelu_and_mul_sparse[0.3,tanh]", "gelu_and_mul_sparse",
                   {"activation_sparsity": 0.3, "approximate": "tanh"}),
    ActivationCase("fatrelu_and_mul", "fatrelu_and_mul", {"threshold": 0.25}),
    ActivationCase("swigluoai_and_mul", "swigluoai_and_mul", scale=4.0),
    ActivationCase("swiglustep_and_mul", "swiglustep_and_mul", scale=4.0),
    ActivationCase("silu_and_mul_with_clamp", "silu_and_mul_with_clamp", {"swiglu_limit": 7.0}, scale=4.0),
    # MiniMax-M3's arguments: swigluoai's formula on halves
    ActivationCase("silu_and_mul_with_clamp[1.702,1]", "silu_and_mul_with_clamp",
                   {"swiglu_limit": 7.0, "alpha": 1.702, "beta": 1.0}, scale=4.0),
    ActivationCase("situ_and_mul", "situ_and_mul"),
    # Kimi K3's arguments; scale 4: where linear_beta's tanh bends the up half
    ActivationCase("situ_and_mul[4,25]", "situ_and_mul", {"beta": 4.0, "linear_beta": 25.0}, scale=4.0),
    ActivationCase("gelu", "gelu"),
    ActivationCase("gelu_tanh", "gelu_tanh"),
    ActivationCase("gelu_new", "gelu_new"),
    ActivationCase("gelu_fast", "gelu_fast"),
    ActivationCase("quick_gelu", "quick_gelu"),
    ActivationCase("relu2", "relu2"),
    # not the init values (0.8, 0.8, 0.5): a path that ignores a parameter fails
    ActivationCase("xielu", "xielu", {"alpha_p_init": 0.8, "alpha_n_init": 1.3, "beta": 0.25}),
)
BY_LABEL = {case.label: case for case in CASES}

SIZES: dict[str, Any] = {
    "check": ((1, 1), (7, 173), (2, 3, 64)),
    "small": ((1, 1), (7, 4231), (33, 100), (3, 5, 64)),
    "tpu": ((1, 128), (3, 5, 384)),
    "real": {"elementwise": ((1, 4096), (16, 8192), (7, 4231), (4096, 8192), (32768, 8192)),
             "gated": ((1, 14336), (16, 14336), (7, 4231), (4096, 14336), (32768, 14336))},
}
DTYPES = FLOAT_DTYPES


def _builder(cases: list[ActivationCase]):
    def build(dtype: torch.dtype, device: str, gen: torch.Generator) -> list[Sample]:
        return [Sample(dict(case.init), (case.input(shape, dtype, device, gen),),
                       label=f"{case.label} {'x'.join(map(str, shape))}")
                for case in cases for shape in case.shapes("check")]

    return build


for _op in dict.fromkeys(case.op for case in CASES):
    register_samples(_op, DTYPES)(_builder([case for case in CASES if case.op == _op]))
