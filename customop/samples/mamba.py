"""The state-space family's case table: what every tier runs, and ``customop check`` too.

- ``CASES``: the op variants (``mamba_mixer``, ``mamba_mixer2``, ``short_conv``,
  ``mixer2_gated_rms_norm``) with their constructor arguments per tier (``init``: "check" and
  "small", the paths emulated on a CPU; ``real_init``: the GPU tier, at real model sizes) and the
  SSM cache's dtype (fp32, vLLM's usual override, or the activations').
- ``BATCHES``: batch layouts per tier (``Batch``): decode requests (some of them CUDA-graph
  padding on the null slot), prefill requests of given lengths (starting from the cache or from
  zero; empty ones too), rows past the batch, and the Mamba-2 chunk size. Lengths cover one token,
  fewer tokens than the conv window, and chunk - 1, chunk and chunk + 1.
- ``NORM_SIZES``: ``(rows, hidden, groups)`` of the gated norm per tier.
- ``DTYPES``.

Weights are random (A negative, dt_bias giving steps of 0.05-0.5, norms near 1), so a path that
drops or misplaces one fails. Slots are handed out in reverse order, one spare slot is never
used, and slot 0 is the null block: a path that writes the wrong slot or touches padding shows up
in the caches. The float64 references are the tests' (``tests/cases/mamba.py``).
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any

import torch

from customop.custom_op import CustomOp
from customop.math.mamba import NULL_BLOCK_ID, MambaMetadata
from customop.ops import mamba as _ops  # noqa: F401  (registers the op classes)
from customop.testing import FLOAT_DTYPES, Sample, assert_close, randn, register_samples

DTYPES = FLOAT_DTYPES


@dataclasses.dataclass(frozen=True)
class Batch:
    label: str
    decodes: int = 0
    prefill_lens: tuple[int, ...] = ()
    has_initial_state: tuple[bool, ...] = ()
    pad_decodes: int = 0  # decode rows on the null slot (CUDA-graph padding), after the real ones
    pad_rows: int = 0  # rows past the batch's tokens
    chunk_size: int = 8

    @property
    def n_slots(self) -> int:
        """The null slot, one per request, and one spare that no request uses."""
        return 2 + self.decodes + len(self.prefill_lens)

    @property
    def tokens(self) -> int:
        return self.decodes + self.pad_decodes + sum(self.prefill_lens) + self.pad_rows

    def slots(self) -> tuple[list[int], list[int]]:
        """(decode slots, prefill slots): real requests get slots n_slots - 2 down to 1."""
        real = list(range(self.n_slots - 2, 0, -1))
        decode = real[:self.decodes] + [NULL_BLOCK_ID] * self.pad_decodes
        return decode, real[self.decodes:self.decodes + len(self.prefill_lens)]

    def metadata(self, device: str | torch.device = "cpu") -> MambaMetadata:
        decode, prefill = self.slots()
        return MambaMetadata.build(decode, self.prefill_lens, prefill, self.has_initial_state, self.chunk_size,
                                   device)


def _inv_softplus(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


@dataclasses.dataclass(frozen=True)
class MixerCase:
    label: str
    op: str  # the registered op name
    init: dict[str, Any]
    real_init: dict[str, Any] | None = None
    ssm_dtype: str = "fp32"  # "fp32" or "x": the SSM cache's dtype

    @property
    def op_class(self) -> type[CustomOp]:
        return CustomOp.op_registry[self.op]

    def init_kwargs(self, tier: str, dtype: torch.dtype) -> dict[str, Any]:
        kwargs = dict(self.real_init if tier == "real" and self.real_init else self.init)
        if self.op == "short_conv":
            kwargs = {"config": types.SimpleNamespace(conv_L_cache=kwargs.pop("L"), conv_bias=kwargs.pop("bias")),
                      "layer_idx": 0, **kwargs}
        return {**kwargs, "params_dtype": dtype}

    def build(self, tier: str, dtype: torch.dtype, generator: torch.Generator | None = None,
              device: str | torch.device = "cpu", **kwargs: Any) -> CustomOp:
        """The op for ``dtype`` activations with the case's random weights (the caller's config
        decides its dispatch); ``kwargs`` go to the constructor."""
        op = self.op_class(**self.init_kwargs(tier, dtype), **kwargs).to(device)
        with torch.no_grad():
            for name, value in self.weights(op, generator).items():
                op.get_parameter(name).copy_(value)
        return op

    def weights(self, op: CustomOp, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """Random values for every parameter of ``op``, scaled so that activations stay O(1)."""
        out = {}
        for name, p in op.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            u = torch.rand(p.shape, generator=generator)
            if name == "A":  # Mamba-1 (D, N) or Mamba-2 (H,): decay rates in [0.5, 4]
                value = -(0.5 + 3.5 * u)
            elif name == "dt_bias" or name == "dt_proj.bias":  # steps softplus(dt) of 0.05-0.5
                value = _inv_softplus(0.05 + 0.45 * u)
            elif name == "D" or "norm" in name:
                value = 1.0 + 0.3 * randn(*p.shape, generator=generator)
            elif name.startswith("conv") and leaf == "weight":
                value = randn(*p.shape, generator=generator, scale=0.5)
            elif leaf == "bias":
                value = randn(*p.shape, generator=generator, scale=0.2)
            else:  # the projections: unit gain
                value = randn(*p.shape, generator=generator, scale=1.0 / math.sqrt(p.shape[-1]))
            out[name] = value.to(p.dtype)
        return out

    def caches(self, op: CustomOp, batch: Batch, dtype: torch.dtype, generator: torch.Generator | None = None,
               device: str | torch.device = "cpu") -> tuple[torch.Tensor, ...]:
        """Random caches (every slot, so untouched slots are checkable) in vLLM's layout: the conv
        cache ``(slots, K - 1 + 1, C)`` (one column wider than needed, which must stay as it is),
        the SSM cache in the case's dtype."""
        shapes = op.get_state_shape()
        conv_shape = (shapes[0][0] + 1, *shapes[0][1:])
        conv = randn(batch.n_slots, *conv_shape, dtype=dtype, device=device, generator=generator)
        if len(shapes) == 1:
            return (conv,)
        ssm_dtype = torch.float32 if self.ssm_dtype == "fp32" else dtype
        return conv, randn(batch.n_slots, *shapes[1], dtype=ssm_dtype, device=device, generator=generator, scale=0.5)

    def inputs(self, op: CustomOp, batch: Batch, dtype: torch.dtype, generator: torch.Generator | None = None,
               device: str | torch.device = "cpu") -> tuple[Any, ...]:
        """``(hidden_states, *caches, metadata)``: a forward's arguments."""
        hidden = op.conv_dim if self.op == "short_conv" else op.hidden_size
        h = randn(batch.tokens, hidden, dtype=dtype, device=device, generator=generator)
        return (h, *self.caches(op, batch, dtype, generator, device), batch.metadata(device))


_M1 = dict(hidden_size=32, ssm_state_size=8, conv_kernel_size=4, intermediate_size=40, time_step_rank=4,
           use_conv_bias=True, use_bias=False, use_rms_norm=True)
_M2 = dict(hidden_size=32, ssm_state_size=8, conv_kernel_size=4, intermediate_size=48, use_conv_bias=True,
           use_bias=False, n_groups=2, num_heads=6, head_dim=8)
CASES = (
    # Jamba-like (dt/B/C norms), and FalconMamba-like (biases, weightless norms), and plain Mamba
    MixerCase("mamba_mixer", "mamba_mixer", _M1,
              dict(_M1, hidden_size=4096, intermediate_size=8192, ssm_state_size=16, time_step_rank=256)),
    MixerCase("mamba_mixer[bias, weightless norms, x-dtype state]", "mamba_mixer",
              dict(_M1, use_bias=True, rms_norm_has_weight=False, intermediate_size=24), ssm_dtype="x"),
    MixerCase("mamba_mixer[no norms, K=2]", "mamba_mixer", dict(_M1, use_rms_norm=False, conv_kernel_size=2)),
    # Nemotron-H-like (8 groups at real size); Mamba-2 2.7B-like (one group); no norm, no conv bias
    MixerCase("mamba_mixer2", "mamba_mixer2", _M2,
              dict(_M2, hidden_size=4096, intermediate_size=8192, ssm_state_size=128, n_groups=8, num_heads=128,
                   head_dim=64)),
    MixerCase("mamba_mixer2[1 group]", "mamba_mixer2", dict(_M2, n_groups=1),
              dict(_M2, hidden_size=2560, intermediate_size=5120, ssm_state_size=128, n_groups=1, num_heads=80,
                   head_dim=64)),
    MixerCase("mamba_mixer2[no norm, no conv bias, x-dtype state]", "mamba_mixer2",
              dict(_M2, use_rms_norm=False, use_conv_bias=False, n_groups=3, num_heads=3, head_dim=16),
              ssm_dtype="x"),
    MixerCase("short_conv", "short_conv", dict(dim=24, L=3, bias=True), dict(dim=2048, L=3, bias=False)),
    MixerCase("short_conv[no bias, K=4]", "short_conv", dict(dim=19, L=4, bias=False)),
)
BY_LABEL = {case.label: case for case in CASES}

BATCHES: dict[str, tuple[Batch, ...]] = {
    "check": (Batch("mixed", decodes=2, prefill_lens=(5, 2), has_initial_state=(True, False), pad_decodes=1,
                    pad_rows=2, chunk_size=4),),
    "small": (
        Batch("decode", decodes=3, pad_decodes=2),
        # a one-token prompt, one shorter than the conv window, chunk - 1, chunk + 1, an empty one
        Batch("prefill", prefill_lens=(1, 2, 7, 0, 9), has_initial_state=(False, True, False, True, True)),
        Batch("mixed", decodes=2, prefill_lens=(8, 3), has_initial_state=(True, False), pad_decodes=1, pad_rows=3),
    ),
    "real": (
        Batch("decode 64", decodes=64, chunk_size=256),
        Batch("decode 256 (+2 padding)", decodes=254, pad_decodes=2, chunk_size=256),
        Batch("prefill 1x4096", prefill_lens=(4096,), has_initial_state=(False,), chunk_size=256),
        Batch("prefill 8x512 mixed", decodes=16, prefill_lens=(512, 255, 257, 1, 700, 512, 300, 559),
              has_initial_state=(False, True) * 4, chunk_size=256),
    ),
}

#: (rows, hidden, groups) of Mixer2RMSNormGated per tier (hidden / groups lanes per group)
NORM_SIZES = {
    "check": ((1, 64, 1), (5, 96, 4)),
    "small": ((1, 8, 1), (7, 4232, 8), (33, 100, 1), (3, 96, 4)),
    "real": ((1, 8192, 1), (16, 8192, 8), (4096, 8192, 8), (32768, 5120, 1), (7, 4232, 8)),
}


@dataclasses.dataclass(frozen=True)
class NormCase:
    label: str
    use_rms_norm: bool = True
    weight: str = "x"  # the weight's dtype: "x" (the activations') or "fp32"

    def build(self, hidden: int, groups: int, dtype: torch.dtype, generator: torch.Generator | None = None,
              device: str | torch.device = "cpu", **kwargs: Any) -> CustomOp:
        op = CustomOp.op_registry["mixer2_gated_rms_norm"](hidden, groups, self.use_rms_norm, eps=1e-5,
                                                           params_dtype=self.weight_dtype(dtype), **kwargs).to(device)
        if op.weight is not None:
            with torch.no_grad():
                op.weight.copy_(self.weight_values(hidden, dtype, generator, device))
        return op

    def weight_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype if self.weight == "x" else torch.float32

    def weight_values(self, hidden, dtype, generator=None, device="cpu") -> torch.Tensor:
        w = 1.0 + 0.5 * randn(hidden, generator=generator)
        return w.to(device=device, dtype=self.weight_dtype(dtype))

    def inputs(self, rows: int, hidden: int, dtype: torch.dtype, generator: torch.Generator | None = None,
               device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(randn(rows, hidden, dtype=dtype, device=device, generator=generator, scale=2.0)
                     for _ in range(2))


NORM_CASES = (NormCase("mixer2_gated_rms_norm"), NormCase("mixer2_gated_rms_norm[fp32 weight]", weight="fp32"),
              NormCase("mixer2_gated_rms_norm[no norm]", use_rms_norm=False))


#: (atol relative to the output's scale, rtol) of a mixer's output: about two ulps of the dtype.
#: The paths round the same steps but sum in other orders, and a one-ulp difference early in the
#: layer passes through the scan and the output projection, so the absolute part follows the
#: output's scale. Measured against tests/cases/mamba.py: every path stays within half an ulp.
MIXER_TOLERANCE = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 4e-3), torch.bfloat16: (1.6e-2, 3e-2),
                   torch.float64: (1e-10, 1e-10)}


def mixer_compare(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """A mixer's output against another path's, under ``MIXER_TOLERANCE``."""
    scale = float(want.double().abs().max()) if want.numel() else 1.0
    atol, rtol = MIXER_TOLERANCE[dtype]
    assert_close(got, want, dtype, atol=atol * max(scale, 1.0), rtol=rtol)


def _mixer_builder(op: str):
    def build(dtype: torch.dtype, device: str, gen: torch.Generator) -> list[Sample]:
        samples = []
        for case in (c for c in CASES if c.op == op):
            template = case.build("check", dtype, gen)
            for batch in BATCHES["check"]:
                samples.append(Sample(case.init_kwargs("check", dtype), case.inputs(template, batch, dtype, gen, device),
                                      state=case.weights(template, gen), compare=mixer_compare,
                                      label=f"{case.label} {batch.label}"))
        return samples

    return build


def _norm_builder(dtype: torch.dtype, device: str, gen: torch.Generator) -> list[Sample]:
    samples = []
    for case in NORM_CASES:
        for rows, hidden, groups in NORM_SIZES["check"]:
            state = {} if not case.use_rms_norm else {"weight": case.weight_values(hidden, dtype, gen, device)}
            samples.append(Sample({"full_hidden_size": hidden, "full_n_groups": groups, "use_rms_norm": case.use_rms_norm,
                                   "eps": 1e-5, "params_dtype": case.weight_dtype(dtype)},
                                  case.inputs(rows, hidden, dtype, gen, device), state=state,
                                  label=f"{case.label} {rows}x{hidden}/{groups}"))
    return samples


for _op in ("mamba_mixer", "mamba_mixer2", "short_conv"):
    register_samples(_op, DTYPES)(_mixer_builder(_op))
register_samples("mixer2_gated_rms_norm", DTYPES)(_norm_builder)
