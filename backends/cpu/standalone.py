"""The norms' compiled tier without Dynamo: Inductor artifacts behind our own guards (issue 18).

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
  functorch transform (vmap, grad), no JIT tracer, CPU autocast off;
- every tensor a plain ``torch.Tensor`` or ``nn.Parameter`` (a subclass keeps its type through the
  spec and would not through compiled code), on the CPU, contiguous (the strides the graph was
  traced with), without the lazy negation bit, its dtype the artifact's;
- x and every tensor of x's shape: at least 2-D, at least one row, the artifact's hidden size
  (ranks above 2 run as views of their rows, like the Dynamo path); the other tensors exactly
  ``[hidden]``;
- autograd not recording: grad mode off or no input requiring grad (the artifact is an inference
  graph; training keeps Dynamo's AOTAutograd graph).

If ``standalone_compile`` is missing (older torch) or fails for a graph, that is logged once and
the graph's calls take the Dynamo path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

_Tensor = torch.Tensor
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # exact types; a subclass would lose its type
_C = torch._C

#: key -> the artifact, or None where building it failed (those calls take the Dynamo path)
_artifacts: dict[tuple[Any, ...], Callable[..., Any] | None] = {}
#: artifacts built since import (tests count compiles with it)
compiles = 0
_missing_logged = False


def reset() -> None:
    """Forgets every artifact (``compile_cache.reset()`` calls this)."""
    _artifacts.clear()


def _plain_context() -> bool:
    """No mode, transform, tracer or autocast that the artifact would bypass (~0.5 us)."""
    return not (_C._len_torch_dispatch_stack() or _C._len_torch_function_stack()
                or _C._functorch.peek_interpreter_stack() is not None or _C._get_tracing_state() is not None
                or torch.is_autocast_enabled("cpu"))


def run(form: Callable[..., Any], options: tuple[tuple[str, Any], ...], x: torch.Tensor,
        args: tuple[Any, ...]) -> Any:
    """``form(x, *args)`` through its artifact, or None when a guard fails (the caller then takes
    the Dynamo path). ``options``: the Inductor options as sorted items (part of the key)."""
    shape = x.shape
    # 1-D x (one token) is left to Dynamo: its weight would look like a row tensor
    if type(x) not in _PLAIN or len(shape) < 2 or not _plain_context():
        return None
    hidden = shape[-1]
    numel = x.numel()
    if not hidden or not numel:
        return None
    rows = numel // hidden
    grad = torch.is_grad_enabled()
    if not x.is_cpu or not x.is_contiguous() or x.is_neg() or (grad and x.requires_grad):
        return None
    two_d = len(shape) == 2
    tensors = [x if two_d else x.view(rows, hidden)]
    key = [form, options, x.dtype, hidden, rows == 1]
    for a in args:
        if isinstance(a, _Tensor):
            if (type(a) not in _PLAIN or not a.is_cpu or not a.is_contiguous() or a.is_neg()
                    or (grad and a.requires_grad)):
                return None
            s = a.shape
            if s == shape:  # residual, gate: x's rows
                tensors.append(a if two_d else a.view(rows, hidden))
                key.append(a.dtype)
            elif len(s) == 1 and s[0] == hidden:  # weight
                tensors.append(a)
                key.append((a.dtype,))  # a 1-tuple: a weight, not a row tensor, of that dtype
            else:
                return None
        else:
            key.append((type(a), a))  # eps, variance size, group size, a None weight
    key = tuple(key)
    try:
        art = _artifacts[key]
    except KeyError:
        art = _artifacts[key] = _build(form, dict(options), x, tensors, args)
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


def _build(form: Callable[..., Any], options: dict[str, Any], x: torch.Tensor, tensors: list[torch.Tensor],
           args: tuple[Any, ...]) -> Callable[..., Any] | None:
    """The artifact for this call's key, or None (logged) where it cannot be built."""
    global compiles, _missing_logged
    compile_fn = getattr(torch._inductor, "standalone_compile", None) if _import_inductor() else None
    if compile_fn is None:
        if not _missing_logged:
            _missing_logged = True
            log.warning("customop: torch %s has no torch._inductor.standalone_compile; the CPU norms' "
                        "compiled tier calls torch.compile's code through Dynamo", torch.__version__)
        return None
    try:
        art = _compile(compile_fn, form, options, tensors, args)
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
             tensors: list[torch.Tensor], args: tuple[Any, ...]) -> Callable[..., Any] | None:
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
        return form(x, *full)

    with torch.no_grad():  # an inference graph (the guards keep autograd away from it)
        gm = make_fx(graph, tracing_mode="fake")(*fakes)
    if rows > 1 and not _rows_unconstrained(mode.shape_env, fakes[0].shape[0]):
        log.warning("customop: the %s graph constrains its rows beyond >= 2; its calls use torch.compile "
                    "through Dynamo", getattr(form, "__name__", form))
        return None
    with torch._inductor.config.patch(options), torch.no_grad():
        return compile_fn(gm, fakes, dynamic_shapes="from_graph")


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
