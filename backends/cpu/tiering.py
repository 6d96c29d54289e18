"""The CPU path's one rule: eager below a measured size, Inductor-compiled code above it.

A compiled call has a floor of ~15-20 us on the 2-core CI machine (guards, the wrapper, an OpenMP
region), about what a whole decode-sized eager op costs; above a few thousand elements Inductor's
fused C++ is 2.5-8x faster than eager. Where the break-even lies depends on the op (how many ATen
kernels its eager form runs) and the dtype (bf16/fp16 eager pays extra cast kernels), so each op
declares its measured thresholds as class data (``cpu_tiers = CpuTiers(...)``) and its
``forward_cpu`` is one call of :func:`run_tiered`. The measurements: docs/cpu.md and
benchmarks/results/cpu_*.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import torch

from customop.backends.cpu import compile_cache, native, standalone
from customop.backends.cpu.compile_cache import EMULATE_CASTS, compiled, dynamic_ready, mark_dynamic_ready
from customop.backends.cpu.exact_rounding import EXACT_ROUNDING_OPTIONS, compiled_form

_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class CpuTiers:
    """When an op's ``forward_cpu`` compiles, and how its inputs reach the compiled code.

    Attributes:
        min_numel: inputs of at least this many elements (of the tiered tensor) run compiled.
        by_dtype: per-dtype overrides of ``min_numel`` (e.g. fp32 breaking even later).
        rows: view the tiered tensor, and every argument of its shape, as 2-D rows
            ``[-1, x.shape[-1]]`` so that one compiled graph per dtype serves every rank.
        dynamic: mark the token dims dynamic from the first compile, so that the first graph
            serves every token count (no compile per new batch size on the request path). Dynamo
            still gives one-token inputs a graph of their own (it specialises size 1).
        dynamic_hidden: mark the last (hidden) dim dynamic too. False: one graph per hidden size,
            which is a model constant (the norms: the graph their benchmarks measured). The
            standalone route follows it: width-symbolic artifacts, checked against their width
            guards once per new width, or one artifact per width.
        feature_dims: how many trailing dims of the tiered tensor are not token dims (without
            ``rows``): 1 for ``[..., hidden]``, 2 for ``[..., heads, head_size]``; a tensor of no
            more dims than this is all token dims (rotary's positions).
        emulate_casts: keep eager's intermediate roundings (Inductor otherwise fuses away a cast
            that the spec rounds at, e.g. RMSNorm's cast to the weight dtype). Specs with a form in
            ``exact_rounding.py`` (the RMSNorm ones, the Mixer2 gated norm) compile that form,
            which rounds to bf16 in fp32 arithmetic instead of through Inductor's slower emulated
            round trip.
        standalone: call the compiled tier's Inductor code without Dynamo (``standalone.py``: our
            own guards, the Dynamo path whenever one fails): ~20-40 us less a call. For specs whose
            tensors are x's shape or ``[hidden]`` and whose other arguments (keyword ones too)
            are plain values: the RMSNorm family, the activations, QuantFP8 (2-D x only when
            ``rows`` is off); and for specs whose x is a 1-D token tensor with ``[T, ...]``
            tensor arguments and otherwise fixed-shape ones (rotary's positions, query, key and
            cos/sin cache: ``standalone.run_tokens``), or an x of one token dim and ``feature_dims``
            of 2+ (ApplyRotaryEmb's ``[S, heads, D]`` with cos/sin ``[S, rot/2]``: the same).
        native_from: inputs of at least this many elements try the spec's hand-written kernel
            (``backends/cpu/native``: RMSNorm's bf16/fp16 roundings in hardware) before the eager
            and compiled tiers; a call the kernel does not take (dtype, layout, CPU features,
            autograd) takes those as before.
    """

    min_numel: float
    by_dtype: Mapping[torch.dtype, float] = dataclasses.field(default_factory=dict)
    #: inputs of 1 to this many elements run compiled too: a small-size band where the compiled
    #: code beats the eager tier although the sizes above it, up to ``min_numel``, do not (0: none)
    compiled_up_to: float = 0
    #: compiled calls of at most this many elements run artifacts compiled for one thread
    #: (``ONE_THREAD``: no OpenMP region; the standalone route only): a dynamic-shape Inductor
    #: kernel opens a region at every size, and with other work on the cores its second thread
    #: can wait out a scheduler slice (ms); ATen's eager kernels stay in one thread below 32K
    #: elements. 0: every compiled call uses the threads
    one_thread_up_to: float = 0
    rows: bool = True
    dynamic: bool = True
    dynamic_hidden: bool = True
    feature_dims: int = 1
    emulate_casts: bool = False
    standalone: bool = False
    #: the standalone route's threaded artifacts of two or more rows: widths that are multiples of
    #: 64 run one traced as 64 x a symbol, whose code has no per-row vector tail
    #: (``standalone._ALIGNED``); warm-up at width 256 builds it with the shared one
    aligned_widths: bool = False
    native_from: float = math.inf
    #: fn -> (what ``compiled`` gave for it, the generation and the two resolvers it came from): the
    #: compile cache's key is a dict of options made into a frozenset, ~1 us a call to rebuild
    _fns: dict[Callable[..., Any], tuple[Any, ...]] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False)
    #: fn -> (its ``standalone.Family``, the resolver it came from), for ``standalone.run``
    _families: dict[Callable[..., Any], tuple[Any, ...]] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False)
    #: the same for the one-thread artifacts (``one_thread_up_to``)
    _one_thread_families: dict[Callable[..., Any], tuple[Any, ...]] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False)

    def compile_from(self, dtype: torch.dtype) -> float:
        return self.by_dtype.get(dtype, self.min_numel)

    def runs_compiled(self, numel: int, dtype: torch.dtype) -> bool:
        """Whether an input of ``numel`` elements runs the compiled tier (outside warm-up)."""
        return numel >= self.compile_from(dtype) or 0 < numel <= self.compiled_up_to

    def compiling_from(self, numel: float) -> CpuTiers:
        """A copy that compiles from ``numel`` elements whatever the dtype, and only from there
        (no small-size band, no one-thread artifacts, no native kernel; tests, experiments)."""
        return dataclasses.replace(self, min_numel=numel, by_dtype={}, compiled_up_to=0, one_thread_up_to=0,
                                   native_from=math.inf)

    def compiled(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        hit = self._fns.get(fn)
        # valid while no reset() happened and nobody swapped the resolvers (tests and the
        # benchmarks patch them)
        if hit is not None and hit[1] == compile_cache.generation and hit[2] is compiled and hit[3] is compiled_form:
            return hit[0]
        form, options = self.form(fn)
        out = compiled(form, **options)
        self._fns[fn] = (out, compile_cache.generation, compiled, compiled_form)
        return out

    def form(self, fn: Callable[..., Any]) -> tuple[Callable[..., Any], dict[str, Any]]:
        """What the compiled tier compiles for ``fn``, and with which Inductor options."""
        if not self.emulate_casts:
            return fn, {}
        form = compiled_form(fn)  # the RMSNorm specs: the bf16 rounding in fp32 arithmetic
        return (fn, dict(EMULATE_CASTS)) if form is fn else (form, {**EMULATE_CASTS, **EXACT_ROUNDING_OPTIONS})

    def standalone_family(self, fn: Callable[..., Any], one_thread: bool = False) -> standalone.Family:
        """``form(fn)``'s artifacts for ``standalone.run``, cached like ``compiled``; with
        ``one_thread``, those compiled for one thread (``ONE_THREAD``)."""
        cache = self._one_thread_families if one_thread else self._families
        hit = cache.get(fn)
        if hit is not None and hit[1] is compiled_form:
            return hit[0]
        form, options = self.form(fn)
        fam = standalone.family(form, {**options, **ONE_THREAD} if one_thread else options,
                                dynamic_hidden=self.dynamic_hidden,
                                aligned=self.aligned_widths and not one_thread)  # small calls: tails matter little
        cache[fn] = (fam, compiled_form)
        return fam


#: Inductor's options for ``CpuTiers.one_thread_up_to``'s artifacts: C++ without OpenMP pragmas
ONE_THREAD = {"cpp.threads": 1}


#: Set by ``warming_up()``: calls of two or more tokens take the compiled tier whatever their size
#: (the graph they compile serves every larger size too), so a warm-up can use small inputs.
_WARMING_UP: contextvars.ContextVar[bool] = contextvars.ContextVar("customop_cpu_warming_up", default=False)


def for_this_cpu(default: _T, **by_capability: _T) -> _T:
    """``by_capability[capability]`` for ATen's CPU capability on this machine
    (``torch.backends.cpu.get_cpu_capability()``: ``"AVX512"``, ``"AVX2"``, ...: the instruction set
    ATen's kernels and Inductor's code are built for here), else ``default``. For the choices that
    trade places between CPUs (an op's tiers, the MoE experts' route), each measured on its CPU."""
    return by_capability.get(torch.backends.cpu.get_cpu_capability(), default)


@contextlib.contextmanager
def warming_up() -> Iterator[None]:
    """Within the block, ``run_tiered`` compiles every call that a larger input of the same shape
    class would compile: any call of two or more tokens, and one-token calls where one token
    already reaches the op's threshold (one-token inputs get a graph of their own)."""
    token = _WARMING_UP.set(True)
    try:
        yield
    finally:
        _WARMING_UP.reset(token)


def _autograd_records(x: torch.Tensor) -> bool:
    return x.requires_grad and torch.is_grad_enabled()


def _tokens(tiers: CpuTiers, x: torch.Tensor) -> int:
    """The token count of ``x`` as the tiers see it: the product of its token dims (all but its
    ``feature_dims``; rows for ``feature_dims`` 1, ApplyRotaryEmb's S of ``[S, heads, D]``; a 1-D
    x is all tokens)."""
    if x.dim() <= 1:
        return x.numel()
    features = x.shape[-tiers.feature_dims:] if x.dim() > tiers.feature_dims else x.shape[-1:]
    width = features.numel()
    return x.numel() // width if width else 0


def _below_threshold(tiers: CpuTiers, x: torch.Tensor) -> bool:
    if tiers.runs_compiled(x.numel(), x.dtype):
        return False
    if not _WARMING_UP.get() or x.numel() == 0:
        return True
    # warm-up: build every graph a request of this shape class may take; with a small-size band,
    # one-token requests compile (their graph of their own included)
    tokens = _tokens(tiers, x)
    one_token = x.numel() // max(tokens, 1)
    return tokens < 2 and one_token < tiers.compile_from(x.dtype) and not tiers.compiled_up_to


_is_compiling = torch.compiler.is_compiling


def is_warming_up() -> bool:
    """Whether the call runs inside ``warming_up()``: an op that splits its sizes between two
    ``run_tiered`` calls (two compiled forms) makes both there, so that warm-up builds either's
    artifacts. False inside a caller's ``torch.compile`` (which runs the spec, and whose Dynamo
    cannot trace ``ContextVar.get``)."""
    return not _is_compiling() and _WARMING_UP.get()


def has_neg_bit(values: Iterable[Any]) -> bool:
    """Whether a tensor among ``values`` carries the lazy negation bit (``torch._neg_view``, the
    real view of a conjugate): torch.compile (2.13) reads such inputs without the negation, so
    callers of compiled code run the spec eagerly for them (the standalone route refuses them)."""
    return any(isinstance(v, torch.Tensor) and v.is_neg() for v in values)


def run_tiered(tiers: CpuTiers, spec: Callable[..., Any], x: torch.Tensor, *args: Any,
               eager: Callable[..., Any] | None = None, compiled_spec: Callable[..., Any] | None = None,
               prepare: Callable[[torch.Tensor], torch.Tensor] | None = None, static: tuple[Any, ...] | None = None,
               **kwargs: Any) -> Any:
    """``spec(x, *args, **kwargs)`` on the CPU, by the cheapest route for ``x``'s size.

    - inside a caller's ``torch.compile``: ``spec`` itself (the caller's Inductor fuses it);
    - from ``tiers.native_from`` elements: ``spec``'s hand-written kernel where it takes the call
      (``backends/cpu/native``), else the tiers below;
    - below ``tiers.compile_from(x.dtype)`` elements and above ``tiers.compiled_up_to``:
      ``eager(x, *args)`` (the spec's operations with fewer temporaries; ``None`` from it means
      "not covered, use the spec") while autograd is not recording for ``x`` (its in-place steps
      would overwrite saved values), else ``spec``;
    - otherwise: the compiled ``compiled_spec`` (default ``spec``) of ``prepare(x)`` (default ``x``),
      its token dims marked dynamic until a graph dynamic in them exists (``CpuTiers.dynamic``);
      with ``CpuTiers.standalone`` the same code called without Dynamo while its guards hold
      (compiled for one thread up to ``tiers.one_thread_up_to`` elements; a call of the
      small-size band that the route does not take runs the eager tier).

    ``static``: the caller's stand-in for what Dynamo guards on in ``args``/``kwargs`` besides
    tensor sizes (every non-tensor value, and which tensor arguments are None), when it has one
    at hand: it replaces the tuple built from them per call (~1 us) in the shape-class key.
    """
    if _is_compiling():
        return spec(x, *args, **kwargs)
    numel = x.numel()
    if numel >= tiers.native_from:
        kernel = native.kernel_for(spec)
        out = None if kernel is None else kernel(x, *args, **kwargs)
        if out is not None:
            return out
    elif tiers.native_from < math.inf and _WARMING_UP.get():
        native.prepare(spec)  # built and loaded now rather than on the first large request
    # the size test inline first: compiled-size calls (the hot path) skip _below_threshold's frame
    if numel < tiers.compile_from(x.dtype) and _below_threshold(tiers, x):
        if eager is not None and not _autograd_records(x):
            out = eager(x, *args, **kwargs)
            if out is not None:
                return out
        return spec(x, *args, **kwargs)
    if tiers.standalone and prepare is None:
        # Inductor's code without Dynamo's call path; None: a guard failed, Dynamo's path below
        # (the eager tier for a small-size band call)
        one_thread = numel <= tiers.one_thread_up_to
        out = _standalone(tiers, tiers.standalone_family(compiled_spec or spec, one_thread), x, args, kwargs)
        if tiers.one_thread_up_to and _WARMING_UP.get():
            # warm-up's small inputs stand for large requests too: both thread counts' artifacts
            _standalone(tiers, tiers.standalone_family(compiled_spec or spec, not one_thread), x, args, kwargs)
        if out is not None:
            return out
        if numel < tiers.compile_from(x.dtype) and not _WARMING_UP.get():
            # a small-size band call that the route does not take (a layout, autograd): the eager
            # tier, which beats Dynamo's ~20-40 us call path at these sizes
            return _eager_tier(spec, eager, x, args, kwargs)
    if x.is_neg() or has_neg_bit(args):
        return spec(x, *args, **kwargs)
    fn = tiers.compiled(compiled_spec or spec)
    if prepare is not None:
        x = prepare(x)
    if tiers.rows:
        return _run_on_rows(fn, tiers, x, args, kwargs, static)
    if not tiers.dynamic:
        return fn(x, *args, **kwargs)
    ones = tuple(x.shape[d] == 1 for d in _token_dims(tiers, x))  # Dynamo specialises sizes of 1
    key = _shape_class(fn, tiers, x, ones, args, kwargs, static)
    known = _ready(key)
    if known:
        return fn(x, *args, **kwargs)
    with _temporary_marks(_token_marks(tiers, x, args)):
        out = fn(x, *args, **kwargs)
    if known is not None:
        mark_dynamic_ready(key)
    return out


def _eager_tier(spec: Callable[..., Any], eager: Callable[..., Any] | None, x: torch.Tensor,
                args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The eager tier, as ``run_tiered`` runs it below the threshold (written out there: one frame
    less on the decode path): ``eager`` where autograd does not record for ``x`` (None from it:
    not covered), else the spec."""
    if eager is not None and not _autograd_records(x):
        out = eager(x, *args, **kwargs)
        if out is not None:
            return out
    return spec(x, *args, **kwargs)


def _standalone(tiers: CpuTiers, fam: standalone.Family, x: torch.Tensor, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
    """``fam``'s artifact for the call, or None where the route does not take it. Without
    ``rows`` the outputs need not follow x's leading dims: 2-D x only. A 1-D x is a token tensor
    (rotary's positions) with [T, ...] arguments, and so is an x of one token dim and 2+ feature
    dims (ApplyRotaryEmb's [S, heads, head_size]): ``run_tokens`` (warm-up keeps row-strided
    arguments strided: it builds the artifact large calls use)."""
    ndim = x.dim()
    if ndim == 1 or ndim == tiers.feature_dims + 1 > 2:
        return standalone.run_tokens(fam, x, args, kwargs, _WARMING_UP.get())
    return standalone.run(fam, x, args, kwargs, two_d_only=not tiers.rows)


_DYNAMIC_READY = compile_cache._dynamic_ready  # (cleared in place by compile_cache.reset())

_TENSOR = object()  # a tensor argument's place in a shape class (its sizes are the marks' business)


def _static(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The arguments' values as Dynamo guards on them (tensors only as present or None)."""
    static = tuple([_TENSOR if isinstance(a, torch.Tensor) else a for a in args])
    if kwargs:
        static += tuple([(k, _TENSOR if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()])
    return static


def _shape_class(fn: Callable[..., Any], tiers: CpuTiers, x: torch.Tensor, ones: tuple[bool, ...],
                 args: tuple[Any, ...], kwargs: dict[str, Any],
                 static: tuple[Any, ...] | None = None) -> tuple[Any, ...]:
    """What Dynamo guards on besides the marked sizes: the function, x's dtype, which token dims
    are 1 (their rank too), the hidden size unless dynamic, and the other arguments' values
    (tensors only as present or None; the caller's ``static`` when given)."""
    if static is None:
        static = _static(args, kwargs)
    return fn, x.dtype, ones, None if tiers.dynamic_hidden or x.dim() < 2 else x.shape[-1], static


def _ready(key: tuple[Any, ...]) -> bool | None:
    """Whether ``key``'s dynamic graph exists; None when the key cannot be hashed (mark always)."""
    try:
        return dynamic_ready(key)
    except TypeError:
        return None


def _token_dims(tiers: CpuTiers, x: torch.Tensor) -> range:
    return range(x.dim() - tiers.feature_dims) if x.dim() > tiers.feature_dims else range(x.dim())


def _token_marks(tiers: CpuTiers, x: torch.Tensor, args: tuple[Any, ...]) -> list[tuple[torch.Tensor, int]]:
    """The (tensor, dim) pairs to mark dynamic: x's token dims (all but its ``feature_dims``; a
    1-D x's only dim) and, in every tensor argument that starts with a token dim's size (query and
    key for positions, per-token scales, cos/sin rows), each leading dim of a token dim's size;
    the last dims too with ``dynamic_hidden``."""
    token_dims = _token_dims(tiers, x)
    token_sizes = {x.shape[d] for d in token_dims}
    marks = [(x, d) for d in token_dims]
    if tiers.dynamic_hidden and x.dim() > 1:
        marks.append((x, x.dim() - 1))
    for t in args:
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] not in token_sizes:
            continue
        last = t.dim() - 1
        marks += [(t, d) for d in range(t.dim())
                  if (t.shape[d] in token_sizes and (d < last or t.dim() == 1))
                  or (tiers.dynamic_hidden and d == last and t.dim() > 1)]
    return marks


_MARK_ATTRS = ("_dynamo_weak_dynamic_indices", "_has_dynamo_dim_marking")
_UNSET = object()


@contextlib.contextmanager
def _temporary_marks(marks: list[tuple[torch.Tensor, int]]) -> Iterator[None]:
    """Marks the dims dynamic for the calls in the block and then restores each tensor's own marks:
    the caller's tensors must not carry ours into their own ``torch.compile``. The tensors
    themselves are marked, not views of them: Dynamo guards on a view's base, so a graph traced
    on views would not serve the plain tensors of later calls."""
    saved = {id(t): (t, [t.__dict__.get(a, _UNSET) for a in _MARK_ATTRS]) for t, _ in marks}
    for t, d in marks:
        torch._dynamo.maybe_mark_dynamic(t, d)
    try:
        yield
    finally:
        for t, values in saved.values():
            for attr, value in zip(_MARK_ATTRS, values):
                if value is _UNSET:
                    t.__dict__.pop(attr, None)
                else:
                    setattr(t, attr, value)


def _run_on_rows(fn: Callable[..., Any], tiers: CpuTiers, x: torch.Tensor, args: tuple[Any, ...],
                 kwargs: dict[str, Any], static: tuple[Any, ...] | None = None) -> Any:
    shape = x.shape
    ndim = x.dim()
    two_d = ndim == 2
    if tiers.dynamic:
        # _shape_class's key, built inline (the steady state's one lookup): one token (Dynamo
        # specialises 1), and 2-D or not (other ranks arrive as views, which Dynamo guards
        # differently from plain tensors)
        hidden = shape[-1]
        key = (fn, x.dtype, (x.numel() == hidden, two_d), None if tiers.dynamic_hidden or ndim < 2 else hidden,
               _static(args, kwargs) if static is None else static)
        try:  # _ready, inline
            known = key in _DYNAMIC_READY
        except TypeError:
            known = None
        mark = not known
    else:
        key = known = None
        mark = False
    if two_d and not mark:  # the usual [tokens, hidden]: skip the reshapes (~5 us)
        return fn(x, *args, **kwargs)
    # 2-D tensors go in as they are (a graph traced on views would guard on their bases)
    rows = [a.reshape(-1, shape[-1]) if isinstance(a, torch.Tensor) and a.shape == shape and a.dim() != 2 else a
            for a in (x, *args)]
    # every [rows, hidden] argument alike (x + residual must not pin the rows to one size)
    marks = [(a, d) for a in rows if isinstance(a, torch.Tensor) and a.shape == rows[0].shape
             for d in ((0, 1) if tiers.dynamic_hidden else (0,))] if mark else []
    with _temporary_marks(marks):
        out = fn(*rows, **kwargs)
    if mark and known is not None:
        mark_dynamic_ready(key)
    if x.dim() == 2:
        return out
    if isinstance(out, tuple):
        return tuple(t.view(*shape[:-1], t.shape[-1]) for t in out)
    return out.view(*shape[:-1], out.shape[-1])
