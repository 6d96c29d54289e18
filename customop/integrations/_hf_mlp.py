"""The gated MLPs that replace Hugging Face's: the activation and the product become one
customop ``*_and_mul`` op, which reads ``[gate | up]`` from one tensor.

``GatedMLP`` serves the MLPs with separate ``gate_proj``/``up_proj`` (Llama, Mistral, Qwen2/3,
Gemma): ``down(act(gate(x)) * up(x))``. The fused op needs gate and up side by side, so in eager
inference the two projections write their outputs straight into the two halves of one buffer
(``mm``/``addmm`` with ``out=`` a column slice: BLAS takes the row stride as its leading
dimension, no copy). A ``torch.cat`` of the two outputs would cost more memory traffic than the
unfused activation saves; it is used only where ``out=`` cannot be: under ``torch.compile``, while
autograd records, or for ``Linear`` subclasses (quantised layers). ``FusedGateUpMLP`` serves
Phi-3, whose ``gate_up_proj`` already produces ``[gate | up]``.

Both keep the original projection modules (the same parameter objects, so the state dict is
unchanged) and run the original forward under autocast, where Hugging Face's math is the
autocast one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def _linear_into(x: torch.Tensor, linear: nn.Linear, out: torch.Tensor) -> None:
    # F.linear on a 2-D input is exactly mm (no bias) or addmm (bias): the same kernels, written
    # into the slice instead of a fresh tensor
    if linear.bias is None:
        torch.mm(x, linear.weight.t(), out=out)
    else:
        torch.addmm(linear.bias, x, linear.weight.t(), out=out)


def _plain(linear: nn.Module) -> bool:
    return type(linear) is nn.Linear


def _records_grad(x: torch.Tensor, *linears: nn.Linear) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad
                                        or any(p.requires_grad for m in linears for p in m.parameters()))


def _copy_plain_attributes(target: nn.Module, original: nn.Module) -> None:
    """Public non-module attributes (``config``, ``hidden_size``, ...) for code that reads them."""
    for key, value in vars(original).items():
        if not key.startswith("_") and key != "training" and not hasattr(target, key):
            setattr(target, key, value)


class GatedMLP(nn.Module):
    """``down_proj(act_fn([gate_proj(x) | up_proj(x)]))`` with ``act_fn`` a customop
    ``*_and_mul`` op: Hugging Face's ``down(act(gate(x)) * up(x))`` with the activation and the
    product fused."""

    def __init__(self, original: nn.Module, act_op: nn.Module) -> None:
        super().__init__()
        _copy_plain_attributes(self, original)
        self.gate_proj, self.up_proj, self.down_proj = original.gate_proj, original.up_proj, original.down_proj
        self.act_fn = act_op
        # not a submodule: the state dict and the module tree keep the original's shape
        self.__dict__["_original_forward"] = original.forward
        self._direct = _plain(self.gate_proj) and _plain(self.up_proj)

    def _gate_up(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj, self.up_proj
        if (not self._direct or torch.compiler.is_compiling() or _records_grad(x, gate, up)
                or x.dtype != gate.weight.dtype or gate.weight.dtype != up.weight.dtype):
            return torch.cat((gate(x), up(x)), dim=-1)
        inter = gate.out_features
        rows = x.reshape(-1, x.shape[-1])
        out = rows.new_empty(rows.shape[0], inter + up.out_features)
        _linear_into(rows, gate, out[:, :inter])
        _linear_into(rows, up, out[:, inter:])
        return out.view(*x.shape[:-1], out.shape[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            return self._original_forward(x)
        return self.down_proj(self.act_fn(self._gate_up(x)))


class FusedGateUpMLP(nn.Module):
    """Phi-3's MLP: ``down_proj(activation_fn(gate_up_proj(x)))`` with ``activation_fn`` a
    customop ``*_and_mul`` op (Hugging Face computes ``up * act(gate)``: the same product)."""

    def __init__(self, original: nn.Module, act_op: nn.Module) -> None:
        super().__init__()
        _copy_plain_attributes(self, original)
        self.gate_up_proj, self.down_proj = original.gate_up_proj, original.down_proj
        self.activation_fn = act_op
        self.__dict__["_original_forward"] = original.forward

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(hidden_states.device.type):
            return self._original_forward(hidden_states)
        return self.down_proj(self.activation_fn(self.gate_up_proj(hidden_states)))


#: MLP layout -> the replacement's class
MLP_CLASSES: dict[str, Callable[[nn.Module, nn.Module], nn.Module]] = {
    "split": GatedMLP, "fused": FusedGateUpMLP,
}
