"""The conv family's case table (``conv2d``, ``conv3d``): what every tier runs, and ``customop check``.

- ``CASES``: constructor arguments and input shapes. Patch projections (kernel == stride: the
  linear form) with 14- and 16-pixel patches and Qwen2-VL's (2, 14, 14), with and without bias,
  on sizes that divide into patches and sizes that leave a remainder (dropped, as a strided
  convolution drops it); then the convolutions that are not patch projections: padding ("same",
  explicit, with a reflect ``padding_mode``), groups, a dilated kernel == stride (vLLM's rule would
  take the linear form, wrongly), kernel != stride.
- ``shapes[tier]``: ``"check"`` (``customop check``, ``assert_conforms``) and ``"small"`` (the
  paths emulated on a CPU) per case; ``REAL_CASES`` with their own shapes for the GPU tier
  (Qwen2-VL's 3x(2,14,14) -> 1280 over 4096 and 16384 patches, CLIP's 336-pixel images -> 1024).
- ``DTYPES``.

Weights are random with a ``1 / sqrt(fan_in)`` scale (outputs of order 1). The float64 references
are the tests' (``tests/cases/conv.py``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from customop.custom_op import CustomOp
from customop.ops.conv import ConvLayerBase
from customop.testing import FLOAT_DTYPES, Sample, randn, register_samples


@dataclasses.dataclass(frozen=True)
class ConvCase:
    label: str
    op: str  # "conv2d" or "conv3d"
    init: dict[str, Any]
    #: input shapes [B, C, *spatial] per tier ("check", "small"; "real" for REAL_CASES)
    shapes: dict[str, tuple[tuple[int, ...], ...]]

    @property
    def op_class(self) -> type[ConvLayerBase]:
        return CustomOp.op_registry[self.op]

    def init_kwargs(self, dtype: torch.dtype) -> dict[str, Any]:
        return {**self.init, "params_dtype": dtype}

    def weights(self, dtype: torch.dtype, device: str | torch.device = "cpu",
                generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """Random ``weight`` (and ``bias``) for the op built with ``init_kwargs``."""
        init = self.init
        n = 2 if self.op == "conv2d" else 3
        k = init["kernel_size"]
        kernel = (k,) * n if isinstance(k, int) else tuple(k)
        fan_in = init["in_channels"] // init.get("groups", 1) * math.prod(kernel)
        shape = (init["out_channels"], init["in_channels"] // init.get("groups", 1), *kernel)
        state = {"weight": randn(*shape, dtype=dtype, device=device, scale=fan_in ** -0.5, generator=generator)}
        if init.get("bias", True):
            state["bias"] = randn(init["out_channels"], dtype=dtype, device=device, scale=0.5, generator=generator)
        return state

    def build(self, dtype: torch.dtype, device: str | torch.device = "cpu", generator: torch.Generator | None = None,
              **kwargs: Any) -> ConvLayerBase:
        """The op (the caller's config decides its dispatch) with random weights loaded."""
        op = self.op_class(**self.init_kwargs(dtype), **kwargs).to(device)
        op.requires_grad_(False)  # inference, as in vLLM
        op.load_state_dict(self.weights(dtype, device, generator))
        return op

    def input(self, shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device = "cpu",
              generator: torch.Generator | None = None) -> torch.Tensor:
        return randn(*shape, dtype=dtype, device=device, generator=generator)


def _case(label: str, op: str, shapes: dict, **init: Any) -> ConvCase:
    return ConvCase(label, op, init, shapes)


CASES = (
    # patch projections: the linear form
    _case("patch14", "conv2d", {"check": ((1, 3, 28, 42),), "small": ((1, 3, 28, 28), (2, 3, 31, 45), (3, 3, 14, 14))},
          in_channels=3, out_channels=32, kernel_size=14, stride=14),
    _case("patch16 no bias", "conv2d", {"check": ((2, 3, 33, 16),), "small": ((1, 3, 48, 64), (1, 3, 35, 17))},
          in_channels=3, out_channels=24, kernel_size=16, stride=16, bias=False),
    _case("qwen2-vl (2,14,14)", "conv3d", {"check": ((7, 3, 2, 14, 14),),
                                           "small": ((1, 3, 2, 14, 14), (37, 3, 2, 14, 14), (1, 3, 5, 30, 29))},
          in_channels=3, out_channels=40, kernel_size=(2, 14, 14), stride=(2, 14, 14), bias=True),
    _case("patch (1,16,16) no bias", "conv3d", {"check": ((1, 3, 2, 32, 16),), "small": ((2, 3, 3, 33, 48),)},
          in_channels=3, out_channels=16, kernel_size=(1, 16, 16), stride=(1, 16, 16), bias=False),
    # everything else: F.conv2d / F.conv3d
    _case("k3 same", "conv2d", {"check": ((1, 4, 9, 7),), "small": ((2, 4, 16, 13),)},
          in_channels=4, out_channels=8, kernel_size=3, padding="same"),
    _case("k4 s2 p1 groups2", "conv2d", {"check": ((1, 4, 10, 9),), "small": ((2, 4, 17, 12),)},
          in_channels=4, out_channels=6, kernel_size=4, stride=2, padding=1, groups=2),
    _case("k2 s2 dilation2", "conv2d", {"check": ((1, 3, 9, 8),), "small": ((1, 3, 15, 12),)},
          in_channels=3, out_channels=5, kernel_size=2, stride=2, dilation=2),
    _case("k3 p1 reflect", "conv2d", {"check": ((1, 2, 6, 5),), "small": ((2, 2, 11, 8),)},
          in_channels=2, out_channels=4, kernel_size=3, padding=1, padding_mode="reflect"),
    _case("k3 p1", "conv3d", {"check": ((1, 3, 4, 6, 5),), "small": ((2, 3, 5, 9, 7),)},
          in_channels=3, out_channels=6, kernel_size=3, padding=1),
    _case("k(2,2,2) s(1,2,2)", "conv3d", {"check": ((1, 3, 3, 6, 6),), "small": ((1, 3, 4, 9, 8),)},
          in_channels=3, out_channels=8, kernel_size=2, stride=(1, 2, 2)),
)
BY_LABEL = {case.label: case for case in CASES}

#: the GPU tier's and the benchmarks' patch embeddings
REAL_CASES = (
    _case("qwen2-vl 3x(2,14,14)->1280", "conv3d", {"real": ((4096, 3, 2, 14, 14), (16384, 3, 2, 14, 14))},
          in_channels=3, out_channels=1280, kernel_size=(2, 14, 14), stride=(2, 14, 14), bias=False),
    _case("clip 336/14->1024", "conv2d", {"real": ((1, 3, 336, 336), (16, 3, 336, 336), (3, 3, 343, 350))},
          in_channels=3, out_channels=1024, kernel_size=14, stride=14, bias=False),
    _case("siglip 384/16->1152", "conv2d", {"real": ((8, 3, 384, 384),)},
          in_channels=3, out_channels=1152, kernel_size=16, stride=16),
)
DTYPES = FLOAT_DTYPES


def _builder(op: str):
    def build(dtype: torch.dtype, device: str, gen: torch.Generator) -> list[Sample]:
        return [Sample(case.init_kwargs(dtype), (case.input(shape, dtype, device, gen),),
                       state=case.weights(dtype, device, gen), label=f"{case.label} {'x'.join(map(str, shape))}")
                for case in CASES if case.op == op for shape in case.shapes["check"]]

    return build


for _op in ("conv2d", "conv3d"):
    register_samples(_op, DTYPES)(_builder(_op))
