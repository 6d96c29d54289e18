"""customop's ops inside a Hugging Face ``transformers`` model, in one call::

    from customop.integrations.transformers import patch, unpatch
    report = patch(model)        # {module path: what replaced it}
    unpatch(model)               # the original modules and forwards again

What is replaced (docs/transformers.md has the table per architecture), for the model classes of
Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma, Gemma 2, Gemma 3, Mixtral and Qwen3-MoE:

- the RMSNorm modules -> ``RMSNorm`` (``rms_norm``), Gemma's offset-weight norms ->
  ``GemmaRMSNorm`` (``gemma_rms_norm``);
- the gated MLPs -> the same projections around ``SiluAndMul`` / ``GeluAndMul`` (the activation
  and the product fused, ``customop/integrations/_hf_mlp.py``);
- ``apply_rotary_pos_emb``, which the attention modules call -> ``ApplyRotaryEmb``
  (``apply_rotary_emb``, ``customop/integrations/_hf_rotary.py``). It is a function of the
  modeling module, so it changes for every model of that architecture in the process while at
  least one patched model holds it (it computes the same values: see that file);
- the experts of the sparse MoE blocks -> ``TransformersMoERunner`` (``transformers_fused_moe``).

Every replacement holds the model's own parameter objects (no weight is copied; the state dict
keeps its keys) and is a customop op built when ``patch`` runs, so it dispatches as every op does:
the ``custom_ops`` config, the platform's ``forward_*`` method and registered out-of-tree
replacements apply (on a CPU ``forward_cpu``, on an H200 ``forward_cuda``). Only the exact Hugging
Face classes listed in the tables below are touched; a recognised module this module cannot
serve with the same math (an unknown activation, expert weights in another layout, hooks on the
module) stays as it is and is named in a logged warning. Calls the op would compute differently
(a norm input whose dtype is not the weight's, autocast) run the original module's code.

Nothing here imports transformers: modules are recognised by their class and modeling module.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from customop.custom_op import CustomOp
from customop.integrations._hf_mlp import MLP_CLASSES
from customop.integrations import _hf_rotary

logger = logging.getLogger("customop")

#: the architectures whose modeling modules (``transformers.models.<arch>.modeling_<arch>``) are read
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3", "mixtral", "qwen3_moe")
_MODELING_MODULES = {f"transformers.models.{a}.modeling_{a}" for a in ARCHITECTURES}

#: RMSNorm classes -> op. Llama's: ``w * (x / rms(x)).to(x.dtype)``; Gemma's: ``(x / rms(x) * (1 + w))``
#: in fp32, cast last
NORMS = {
    **dict.fromkeys(("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Phi3RMSNorm",
                     "MixtralRMSNorm", "Qwen3MoeRMSNorm"), "rms_norm"),
    **dict.fromkeys(("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm"), "gemma_rms_norm"),
}
#: gated MLP classes -> layout: separate gate_proj/up_proj, or one gate_up_proj (Phi-3)
MLPS = {
    **dict.fromkeys(("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "GemmaMLP", "Gemma2MLP", "Gemma3MLP",
                     "Qwen3MoeMLP"), "split"),
    "Phi3MLP": "fused",
}
#: attention classes -> whether their apply_rotary_pos_emb passes lanes past cos.shape[-1] through (Phi-3)
ATTENTIONS = {
    **dict.fromkeys(("LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention", "GemmaAttention",
                     "Gemma2Attention", "Gemma3Attention", "MixtralAttention", "Qwen3MoeAttention"), False),
    "Phi3Attention": True,
}
#: expert collections ([E, 2I, H] gate_up_proj, [E, H, I] down_proj) of the sparse MoE blocks
EXPERTS = ("MixtralExperts", "Qwen3MoeExperts")

#: the op names ``ops=`` may hold
OP_NAMES = ("rms_norm", "gemma_rms_norm", "silu_and_mul", "gelu_and_mul", "apply_rotary_emb", "transformers_fused_moe")

_PATCHES = "_customop_patches"  # the model's list of _Patch records (an attribute: deepcopy keeps it)


# ---- recognising modules ------------------------------------------------------------------------


def _hf_class(module: nn.Module) -> str | None:
    """The class name when ``module`` is exactly a class of a supported modeling module."""
    cls = type(module)
    return cls.__name__ if cls.__module__ in _MODELING_MODULES else None


def _activation(act: Any) -> tuple[str, dict[str, Any]] | None:
    """(op name, op kwargs) of the ``*_and_mul`` op whose activation is exactly ``act``'s."""
    cls = type(act)
    if isinstance(act, nn.SiLU) or (cls.__name__ == "SiLUActivation" and cls.__module__ == "transformers.activations"):
        return "silu_and_mul", {}
    fn = getattr(act, "act", None)
    if cls.__module__ == "transformers.activations" and cls.__name__ == "GELUActivation" and fn is F.gelu:
        return "gelu_and_mul", {"approximate": "none"}
    if (cls.__module__ == "transformers.activations" and cls.__name__ == "GELUTanh"
            and isinstance(fn, functools.partial) and fn.func is F.gelu and not fn.args
            and fn.keywords == {"approximate": "tanh"}):
        return "gelu_and_mul", {"approximate": "tanh"}
    return None


#: *_and_mul op -> the MoE experts' activation name
_MOE_ACTIVATIONS = {("silu_and_mul", ""): "silu", ("gelu_and_mul", "none"): "gelu",
                    ("gelu_and_mul", "tanh"): "gelu_tanh"}


def _hooked(module: nn.Module) -> bool:
    # a hook, an accelerate hook (device_map offloading) or an instance forward would be lost
    return bool(module._forward_hooks or module._forward_pre_hooks or hasattr(module, "_hf_hook")
                or "forward" in module.__dict__)


def _describe(op: CustomOp) -> str:
    return f"{type(op).__name__} ({op.name}, {op.forward_method_name})"


# ---- the records unpatch reads ------------------------------------------------------------------


@dataclass
class _Patch:
    """A swapped child (``owner._modules[attr]``: ``original`` -> ``replacement``), or, with
    ``attr=None``, a hold on the rotary function of modeling module ``original`` (``replacement``
    is the holder token)."""

    path: str
    owner: nn.Module
    attr: str | None
    original: Any
    replacement: Any

    def undo(self) -> bool:
        if self.attr is None:
            return _hf_rotary.release(self.original, self.replacement)
        if self.owner._modules.get(self.attr) is not self.replacement:
            return False
        # parameters the replacement holds under the original's names: if a conversion made new
        # parameter objects since (to_empty, overwrite-on-conversion), the original takes them
        for name, param in self.original._parameters.items():
            current = self.replacement._parameters.get(name)
            if current is not None and current is not param:
                self.original._parameters[name] = current
        setattr(self.owner, self.attr, self.original)
        return True

    def restored(self) -> str:
        return f"{self.original}.apply_rotary_pos_emb" if self.attr is None else type(self.original).__name__


class _ExactOr:
    """An op's resolved forward for the calls it serves exactly (``servable(op, *args)``); the
    original module's forward for the others. A class, not a closure, so that ``copy.deepcopy``
    of a patched model rebinds it to the copy's op and module."""

    def __init__(self, op: CustomOp, servable: Callable[..., bool], original: Callable) -> None:
        self.op, self.resolved, self.servable, self.original = op, op._forward_method, servable, original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.servable(self.op, *args, **kwargs):
            return self.resolved(*args, **kwargs)
        return self.original(*args, **kwargs)


def _norm_servable(op: CustomOp, x: Any, *args: Any, **kwargs: Any) -> bool:
    # Llama's norm multiplies in x's dtype and returns the promoted dtype; the op multiplies in
    # the weight's dtype and returns x's: the same only when the two dtypes agree
    return not args and not kwargs and isinstance(x, torch.Tensor) and x.dtype == op.weight.dtype


def _experts_servable(op: CustomOp, hidden_states: Any, *args: Any, **kwargs: Any) -> bool:
    w = op.w13_weight
    return (isinstance(hidden_states, torch.Tensor) and hidden_states.dtype == w.dtype
            and hidden_states.device == w.device and not torch.is_autocast_enabled(w.device.type))


# ---- building the replacements ------------------------------------------------------------------


def _op(name: str, **kwargs: Any) -> CustomOp:
    # built from the registry so that out-of-tree replacements apply; meta: the op's own
    # parameters are placeholders, replaced by the model's before use
    with torch.device("meta"):
        return CustomOp.op_registry[name](**kwargs)


def _norm(module: nn.Module, op_name: str) -> tuple[CustomOp | None, str]:
    weight = getattr(module, "weight", None)
    eps = getattr(module, "eps" if op_name == "gemma_rms_norm" else "variance_epsilon", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or not isinstance(eps, float):
        return None, "no 1-D weight parameter and float epsilon"
    op = _op(op_name, hidden_size=weight.shape[0], eps=eps)
    op.weight = weight
    op._forward_method = _ExactOr(op, _norm_servable, module.forward)
    return op, _describe(op)


def _mlp(module: nn.Module, layout: str, allowed: set[str]) -> tuple[nn.Module | None, str]:
    act = module.act_fn if layout == "split" else module.activation_fn
    found = _activation(act)
    if found is None:
        return None, f"activation {type(act).__name__} has no fused *_and_mul op"
    name, kwargs = found
    if name not in allowed:
        return None, ""
    op = _op(name, **kwargs)
    cls = MLP_CLASSES[layout]
    return cls(module, op), f"{type(module).__name__} -> {cls.__name__} + {_describe(op)}"


def _experts(module: nn.Module, block: nn.Module) -> tuple[CustomOp | None, str]:
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    layout_ok = (getattr(module, "has_gate", True) and getattr(module, "is_concatenated", True)
                 and not getattr(module, "is_transposed", False) and not getattr(module, "has_bias", False)
                 and not getattr(module, "has_post_expert_norm", False))
    if not (layout_ok and isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3):
        return None, "experts are not gate_up_proj [E, 2I, H] and down_proj [E, H, I] without biases"
    experts, two_i, hidden = gate_up.shape
    if two_i % 2 or tuple(down.shape) != (experts, hidden, two_i // 2) or down.dtype != gate_up.dtype:
        return None, f"expert shapes {tuple(gate_up.shape)} and {tuple(down.shape)} do not pair"
    found = _activation(getattr(module, "act_fn", None))
    act = None if found is None else _MOE_ACTIVATIONS.get((found[0], found[1].get("approximate", "")))
    if act is None:
        return None, f"expert activation {type(getattr(module, 'act_fn', None)).__name__} is not supported"
    top_k = getattr(getattr(block, "gate", None), "top_k", None) or getattr(getattr(module, "config", None),
                                                                           "num_experts_per_tok", None)
    if not isinstance(top_k, int):
        return None, "the block's top_k is unknown"
    op = _op("transformers_fused_moe", num_experts=experts, top_k=top_k, hidden_size=hidden,
             intermediate_size=two_i // 2, params_dtype=gate_up.dtype, activation=act)
    # the model's parameters under their Hugging Face names (the state dict keeps its keys); the
    # runner reads them through its own names, plain attributes pointing at the same objects
    for name, hf_name, param in (("w13_weight", "gate_up_proj", gate_up), ("w2_weight", "down_proj", down)):
        del op._parameters[name]
        op.register_parameter(hf_name, param)
        op.__dict__[name] = param
    if any(t.is_meta for t in (*op.parameters(), *op.buffers())) and not gate_up.is_meta:
        return None, "the runner holds state beyond the expert weights"
    op._forward_method = _ExactOr(op, _experts_servable, module.forward)
    return op, _describe(op)


# ---- the public API -----------------------------------------------------------------------------


def _wanted(ops: Iterable[str] | None) -> set[str]:
    if ops is None:
        return set(OP_NAMES)
    if isinstance(ops, str):
        ops = [ops]
    wanted = set()
    for key in ops:
        try:
            name = CustomOp.resolve_op_name(key)
        except KeyError as err:
            raise ValueError(f"customop.integrations.transformers.patch: ops holds {key!r}: {err.args[0]}") from None
        if name not in OP_NAMES:
            raise ValueError(f"customop.integrations.transformers.patch: ops holds {key!r}; patch uses only "
                             f"{', '.join(OP_NAMES)}")
        wanted.add(name)
    return wanted


def _parent(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent_path, _, attr = path.rpartition(".")
    return (model.get_submodule(parent_path) if parent_path else model), attr


def patch(model: nn.Module, *, ops: Iterable[str] | None = None) -> dict[str, str]:
    """Replaces, in place, the modules of ``model`` that customop serves (see the module
    docstring); ``ops`` limits it to those op names (or class names). Returns
    ``{module path: what replaced it}``; an empty dict when there was nothing to replace. The
    replacements hold the model's own parameter objects. ``unpatch(model)`` undoes it."""
    if not isinstance(model, nn.Module):
        raise TypeError("customop.integrations.transformers.patch: model must be an nn.Module, "
                        f"got {type(model).__name__}")
    wanted = _wanted(ops)
    records = model.__dict__.setdefault(_PATCHES, [])
    report: dict[str, str] = {}
    notes: dict[str, list[str]] = {}
    held = {r.original for r in records if r.attr is None}  # modeling modules whose rotary this model holds
    rope_ops: dict[str, CustomOp] = {}  # ... and those this call installs or joins
    for path, module in list(model.named_modules()):
        cls = _hf_class(module)
        if not path or cls is None:
            continue
        kind = ("norm" if cls in NORMS else "mlp" if cls in MLPS else "attention" if cls in ATTENTIONS
                else "experts" if cls in EXPERTS else None)
        if kind is None or (kind == "norm" and NORMS[cls] not in wanted) or \
                (kind == "attention" and "apply_rotary_emb" not in wanted) or \
                (kind == "experts" and "transformers_fused_moe" not in wanted) or \
                (kind == "mlp" and not wanted & {"silu_and_mul", "gelu_and_mul"}):
            continue
        if kind == "attention":
            modeling = type(module).__module__
            if modeling in held:
                continue  # an earlier patch of this model holds it
            if modeling not in rope_ops:
                try:
                    rope_ops[modeling], token = _hf_rotary.install(modeling, ATTENTIONS[cls],
                                                                   lambda: _op("apply_rotary_emb"))
                except LookupError as err:
                    notes.setdefault(str(err), []).append(path)
                    continue
                records.append(_Patch(path, module, None, modeling, token))
            report[path] = f"apply_rotary_pos_emb -> {_describe(rope_ops[modeling])}"
            continue
        if _hooked(module):
            notes.setdefault("hooks or an instance forward on the module", []).append(path)
            continue
        parent, attr = _parent(model, path)
        if kind == "norm":
            replacement, what = _norm(module, NORMS[cls])
        elif kind == "mlp":
            replacement, what = _mlp(module, MLPS[cls], wanted)
        else:
            replacement, what = _experts(module, parent)
        if replacement is None:
            if what:
                notes.setdefault(what, []).append(path)
            continue
        setattr(parent, attr, replacement)
        records.append(_Patch(path, parent, attr, module, replacement))
        report[path] = what
    for reason, paths in notes.items():
        logger.warning("customop.integrations.transformers.patch left %d module(s) as they are (%s): %s",
                       len(paths), reason, ", ".join(paths))
    return report


def unpatch(model: nn.Module) -> dict[str, str]:
    """Restores the modules and forwards ``patch`` replaced (the latest patch first); returns
    ``{module path: the restored class}``. A module replaced again since is left as it is,
    with a logged warning."""
    records = model.__dict__.pop(_PATCHES, [])
    restored: dict[str, str] = {}
    for record in reversed(records):
        if record.undo():
            restored[record.path] = record.restored()
        else:
            logger.warning("customop.integrations.transformers.unpatch: %s was replaced again since patch; "
                           "left as it is", record.path)
    return restored


def patched(model: nn.Module) -> bool:
    """Whether ``patch`` replaced anything in ``model`` that ``unpatch`` has not restored."""
    return bool(model.__dict__.get(_PATCHES))
