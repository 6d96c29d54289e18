"""``get_act_fn`` and ``get_act_and_mul_fn``: a model config's activation name -> one shared
module per name (``ACTIVATIONS``, ``ACTIVATIONS_AND_MUL``), and ``clear_shared_activations``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from customop.ops.activation.gated import GeluAndMul, SiluAndMul, SwigluOAIAndMul
from customop.ops.activation.unary import XIELU, FastGELU, GELU, NewGELU, QuickGELU, ReLUSquaredActivation

# ---- factories: one shared instance per name, built on first use (vLLM's LazyDict) ------------

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "gelu": GELU,
    "gelu_fast": FastGELU,
    "gelu_new": NewGELU,
    "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
    "relu": nn.ReLU,
    "relu2": ReLUSquaredActivation,
    "silu": nn.SiLU,
    "quick_gelu": QuickGELU,
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
    "xielu": XIELU,
}
ACTIVATIONS_AND_MUL: dict[str, Callable[..., nn.Module]] = {
    "gelu": GeluAndMul,
    "geglu": GeluAndMul,
    "silu": SiluAndMul,
    "swigluoai": SwigluOAIAndMul,
}
#: (registry, name) -> module. Every layer asking for "silu" gets the same module, dispatched
#: under the config current when it was first asked for.
_shared: dict[tuple[int, str], nn.Module] = {}


def _shared_instance(factories: dict[str, Callable[..., nn.Module]], name: str) -> nn.Module:
    key = (id(factories), name)
    if key not in _shared:
        _shared[key] = factories[name]()
    return _shared[key]


def clear_shared_activations() -> None:
    """Forgets the shared instances (tests, or after changing the config)."""
    _shared.clear()


def get_act_fn(act_fn_name: str) -> nn.Module:
    """The shared activation module for a model config's name (case-insensitive). A
    ``torch.nn.modules.<...>.<Name>`` path maps to ``<name>``; its ``Identity`` is a new module."""
    name = act_fn_name.lower()
    if name.startswith("torch.nn.modules."):
        name = name.rsplit(".", 1)[-1]
        if name == "identity":
            return nn.Identity()
    if name not in ACTIVATIONS:
        raise ValueError(f"get_act_fn: activation {act_fn_name!r} is not supported; known: {sorted(ACTIVATIONS)}")
    return _shared_instance(ACTIVATIONS, name)


def get_act_and_mul_fn(act_fn_name: str, **kwargs: Any) -> nn.Module:
    """The shared gated activation for a name (case-insensitive). With keyword arguments
    (e.g. ``compile_native=False``, or ``alpha=`` for swigluoai) a new, unshared module is built."""
    name = act_fn_name.lower()
    if name not in ACTIVATIONS_AND_MUL:
        raise ValueError(f"get_act_and_mul_fn: activation {act_fn_name!r} is not supported; "
                         f"known: {sorted(ACTIVATIONS_AND_MUL)}")
    if kwargs:
        return ACTIVATIONS_AND_MUL[name](**kwargs)
    return _shared_instance(ACTIVATIONS_AND_MUL, name)
