"""How ``standalone.py`` builds an artifact: trace a spec with ``make_fx`` on fake tensors (rows
symbolic, and the width for the width-dynamic families), check what the trace assumed (no
mutation, no aliased output, no constraint on the rows beyond ``>= 2``, the width's guards), and
compile it with ``torch._inductor.standalone_compile``. ``standalone.py`` holds the per-call
guards and the artifact cache; its docstring explains the route.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

_Tensor = torch.Tensor


class Widths:
    """A width-dynamic artifact and the width guards its trace and compile recorded (e.g. the
    gated split's ``Eq(w // 2, w - w // 2)``, per-group quant's ``Eq(Mod(w, 128), 0)`` and
    ``w > 128``), checked once per new width with the width substituted (``_holds``); the
    verdict is kept per width. A width that fails gets the artifact of its width class, or one
    of its own (``standalone._width_class_artifact``).
    ``quantum``: the width was traced as ``quantum`` x a symbol, whose value (``width //
    quantum``) the artifact takes as its first argument."""

    __slots__ = ("fn", "guards", "rows", "width", "quantum", "verdicts", "aligned")

    def __init__(self, fn: Callable[..., Any], guards: list[Any], rows: Any, width: Any, quantum: int,
                 traced: int) -> None:
        self.fn, self.guards, self.rows, self.width, self.quantum = fn, guards, rows, width, quantum
        self.verdicts: dict[int, bool] = {traced: True}  # the traced width (checked at build)
        #: the family's artifact for this one's widths that are multiples of ``standalone._ALIGNED``
        #: (``standalone._aligned_artifact``; None: not built yet, False: refused), kept here so that
        #: a call finds it without hashing its key again
        self.aligned: Any = None

    def serves(self, width: int) -> bool:
        ok = self.verdicts.get(width)
        if ok is None:
            q = self.quantum
            # the symbol's range is [2, oo) (a shape environment specialises sizes 0 and 1)
            ok = self.verdicts[width] = (width % q == 0 and width // q >= 2
                                         and _holds(self.guards, self.rows, self.width, width // q))
            if not ok:
                log.info("customop: width %d fails a guard of its width-dynamic artifact; it gets one of its "
                         "own", width)
        return ok


def compile_graph(compile_fn: Callable[..., Any], form: Callable[..., Any], options: dict[str, Any],
             tensors: list[torch.Tensor], args: tuple[Any, ...],
             kwargs: dict[str, Any] | None = None, dynamic_hidden: bool = False, aligned: int = 1) -> Any:
    """``form``'s artifact for these inputs (a ``Widths`` with ``dynamic_hidden``), or None where
    the route cannot take its graph. ``aligned`` (a power of two): where the width is a multiple
    of it (at least two of it), the width is traced as ``aligned`` x a symbol at least (no
    vector tails; such an artifact serves only multiples of it)."""
    hidden = tensors[0].shape[-1]  # (a 1-D x, run_tokens: its token count; static there)
    quantum = 1
    gm, mode, fakes, traced_width = _trace(form, tensors, args, kwargs or {}, dynamic_hidden, 1)
    if dynamic_hidden:
        # traced as ``quantum`` x a symbol where the graph needs a multiple (the gated split: 2,
        # per-group quant: the group size): index arithmetic without floor divisions by it, which
        # ran per-group quant 1.7-2.4x slower than a per-width artifact
        quantum = _width_quantum(mode.shape_env, _symbol(fakes[1].shape[0]), _symbol(fakes[0]), hidden)
        if aligned > quantum and hidden % aligned == 0 and hidden // aligned >= 2:
            quantum = aligned
        if quantum > 1:
            gm, mode, fakes, traced_width = _trace(form, tensors, args, kwargs or {}, dynamic_hidden, quantum)
    why = _not_functional(gm)
    if why:
        log.info("customop: the %s graph %s; its calls use torch.compile through Dynamo",
                 getattr(form, "__name__", form), why)
        return None
    x_fake = fakes[1] if dynamic_hidden else fakes[0]
    rows_sym = _symbol(x_fake.shape[0])
    width_sym = _symbol(fakes[0]) if dynamic_hidden else None  # hidden // quantum
    # the rows check substitutes the width's value into the symbol the trace created, also where
    # the trace fixed it (per-group quant of one group: the group count 1 specialises, and the
    # width with it): its guards name that symbol, which is no row count (they failed the check,
    # so such a width took Dynamo's path, and with it every later width of the shared key)
    if not _rows_unconstrained(mode.shape_env, rows_sym, traced_width, hidden // quantum):
        log.warning("customop: the %s graph constrains its rows beyond >= 2; its calls use torch.compile "
                    "through Dynamo", getattr(form, "__name__", form))
        return None
    # the fake mode through a tracing context: "from_graph" finds it only in Dynamo's node metadata
    # on torch 2.8 (make_fx records "val", not "example_value")
    context = torch._guards.TracingContext(mode)
    with torch._guards.tracing(context), torch._inductor.config.patch(options), torch.no_grad():
        art = compile_fn(gm, fakes, dynamic_shapes="from_tracing_context")
    # Inductor may guard too while it lowers (the shape environment is the trace's): checked again
    if not _rows_unconstrained(mode.shape_env, rows_sym, traced_width, hidden // quantum):
        log.warning("customop: Inductor's %s code constrains its rows beyond >= 2; its calls use "
                    "torch.compile through Dynamo", getattr(form, "__name__", form))
        return None
    if not dynamic_hidden:
        return art
    if width_sym is None:  # specialised: this width only
        import sympy

        return Widths(art, [sympy.false], None, None, quantum, hidden)
    guards = [g.expr for g in mode.shape_env.guards if width_sym in g.expr.free_symbols]
    return Widths(art, guards, rows_sym, width_sym, quantum, hidden)


def _trace(form: Callable[..., Any], tensors: list[torch.Tensor], args: tuple[Any, ...], kwargs: dict[str, Any],
           dynamic_hidden: bool, quantum: int) -> tuple[Any, Any, list[Any], Any]:
    """``make_fx`` of ``form`` on fake tensors: the rows symbolic from two rows up (the call's own
    count is the size hint, as with Dynamo; tensors of x's rows share the symbol), the rest static
    except, with ``dynamic_hidden``, the width: x's last dim in x, the row tensors and the
    ``[hidden]`` weight, ``quantum`` times a symbol of its own. That symbol is the graph's first
    input (an int: the call passes ``hidden // quantum``), so that the code indexes by
    ``quantum * w`` rather than dividing a width by ``quantum``. Returns the graph, its fake mode,
    its example inputs and the width's symbol as created (None for a static width; the trace may
    have fixed it since: ``_symbol`` of the width input is then None)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    rows, hidden = tensors[0].shape if tensors[0].dim() == 2 else (tensors[0].shape[0], None)
    mode = FakeTensorMode(shape_env=ShapeEnv())
    slots = [i for i, a in enumerate(args) if isinstance(a, _Tensor)]

    def call(ts: tuple[torch.Tensor, ...]) -> Any:
        full = list(args)
        for i, t in zip(slots, ts[1:]):
            full[i] = t
        return form(ts[0], *full, **kwargs)

    if not dynamic_hidden:
        def fake(t: torch.Tensor) -> torch.Tensor:
            # equal sizes share one symbol (duck sizing): x and the row tensors, one rows symbol;
            # a 1-D x (run_tokens' positions): x and the [T, ...] tensors
            token = t.dim() == 2 if hidden is not None else (t is tensors[0] or (t.dim() >= 2 and t.shape[0] == rows))
            if token and rows > 1 and fakes and not t.is_contiguous():
                # run_tokens' row-strided [T, ...] argument (cos/sin chunked from one gather): its
                # strides as they are (static: they do not depend on T), T the shared symbol
                with mode:
                    return torch.empty_strided((fakes[0].shape[0], *t.shape[1:]), t.stride(), dtype=t.dtype)
            dims = [DimDynamic.DUCK if rows > 1 and token and d == 0 else DimDynamic.STATIC
                    for d in range(t.dim())]
            return mode.from_tensor(t.detach(), symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims))

        fakes: list[Any] = []
        for t in tensors:  # a loop, not a comprehension: fake() reads fakes[0] (x's token symbol)
            fakes.append(fake(t))

        def graph(*ts: torch.Tensor) -> Any:
            return call(ts)
        created = None
    else:
        from torch._dynamo.source import ConstantSource

        env = mode.shape_env

        def symbol(name: str, hint: int) -> Any:  # a size symbol of its own (no duck sizing)
            expr = env.create_symbol(hint, source=ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC)
            return env.create_symintnode(expr, hint=hint, source=ConstantSource(name))

        width = symbol("customop_width", hidden // quantum)
        created = width.node.expr
        row_size = symbol("customop_rows", rows) if rows > 1 else 1

        def fake(t: torch.Tensor) -> Any:
            shape: list[Any] = list(t.shape)
            if t.dim() == 2:
                shape[0] = row_size
            if t.dim() >= 1 and t.shape[-1] == hidden:
                shape[-1] = quantum * width
            with mode:
                return torch.empty(shape, dtype=t.dtype)

        fakes = [width, *(fake(t) for t in tensors)]

        def graph(w: Any, *ts: torch.Tensor) -> Any:
            return call(ts)

    with torch.no_grad():  # an inference graph (the guards keep autograd away from it)
        gm = make_fx(graph, tracing_mode="fake")(*fakes)
    return gm, mode, fakes, created


def _width_quantum(shape_env: Any, rows: Any, width: Any, hidden: int) -> int:
    """The power of two the trace's guards require the width to be a multiple of (2 for the gated
    split, the group size for per-group quant; 1 for none), at most ``hidden / 2``: doubled while
    the guards fail at ``hidden + quantum`` and ``hidden`` is a multiple of the double."""
    if width is None:
        return 1
    guards = [g.expr for g in shape_env.guards if width in g.expr.free_symbols]
    quantum = 1
    while hidden % (2 * quantum) == 0 and hidden // (2 * quantum) >= 2 and \
            not _holds(guards, rows, width, hidden + quantum):
        quantum *= 2
    return quantum


def _symbol(size: Any) -> Any:
    """The sympy symbol of a traced size, or None where it is static."""
    expr = getattr(getattr(size, "node", None), "expr", None)
    return expr if getattr(expr, "is_Symbol", False) else None


#: the row counts every guard must hold for (an artifact serves rows >= 2, each guard an
#: expression in the rows and width symbols)
_ROW_SAMPLES = (2, 3, 7, 64, 4231, 2**31 - 1)


def _holds(guards: list[Any], rows: Any, width: Any, n: int) -> bool:
    """Whether every guard holds at width ``n`` (``width``: its symbol, None for a static width)
    for every sample row count (``rows``: its symbol, None for a one-row graph). A guard in any
    other symbol, or one sympy cannot decide, fails."""
    for expr in guards:
        if width is not None:
            expr = expr.xreplace({width: n})
        if expr.free_symbols - {rows}:
            return False
        for r in (_ROW_SAMPLES if rows is not None and expr.free_symbols else (None,)):
            try:
                if not bool(expr if r is None else expr.xreplace({rows: r})):
                    return False
            except TypeError:
                return False
    return True


def _rows_unconstrained(shape_env: Any, rows: Any, width: Any = None, hidden: int = 0) -> bool:
    """Whether every guard the trace recorded holds for every row count from 2 up (the norms record
    ``rows >= 2`` / ``rows != 1`` at most) at the traced width: the artifact then serves all of
    them. Tested on sample counts: each guard is an expression in the rows symbol and, with a
    symbolic width, the width symbol (substituted first); any other symbol (the tensors' rows were
    not one) fails."""
    return _holds([g.expr for g in shape_env.guards], rows, width, hidden)


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
