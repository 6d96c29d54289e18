"""The norms family's case table: what every tier runs, and ``customop check`` too.

- ``CASES``: RMSNorm, GemmaRMSNorm, RMSNormGated, LayerNorm, NemotronLayerNorm1P and
  FusedRMSNormGated variants: constructor arguments, the weight's dtype (the input's, fp32, or no
  weight), a bias (the layer norms), the call form (``x``; ``x, residual``: the fused add;
  ``x, z``: the gate; ``x, g[, residual]`` and keyword arguments for FusedRMSNormGated) and, for
  the gated norm, how many groups a row splits into. The rows marked
  ``base`` (one per ``customop::`` norm op) are the ones whose compiled paths are checked too: each
  costs a compile per dtype.
- ``SIZES``: the inputs of each tier as ``(*leading dims, hidden)``. ``"check"``: ``customop
  check`` / ``assert_conforms``, plus ``COMPILED_CHECK`` for the base rows (above forward_cpu's
  compile threshold). ``"small"``: the paths emulated on a CPU: one row of 8, odd sizes (7 x 4231,
  33 x 100: masked tails, several rows per program) and a 3-D input. ``"tpu"``: the TPU tier
  (Pallas in interpret mode, the XLA CPU device): hidden sizes in multiples of 128 (the gated
  rows' groups of 32 and 128 lanes), one row and a 3-D input of 15 rows. ``"real"``: the GPU
  tier, up to 32768 x 8192 and rows of 65536.
- ``DTYPES``.

Weights are random (not the ones/zeros init), so a path that ignores or misplaces the weight fails.
The float64 references are the tests' (``tests/cases/layernorm.py``; ``tests/cases/__init__.py``
says why they are not shipped). A tier chooses only the path under test and one of ``SIZES``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from customop.custom_op import CustomOp
from customop.ops.layernorm import RMS_NORM_CPU_TIERS
from customop.testing import FLOAT_DTYPES, Sample, randn, register_samples

#: the inputs' standard deviation (x, residual and z)
SCALE = 2.0


@dataclasses.dataclass(frozen=True)
class NormCase:
    label: str
    op: str  # the registered op name
    init: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: the weight's dtype: "x" (the input's), "fp32", or None (no weight)
    weight: str | None = "x"
    residual: bool = False  # forward(x, residual): the fused add
    gate: bool = False  # rms_norm_gated: forward(x, z)
    #: rms_norm_gated: groups per row where the hidden size divides into them, else the whole row
    groups: int = 1
    base: bool = False
    bias: bool = False  # layer norms: a random bias (else none, or Nemotron's zeros)
    #: keyword arguments of the call (FusedRMSNormGated's prenorm, residual_in_fp32)
    call_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def op_class(self) -> type[CustomOp]:
        return CustomOp.op_registry[self.op]

    @property
    def library_op(self) -> str:
        """The ``customop::`` op that ``forward_kernel`` calls for this row."""
        if self.residual:
            return {"gemma_rms_norm": "gemma_fused_add_rms_norm", "nemotron_layer_norm": "fused_add_nemotron_layer_norm",
                    "fused_rms_norm_gated": "fused_add_rms_norm_gated"}.get(self.op, "fused_add_rms_norm")
        return self.op

    @property
    def in_place(self) -> bool:
        """The kernel paths write the output into x and the sum into residual (the fused adds of
        the RMS and Nemotron norms; FusedRMSNormGated's returns new tensors)."""
        return self.residual and self.op != "fused_rms_norm_gated"

    @property
    def offset_weight(self) -> bool:
        """The weight is stored as an offset from 1 (Gemma, Nemotron): parameters start at zeros."""
        return self.op in ("gemma_rms_norm", "nemotron_layer_norm")

    def group_size(self, hidden: int) -> int:
        return hidden // self.groups if hidden % self.groups == 0 else hidden

    def weight_dtype(self, dtype: torch.dtype) -> torch.dtype | None:
        return None if self.weight is None else (dtype if self.weight == "x" else torch.float32)

    def init_kwargs(self, hidden: int, dtype: torch.dtype) -> dict[str, Any]:
        """The constructor's arguments for inputs of ``dtype``."""
        kwargs = {"hidden_size": hidden, **self.init}
        if self.op == "rms_norm_gated":
            kwargs["group_size"] = self.group_size(hidden)
        if self.op == "layer_norm":
            kwargs["bias"] = self.bias
        if self.weight is None:
            kwargs["elementwise_affine" if self.op in ("layer_norm", "fused_rms_norm_gated") else "has_weight"] = False
        elif not self.offset_weight:  # (Gemma's and Nemotron's are fp32 parameters: build() casts them)
            kwargs["dtype"] = self.weight_dtype(dtype)
        return kwargs

    def weight_values(self, hidden: int, dtype: torch.dtype, generator: torch.Generator | None = None,
                      device: str | torch.device = "cpu") -> torch.Tensor | None:
        if self.weight is None:
            return None
        offset = 0.0 if self.offset_weight else 1.0  # Gemma and Nemotron store 1 + w as w
        w = randn(hidden, generator=generator, scale=0.5) + offset
        return w.to(device=device, dtype=self.weight_dtype(dtype))

    def bias_values(self, hidden: int, dtype: torch.dtype, generator: torch.Generator | None = None,
                    device: str | torch.device = "cpu") -> torch.Tensor | None:
        """The row's random bias (in the weight's dtype), or None where the row has none."""
        if not self.bias or self.weight is None:
            return None
        return randn(hidden, generator=generator, scale=0.5).to(device=device, dtype=self.weight_dtype(dtype))

    def build(self, hidden: int, dtype: torch.dtype, generator: torch.Generator | None = None,
              **kwargs: Any) -> CustomOp:
        """The op for inputs of ``dtype`` (the caller's config decides its dispatch), with a random
        weight of the row's dtype; ``kwargs`` go to the constructor."""
        op = self.op_class(**self.init_kwargs(hidden, dtype), **kwargs)
        op.requires_grad_(False)  # inference, as in vLLM: the in-place kernel paths have no backward
        weight = self.weight_values(hidden, dtype, generator, op.weight.device if op.weight is not None else "cpu")
        if weight is not None:
            op.weight.data = weight
        bias = self.bias_values(hidden, dtype, generator, op.weight.device if op.weight is not None else "cpu")
        if bias is not None:
            op.bias.data = bias
        elif getattr(op, "bias", None) is not None:  # Nemotron's zeros, in the weight's dtype
            op.bias.data = op.bias.data.to(op.weight.dtype)
        return op

    @property
    def arguments(self) -> tuple[str, ...]:
        """The names of the call's tensors."""
        if self.op == "fused_rms_norm_gated":
            return ("x", "g", "residual") if self.residual else ("x", "g")
        return ("x", "residual") if self.residual else ("x", "z") if self.gate else ("x",)

    def inputs(self, shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device = "cpu",
               generator: torch.Generator | None = None) -> tuple[torch.Tensor, ...]:
        """The call's tensors: ``(x,)``, ``(x, residual)``, ``(x, z)``, ``(x, g[, residual])``."""
        return tuple(randn(*shape, dtype=dtype, device=device, scale=SCALE, generator=generator)
                     for _ in self.arguments)


_GATED = "rms_norm_gated"
CASES = (
    NormCase("rms_norm", "rms_norm", base=True),
    NormCase("rms_norm[fp32 weight]", "rms_norm", weight="fp32"),
    NormCase("rms_norm[no weight]", "rms_norm", weight=None),
    NormCase("fused_add_rms_norm", "rms_norm", residual=True, base=True),
    NormCase("fused_add_rms_norm[no weight]", "rms_norm", weight=None, residual=True),
    NormCase("gemma_rms_norm", "gemma_rms_norm", weight="fp32", base=True),
    NormCase("gemma_fused_add_rms_norm", "gemma_rms_norm", weight="fp32", residual=True, base=True),
    NormCase("gemma_fused_add_rms_norm[x-dtype weight]", "gemma_rms_norm", residual=True),
    # the four gates (norm before/after, silu/sigmoid), each on grouped rows and on the odd 4231
    # (which no group count divides: whole rows); no z, where the gate arguments must be ignored.
    # The weight: the module's default fp32, and the input's dtype on the base row.
    NormCase("rms_norm_gated", _GATED, {"activation": "swish"}, gate=True, groups=4, base=True),
    NormCase("rms_norm_gated[norm first, silu]", _GATED, {"norm_before_gate": True, "activation": "silu"},
             weight="fp32", gate=True, groups=4),
    NormCase("rms_norm_gated[sigmoid]", _GATED, {"activation": "sigmoid"}, weight="fp32", gate=True, groups=4),
    NormCase("rms_norm_gated[norm first, sigmoid]", _GATED, {"norm_before_gate": True, "activation": "sigmoid"},
             weight="fp32", gate=True, groups=4),
    NormCase("rms_norm_gated[no z, norm first, sigmoid]", _GATED, {"norm_before_gate": True, "activation": "sigmoid"},
             weight="fp32", groups=4),
    # vLLM 0.33's layer norms: weight and bias in x's dtype or fp32, weight only, neither.
    NormCase("layer_norm", "layer_norm", bias=True, base=True),
    NormCase("layer_norm[fp32 weight]", "layer_norm", weight="fp32", bias=True),
    NormCase("layer_norm[no bias]", "layer_norm"),
    NormCase("layer_norm[no affine]", "layer_norm", weight=None),
    # Nemotron: the module's fp32 parameters (the base rows, which customop check can load), and
    # parameters in x's dtype (a model built under that default dtype: 1 + w rounds there)
    NormCase("nemotron_layer_norm", "nemotron_layer_norm", weight="fp32", bias=True, base=True),
    NormCase("nemotron_layer_norm[x-dtype weight]", "nemotron_layer_norm", bias=True),
    NormCase("fused_add_nemotron_layer_norm", "nemotron_layer_norm", weight="fp32", bias=True, residual=True,
             base=True),
    NormCase("fused_add_nemotron_layer_norm[x-dtype weight]", "nemotron_layer_norm", bias=True, residual=True),
    # the KDA output norm: the gate after the norm (swish, sigmoid), no weight, the fused add
    NormCase("fused_rms_norm_gated", "fused_rms_norm_gated", gate=True, base=True),
    NormCase("fused_rms_norm_gated[sigmoid, fp32 weight]", "fused_rms_norm_gated", {"activation": "sigmoid"},
             weight="fp32", gate=True),
    NormCase("fused_rms_norm_gated[no weight]", "fused_rms_norm_gated", weight=None, gate=True),
    NormCase("fused_add_rms_norm_gated[prenorm]", "fused_rms_norm_gated", gate=True, residual=True, base=True,
             call_kwargs={"prenorm": True}),
    NormCase("fused_add_rms_norm_gated[sigmoid]", "fused_rms_norm_gated", {"activation": "sigmoid"}, gate=True,
             residual=True),
)
BY_LABEL = {case.label: case for case in CASES}

#: crosses forward_cpu's compile threshold (in every dtype)
COMPILED_CHECK = ((int(RMS_NORM_CPU_TIERS.compile_from(torch.float32)) // 1024 + 3, 1024),)
SIZES: dict[str, tuple[tuple[int, ...], ...]] = {
    "check": ((1, 64), (5, 97), (2, 3, 128)),
    "small": ((1, 8), (7, 4231), (33, 100), (3, 5, 64)),
    "tpu": ((1, 128), (3, 5, 512)),
    "real": ((1, 8192), (16, 4096), (7, 4231), (33, 128), (4096, 8192), (32768, 8192), (2, 65536)),
}
DTYPES = FLOAT_DTYPES


def _builder(op: str):
    def build(dtype: torch.dtype, device: str, gen: torch.Generator) -> list[Sample]:
        samples = []
        for case in (c for c in CASES if c.op == op):
            if case.offset_weight and case.weight == "x":
                continue  # a Sample's weight is copied into Gemma's (Nemotron's) fp32 parameter: the row above
            for shape in SIZES["check"] + (COMPILED_CHECK if case.base else ()):
                weight = case.weight_values(shape[-1], dtype, gen, device)
                bias = case.bias_values(shape[-1], dtype, gen, device)
                state = {} if weight is None else {"weight": weight}
                if bias is not None:
                    state["bias"] = bias
                samples.append(Sample(case.init_kwargs(shape[-1], dtype), case.inputs(shape, dtype, device, gen),
                                      dict(case.call_kwargs), state=state, label=f"{case.label} x{shape}"))
        if op == "rms_norm":  # outside the table: forward_kernel runs the spec for these
            x = randn(3, 96, dtype=dtype, device=device, generator=gen)
            samples.append(Sample({"hidden_size": 96, "var_hidden_size": 64, "dtype": dtype}, (x,),
                                  state={"weight": randn(96, dtype=dtype, device=device, generator=gen)},
                                  label="var_hidden_size=64"))
            samples.append(Sample({"hidden_size": 96}, (x, x.flip(0)),
                                  state={"weight": randn(96, device=device, generator=gen)},
                                  label="fp32 weight+residual"))
        return samples

    return build


for _op in dict.fromkeys(case.op for case in CASES):
    register_samples(_op, DTYPES)(_builder(_op))
