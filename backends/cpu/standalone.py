"""The compiled tier without Dynamo: Inductor artifacts behind our own guards (issue 18). Used by
the RMSNorm family, the activations and QuantFP8 (``CpuTiers.standalone``).

Why. At decode sizes a norm's kernel takes a few microseconds, and Dynamo's call path (its guards,
the AOT wrapper, ``set_eval_frame``) ~20-40 us on the 2-core CI box: both ``forward_cpu`` and
``torch.compile(forward_native)`` paid it, and ``forward_cpu`` its own ~3 us on top. Here the same
graph is traced once with ``make_fx`` (fake tensors, rows symbolic, everything else static) and
compiled with ``torch._inductor.standalone_compile``; a call checks the conditions below and runs
the artifact directly (docs/cpu.md, "Against torch.compile(forward_native)").

Artifacts. One per (function, Inductor options, dtype of every tensor, hidden size, the values of
the non-tensor arguments, one row or more): the graph for two or more rows is dynamic in the rows
(its shape environment assumes ``rows >= 2``, as Dynamo's does: Dynamo specialises size 1), and
one-row calls get a static graph of their own. So a new token count never compiles.

Guards: what the artifact's code assumes, and whatever else Dynamo guards on that could change
the result. Any failure returns None and the caller takes the Dynamo path, so a failed guard costs
speed, never a wrong result:

- no tracing or interception around the call: not inside ``torch.compile`` (the caller tests
  that first), no torch-dispatch mode (make_fx, FakeTensorMode), no torch-function mode, no
  functorch transform (vmap, grad), no JIT tracer, autocast off (on any device: one cheap call);
- every tensor a plain ``torch.Tensor`` or ``nn.Parameter`` (a subclass keeps its type through the
  spec and would not through compiled code), on the CPU, contiguous (the strides the graph was
  traced with), without the lazy negation bit, its dtype the artifact's;
- x and every tensor of x's shape: at least 2-D, at least one row, the artifact's hidden size
  (ranks above 2 run as views of their rows, like the Dynamo path; with ``two_d_only``, for specs
  whose outputs need not follow x's rows such as QuantFP8's per-tensor scale, 2-D only); the other
  tensors exactly ``[hidden]`` or one element (xielu's alphas, QuantFP8's ``scale_ub``), their
  rank and dtype in the key; every other argument, keyword ones too, a plain value (a scalar,
  string, dtype or a tuple of those, e.g. GroupShape; anything else, such as a tuple holding a
  tensor: None), keyed by value since the graph bakes it in. Outputs may have another width than x (the gated
  activations) or be a tuple (QuantFP8's ``(q, scale)``);
- autograd not recording: grad mode off or no input requiring grad (the artifact is an inference
  graph; training keeps Dynamo's AOTAutograd graph).

At build time, a graph that mutates an input, or returns an input or a view of one (QuantFP8's
static scale: the spec hands back the caller's tensor, an artifact could return a copy), or
whose trace constrains the rows beyond ``>= 2`` (QuantFP8's padding to a token count) is not
compiled: its calls take the Dynamo path (remembered per key, logged).

If ``standalone_compile`` is missing (older torch) or fails for a graph, that is logged (once a
process, once a graph) and those calls take the Dynamo path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # exact types; a subclass would lose its type
_SCALARS = (float, int, bool, type(None))
_C = torch._C

#: artifacts built since import (tests count compiles with it)
compiles = 0
_missing_logged = False


class Family:
    """One compiled form with its Inductor options, and its artifacts by shape class: dtypes,
    hidden size, the non-tensor arguments, one row or more (None where building failed: those
    calls take the Dynamo path). Callers keep the object (``CpuTiers.standalone_family``), so a
    call hashes only its shape class."""

    __slots__ = ("form", "options", "artifacts")

    def __init__(self, form: Callable[..., Any], options: dict[str, Any]) -> None:
        self.form, self.options = form, options
        self.artifacts: dict[tuple[Any, ...], Callable[..., Any] | None] = {}


_families: dict[tuple[Any, ...], Family] = {}


def family(form: Callable[..., Any], options: dict[str, Any]) -> Family:
    """The one ``Family`` of ``form`` compiled with ``options``."""
    key = (form, tuple(sorted(options.items())))
    fam = _families.get(key)
    if fam is None:
        fam = _families[key] = Family(form, dict(options))
    return fam


def reset() -> None:
    """Forgets every artifact (``compile_cache.reset()`` calls this); the families stay."""
    for fam in _families.values():
        fam.artifacts.clear()


_dispatch_modes = _C._len_torch_dispatch_stack
_function_modes = _C._len_torch_function_stack
_transform = _C._functorch.peek_interpreter_stack
_jit_tracing = _C._get_tracing_state
_autocast = _C._is_any_autocast_enabled  # any device: stricter than CPU's alone, and cheaper
_grad = torch.is_grad_enabled


def run(fam: Family, x: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None,
        two_d_only: bool = False) -> Any:
    """``fam.form(x, *args, **kwargs)`` through its artifact, or None when a guard fails (the
    caller then takes the Dynamo path). ~2 us of checks a call. ``kwargs``: non-tensor values only
    (options, dtypes; a tensor among them returns None). ``two_d_only``: x of another rank returns
    None (specs whose outputs do not follow x's leading dims, e.g. QuantFP8's per-tensor scale)."""
    shape = x.shape
    # no mode, transform, tracer or autocast that the artifact would bypass; 1-D x (one token) is
    # left to Dynamo: its weight would look like a row tensor
    if (type(x) not in _PLAIN or len(shape) < 2 or (two_d_only and len(shape) != 2)
            or _dispatch_modes() or _function_modes()
            or _transform() is not None or _jit_tracing() is not None or _autocast()):
        return None
    grad = _grad()
    if not x.is_cpu or not x.is_contiguous() or x.is_neg() or (grad and x.requires_grad):
        return None
    hidden = shape[-1]
    two_d = len(shape) == 2
    rows = shape[0] if two_d else (x.numel() // hidden if hidden else 0)
    if not rows or not hidden:
        return None
    tensors = [x if two_d else x.view(rows, hidden)]
    key = [x.dtype, hidden, rows == 1]
    for a in args:
        kind = type(a)
        if kind is _Tensor or kind is _Parameter:
            if not a.is_cpu or not a.is_contiguous() or a.is_neg() or (grad and a.requires_grad):
                return None
            if a.dim() == 1 and a.numel() == hidden:  # the weight: [hidden] (x is at least 2-D,
                tensors.append(a)                      # so no row tensor is 1-D)
                key += (_WEIGHT, a.dtype)
            elif a.dim() <= 1 and a.numel() == 1:  # a one-element parameter (xielu's alphas)
                tensors.append(a)
                key += (_ONE, a.dim(), a.dtype)
            elif a.shape == shape:  # residual, gate: x's rows
                tensors.append(a if two_d else a.view(rows, hidden))
                key.append(a.dtype)
            else:
                return None
        elif kind in _SCALARS or _plain(a):
            key += (kind, a)  # eps, variance size, group size, a None weight, approximate="tanh"
        else:
            return None  # a tensor subclass (it would lose its type), or a value holding tensors
    if kwargs:
        for name, value in kwargs.items():
            if not _plain(value):
                return None  # tensors only as positional arguments (their guards are above)
            key += (name, type(value), value)
    key = tuple(key)
    try:
        art = fam.artifacts[key]
    except KeyError:
        art = fam.artifacts[key] = _build(fam, x, tensors, args, kwargs or {})
    except TypeError:  # an unhashable argument: Dynamo knows what to do with it
        return None
    if art is None:
        return None
    out = art(*tensors)
    if isinstance(out, list):
        out = tuple(out)
    if two_d:
        return out
    if isinstance(out, tuple):
        return tuple(t.view(*shape[:-1], t.shape[-1]) for t in out)
    return out.view(*shape[:-1], out.shape[-1])


_PLAIN_VALUES = (*_SCALARS, str, torch.dtype)


def _plain(value: Any) -> bool:
    """A value the graph may bake in, keyed by value: a scalar, a string, a dtype, or a tuple of
    those (GroupShape). Anything else (a tensor, a container of tensors, an object) is not."""
    if type(value) in _PLAIN_VALUES:
        return True
    return isinstance(value, tuple) and all(type(v) in _PLAIN_VALUES for v in value)


_WEIGHT = object()  # marks a [hidden] tensor's dtype in a key (a row tensor's stands alone)
_ONE = object()  # marks a one-element tensor's rank and dtype in a key


def _build(fam: Family, x: torch.Tensor, tensors: list[torch.Tensor],
           args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[..., Any] | None:
    """The artifact for this call's key, or None (logged) where it cannot be built."""
    global compiles, _missing_logged
    form = fam.form
    compile_fn = getattr(torch._inductor, "standalone_compile", None) if _import_inductor() else None
    if compile_fn is None:
        if not _missing_logged:
            _missing_logged = True
            log.warning("customop: torch %s has no torch._inductor.standalone_compile; the CPU norms' "
                        "compiled tier calls torch.compile's code through Dynamo", torch.__version__)
        return None
    try:
        art = _compile(compile_fn, form, fam.options, tensors, args, kwargs)
    except Exception:  # noqa: BLE001  (an internal API: any failure means the Dynamo path, said once)
        log.warning("customop: standalone_compile failed for %s (%s, hidden %d); its calls use "
                    "torch.compile through Dynamo", getattr(form, "__name__", form), x.dtype, x.shape[-1],
                    exc_info=True)
        return None
    compiles += 1
    return art


def _import_inductor() -> bool:
    try:
        import torch._inductor  # noqa: F401  (heavy: only when the first artifact is built)
    except ImportError:
        return False
    return True


def _compile(compile_fn: Callable[..., Any], form: Callable[..., Any], options: dict[str, Any],
             tensors: list[torch.Tensor], args: tuple[Any, ...],
             kwargs: dict[str, Any] | None = None) -> Callable[..., Any] | None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    rows = tensors[0].shape[0]
    mode = FakeTensorMode(shape_env=ShapeEnv())

    def fake(t: torch.Tensor) -> torch.Tensor:
        # rows dynamic (from two rows up; the call's own count is the size hint, as with Dynamo),
        # hidden static; tensors of equal rows share one symbol (duck sizing)
        dims = [DimDynamic.DUCK if rows > 1 and t.dim() == 2 and d == 0 else DimDynamic.STATIC
                for d in range(t.dim())]
        return mode.from_tensor(t.detach(), symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims))

    fakes = [fake(t) for t in tensors]
    slots = [i for i, a in enumerate(args) if isinstance(a, _Tensor)]

    def graph(x: torch.Tensor, *ts: torch.Tensor) -> Any:
        full = list(args)
        for i, t in zip(slots, ts):
            full[i] = t
        return form(x, *full, **(kwargs or {}))

    with torch.no_grad():  # an inference graph (the guards keep autograd away from it)
        gm = make_fx(graph, tracing_mode="fake")(*fakes)
    why = _not_functional(gm)
    if why:
        log.info("customop: the %s graph %s; its calls use torch.compile through Dynamo",
                 getattr(form, "__name__", form), why)
        return None
    if rows > 1 and not _rows_unconstrained(mode.shape_env, fakes[0].shape[0]):
        log.warning("customop: the %s graph constrains its rows beyond >= 2; its calls use torch.compile "
                    "through Dynamo", getattr(form, "__name__", form))
        return None
    # the fake mode through a tracing context: "from_graph" finds it only in Dynamo's node metadata
    # on torch 2.8 (make_fx records "val", not "example_value")
    context = torch._guards.TracingContext(mode)
    with torch._guards.tracing(context), torch._inductor.config.patch(options), torch.no_grad():
        return compile_fn(gm, fakes, dynamic_shapes="from_tracing_context")


def _rows_unconstrained(shape_env: Any, rows: Any) -> bool:
    """Whether every guard the trace recorded holds for every row count from 2 up (the norms record
    ``rows >= 2`` / ``rows != 1`` at most): the artifact then serves all of them. Tested on sample
    counts: each guard is an expression in the one rows symbol."""
    sym = rows.node.expr
    for guard in shape_env.guards:
        if guard.expr.free_symbols - {sym}:  # another symbol: the tensors' rows were not one
            return False
        for n in (2, 3, 7, 64, 4231, 2**31 - 1):
            if not bool(guard.expr.xreplace({sym: n})):
                return False
    return True


def _not_functional(gm: torch.fx.GraphModule) -> str | None:
    """Why the artifact could not stand in for the spec's call, or None: an operation that mutates
    (an input would not be written through the artifact as Dynamo's wrapper writes it back), or
    an output that is an input or a view of one (the spec returns the caller's storage, e.g.
    QuantFP8's static scale; the artifact could return a copy)."""
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is not None and schema.is_mutable:
            return f"mutates ({node.target})"
    out = next(n for n in gm.graph.nodes if n.op == "output")
    for node in torch.utils._pytree.tree_leaves(out.args[0]):
        while isinstance(node, torch.fx.Node):
            if node.op == "placeholder":
                return "returns an input or a view of one"
            schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
            if schema is None or not schema.returns or schema.returns[0].alias_info is None or not node.args:
                break
            node = node.args[0]  # a view: its base
    return None
