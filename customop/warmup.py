"""``customop.warmup``: compile the CPU path's graphs at start-up instead of on the first requests.

An enabled op's ``forward_cpu`` runs Inductor-compiled code from a measured size on
(``backends/cpu/tiering.py``); the first call of each shape class compiles, which takes seconds.
Each compiled tier marks its token dims dynamic from the first compile, so one graph serves every
token count of two or more (one-token calls get a graph of their own, as Dynamo specialises size
1). ``warmup`` calls every op it finds once per shape class, on small inputs, so that no request
pays a compile::

    model = build_model()
    customop.warmup(model, dtypes=(torch.bfloat16,))   # seconds here, not on the first request

What it cannot know, it leaves: ops with no registered warm-up inputs are reported as skipped
(``register_warmup`` adds inputs for an op, in-tree or out-of-tree), and ops that do not run
``forward_cpu`` (other platforms, or disabled) are skipped too. Inductor also keeps its compiled
code on disk (``TORCHINDUCTOR_CACHE_DIR``, docs/cpu.md), so a restarted process that warms up
reuses it and compiles in a fraction of the time.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from customop.custom_op import CustomOp

#: One call's arguments: ``(args, kwargs)``.
Call = tuple[tuple[Any, ...], dict[str, Any]]
#: ``builder(op, tokens, dtype) -> calls``: the inputs of every compiled shape class of ``op``.
WarmupBuilder = Callable[[Any, int, torch.dtype], list[Call]]

_BUILDERS: list[tuple[Callable[[Any], bool], WarmupBuilder]] = []

#: (query heads, key heads) of the op being warmed up, for rotary builders (None: unknown).
_HEADS: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("customop_warmup_heads",
                                                                                 default=None)
#: (head size, rotary dim) of the op being warmed up, for ApplyRotaryEmb (None: unknown).
_HEAD_DIMS: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("customop_warmup_head_dims",
                                                                                     default=None)
#: builder -> why it returned no calls (what the caller can pass); the default names the heads
_UNKNOWN: dict[Any, str] = {}

#: The default token counts: one token (its own graph) and a count of the graph that serves all
#: others. More counts add nothing unless an op's threshold needs a larger input.
DEFAULT_SIZES = (1, 16)


@dataclasses.dataclass(frozen=True)
class WarmupRow:
    """What ``warmup`` did for one op, dtype and token count: ``"ran"`` or ``"skipped: why"``."""

    op: str
    dtype: torch.dtype | None
    tokens: int | None
    outcome: str


def register_warmup(match: type | Callable[[Any], bool]) -> Callable[[WarmupBuilder], WarmupBuilder]:
    """Decorator: ``builder(op, tokens, dtype)`` returns the calls that warm ``op`` up at ``tokens``
    tokens; ``match`` is an op class (instances of it and its subclasses) or a predicate. Later
    registrations win, so an out-of-tree op can replace an in-tree rule."""

    def decorator(builder: WarmupBuilder) -> WarmupBuilder:
        test = (lambda op: isinstance(op, match)) if isinstance(match, type) else match
        _BUILDERS.insert(0, (test, builder))
        return builder

    return decorator


def _builder_for(op: Any) -> WarmupBuilder | None:
    _register_in_tree()
    return next((b for test, b in _BUILDERS if test(op)), None)


def _ops_in(model_or_ops: nn.Module | Iterable[Any]) -> list[CustomOp]:
    if isinstance(model_or_ops, CustomOp):
        return [model_or_ops]
    if isinstance(model_or_ops, nn.Module):
        return [m for m in model_or_ops.modules() if isinstance(m, CustomOp)]
    ops = list(model_or_ops)
    bad = [type(o).__name__ for o in ops if not isinstance(o, CustomOp)]
    if bad:
        raise TypeError(f"customop.warmup: expected a module or CustomOp instances, got {', '.join(bad)}")
    return ops


def _dtypes_of(op: nn.Module) -> tuple[torch.dtype, ...]:
    """The dtype the op's floating parameters or buffers hold, else torch's default."""
    for t in (*op.parameters(recurse=False), *op.buffers(recurse=False)):
        if t.is_floating_point() and t.dtype.itemsize > 1:
            return (t.dtype,)
    return (torch.get_default_dtype(),)


def _heads_of(holder: Any) -> tuple[int, int] | None:
    """(num_heads, num_kv_heads) of a module holding a rotary op (vLLM's attention layers)."""
    q = getattr(holder, "num_heads", None)
    kv = getattr(holder, "num_kv_heads", q)
    return (q, kv) if isinstance(q, int) and isinstance(kv, int) else None


def _head_dims_of(holder: Any, head_size: int | None, rotary_dim: int | None) -> tuple[int, int] | None:
    """(head size, rotary dim): the arguments, else the holder's ``head_size`` (vLLM) or
    ``head_dim`` (Hugging Face) and ``rotary_dim`` (default: the whole head)."""
    if head_size is None:
        head_size = next((v for v in (getattr(holder, "head_size", None), getattr(holder, "head_dim", None))
                          if isinstance(v, int) and not isinstance(v, bool)), None)
    if head_size is None:
        return None
    if rotary_dim is None:
        rotary_dim = getattr(holder, "rotary_dim", None)
        if not isinstance(rotary_dim, int) or isinstance(rotary_dim, bool):
            rotary_dim = head_size
    return head_size, rotary_dim


def _holders(model_or_ops: nn.Module | Iterable[Any]) -> dict[int, nn.Module]:
    if not isinstance(model_or_ops, nn.Module):
        return {}
    return {id(child): parent for parent in model_or_ops.modules() for child in parent.children()}


def warmup(model_or_ops: nn.Module | Iterable[Any], *, sizes: Sequence[int] = DEFAULT_SIZES,
           dtypes: Sequence[torch.dtype] | None = None, heads: tuple[int, int] | None = None,
           head_size: int | None = None, rotary_dim: int | None = None) -> list[WarmupRow]:
    """Runs each CPU op of ``model_or_ops`` (a module, walked, or CustomOp instances) once per
    token count of ``sizes`` and input dtype, with its compiled tier forced on for any input a
    larger one of the same shape class would compile, so that those graphs exist before the first
    request. ``dtypes``: the input dtypes to warm (default: each op's parameter dtype, else
    torch's default dtype). ``heads``: ``(query heads, key heads)`` per rank for the rotary ops,
    whose graphs are per head count (default: the ``num_heads``/``num_kv_heads`` of the module
    holding each rotary op; a rotary op with neither is skipped). ``head_size`` and ``rotary_dim``:
    ``ApplyRotaryEmb``'s x ``[S, heads, head_size]`` and cos/sin ``[S, rotary_dim / 2]`` (in x's
    dtype), warmed for the query and the key head count (default: the holding module's
    ``head_size`` or ``head_dim`` and ``rotary_dim``, the rotary dim else the whole head; without
    a head size or head counts the op is skipped). Returns one row per op, dtype and size (or per
    skipped op).

    Each op is warmed once per class and configuration (instances that share a class, hidden
    size and dtype share a graph). Outputs are discarded; no op's state changes. Call it in the
    grad mode the requests run in (e.g. inside ``torch.inference_mode()``): Dynamo guards on it,
    so graphs compiled under one mode do not serve calls under another.
    """
    from customop.backends.cpu.tiering import warming_up

    if isinstance(sizes, int) or not sizes or any(not isinstance(n, int) or isinstance(n, bool) or n < 1
                                                  for n in sizes):
        raise ValueError(f"customop.warmup: sizes must be a sequence of positive token counts, got {sizes!r}")
    rows: list[WarmupRow] = []
    done: set[tuple[Any, ...]] = set()
    holders = _holders(model_or_ops)
    for op in _ops_in(model_or_ops):
        name = getattr(type(op), "name", type(op).__name__)
        method = getattr(op, "forward_method_name", None)
        if method != "forward_cpu":
            rows.append(WarmupRow(name, None, None, f"skipped: runs {method}, not forward_cpu"))
            continue
        builder = _builder_for(op)
        if builder is None:
            rows.append(WarmupRow(name, None, None,
                                  "skipped: no warm-up inputs known (customop.warmup.register_warmup)"))
            continue
        holder = holders.get(id(op))
        op_heads = heads or _heads_of(holder)
        op_dims = _head_dims_of(holder, head_size, rotary_dim)
        for dtype in dtypes or _dtypes_of(op):
            signature = (type(op), dtype, repr(op), op_heads, op_dims)  # extra_repr: the sizes and options
            if signature in done:
                continue
            done.add(signature)
            for tokens in sorted(set(sizes)):
                heads_token, dims_token = _HEADS.set(op_heads), _HEAD_DIMS.set(op_dims)
                try:
                    with warming_up():
                        calls = builder(op, tokens, dtype)
                        for args, kwargs in calls:
                            op.forward_cpu(*args, **kwargs)
                finally:
                    _HEADS.reset(heads_token)
                    _HEAD_DIMS.reset(dims_token)
                rows.append(WarmupRow(name, dtype, tokens, "ran" if calls else _UNKNOWN.get(
                    builder, "skipped: head counts unknown (pass heads=(q, kv))")))
    return rows


# ``customop.warmup`` is this function (the package re-exports it over the module's name), so the
# registration hook rides on it: ``customop.warmup.register_warmup(MyOp)(builder)``.
warmup.register_warmup = register_warmup  # type: ignore[attr-defined]


# ---- the in-tree ops' inputs ----------------------------------------------------------------------


#: One-token inputs of up to this many elements (the widest model rows: a gated activation's
#: 2 x 53248) get their compiled graph at warm-up, for the ops whose width warmup cannot know
#: (activations, QuantFP8: their graphs are dynamic in the width).
WIDEST_ROW = 1 << 17


def warmup_width(tiers: Any, tokens: int, dtype: torch.dtype, width: int) -> int:
    """The warm-up width of an op whose graphs are dynamic in the width (its ``CpuTiers``):
    ``width``, except one token at a threshold that a row of up to ``WIDEST_ROW`` elements
    reaches: then the narrowest row reaching it (a multiple of 256, which every gated split and
    group size divides), so that the one-token graph exists too."""
    threshold = tiers.compile_from(dtype)
    if tokens != 1 or threshold > WIDEST_ROW:
        return width
    return max(width, -(-int(threshold) // 256) * 256)


def _randn(*shape: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, device=device).to(dtype)


def _device(op: nn.Module) -> torch.device:
    t = next(iter((*op.parameters(), *op.buffers())), None)
    return t.device if t is not None else torch.device("cpu")


_registered_in_tree = False


def _register_in_tree() -> None:
    """Registered on first use, so that importing customop imports no op module from here."""
    global _registered_in_tree
    if _registered_in_tree:
        return
    _registered_in_tree = True
    from customop.ops.activation import _Activation
    from customop.ops.layernorm import GemmaRMSNorm, RMSNorm, RMSNormGated
    from customop.ops.quantization import QuantFP8
    from customop.ops.rotary_embedding import ApplyRotaryEmb, RotaryEmbedding

    def norm(op: Any, tokens: int, dtype: torch.dtype) -> list[Call]:
        dev = _device(op)
        x = _randn(tokens, op.hidden_size, dtype=dtype, device=dev)
        return [((x,), {}), ((x, torch.randn_like(x)), {})]  # plain and fused residual add

    def gated_norm(op: Any, tokens: int, dtype: torch.dtype) -> list[Call]:
        x = _randn(tokens, op.hidden_size, dtype=dtype, device=_device(op))
        return [((x,), {}), ((x, torch.randn_like(x)), {})]  # without and with the gate z

    def activation(op: Any, tokens: int, dtype: torch.dtype) -> list[Call]:
        # The hidden dim is dynamic in the activations' graphs and standalone artifacts: any even
        # width serves all widths (the artifacts' width guards are checked per width).
        return [((_randn(tokens, warmup_width(op.cpu_tiers, tokens, dtype, 256), dtype=dtype),), {})]

    def quant(op: Any, tokens: int, dtype: torch.dtype) -> list[Call]:
        hidden = warmup_width(op.cpu_tiers, tokens, dtype, 2 * op.group_shape.col if op.is_group_quant else 256)
        x = _randn(tokens, hidden, dtype=dtype) * 3
        if not op.static:
            return [((x,), {})]
        gs = op.group_shape
        if gs.is_per_tensor():
            shape: tuple[int, ...] = (1,)
        elif gs.is_per_token():
            shape = (tokens, 1)
        elif gs.is_per_channel():
            shape = (hidden,)
        else:
            shape = (tokens, -(-hidden // gs.col))
        return [((x, torch.full(shape, 0.05)), {})]

    def rotary(op: Any, tokens: int, dtype: torch.dtype) -> list[Call]:
        # The head counts are static in the graph (dynamic ones ran 1.5-2x slower): they come from
        # warmup(heads=...), else from the module holding the op (vLLM's num_heads/num_kv_heads).
        q_heads, kv_heads = _HEADS.get() or (None, None)
        if q_heads is None:
            return []
        dev = _device(op)
        positions = torch.arange(tokens, device=dev) % op.max_position_embeddings
        q_width, kv_width = q_heads * op.head_size, kv_heads * op.head_size
        query = _randn(tokens, q_width, dtype=dtype, device=dev)
        key = _randn(tokens, kv_width, dtype=dtype, device=dev)
        # and query and key sliced from one qkv projection (vLLM's attention layers): the
        # standalone route traces large row-strided ones with their stride (small ones are copied
        # to the contiguous layout above)
        qkv = _randn(tokens, q_width + 2 * kv_width, dtype=dtype, device=dev)
        sliced = (positions, qkv[:, :q_width], qkv[:, q_width:q_width + kv_width])
        return [((positions, query, key), {}), (sliced, {})]

    def apply_rotary(op: Any, tokens: int, dtype: torch.dtype) -> list[Call]:
        # x [S, heads, head_size], cos/sin [S, rotary_dim / 2]: the heads, head size and rotary
        # width are static in the graph (the key), S is the token dim; per head count, cos/sin
        # contiguous and chunked from one [S, rotary_dim] gather (as callers make them, Hugging
        # Face's halves too): the standalone route traces large row-strided ones with their stride
        heads, dims = _HEADS.get(), _HEAD_DIMS.get()
        if heads is None or dims is None:
            return []
        head_size, rot = dims
        calls: list[Call] = []
        for count in sorted(set(heads)):
            x = _randn(tokens, count, head_size, dtype=dtype)
            cos, sin = _randn(tokens, 2 * (rot // 2), dtype=dtype).chunk(2, dim=-1)
            calls += [((x, cos, sin), {}), ((x, cos.contiguous(), sin.contiguous()), {})]
        return calls

    _UNKNOWN[apply_rotary] = "skipped: head counts or head size unknown (pass heads=(q, kv) and head_size=)"

    def plain_rotary(op: Any) -> bool:  # scaling variants that keep the base class's call form
        return isinstance(op, RotaryEmbedding) and type(op).forward_cpu is RotaryEmbedding.forward_cpu

    for match, builder in ((RMSNorm, norm), (GemmaRMSNorm, norm), (RMSNormGated, gated_norm),
                           (_Activation, activation), (QuantFP8, quant), (plain_rotary, rotary),
                           (ApplyRotaryEmb, apply_rotary)):
        _BUILDERS.append(((lambda op, m=match: isinstance(op, m)) if isinstance(match, type) else match, builder))
