"""The compiled tier without Dynamo: Inductor artifacts behind our own guards (issue 18). Used by
the RMSNorm family, the activations, QuantFP8 (``run``), RotaryEmbedding and ApplyRotaryEmb
(``run_tokens``: a token tensor first, 1-D or 3-D) (``CpuTiers.standalone``).

Why. At decode sizes a norm's kernel takes a few microseconds, and Dynamo's call path (its guards,
the AOT wrapper, ``set_eval_frame``) ~20-40 us on the 2-core CI box: both ``forward_cpu`` and
``torch.compile(forward_native)`` paid it, and ``forward_cpu`` its own ~3 us on top. Here the same
graph is traced once with ``make_fx`` (fake tensors, rows symbolic, the width too for the
width-dynamic families, everything else static) and
compiled with ``torch._inductor.standalone_compile``; a call checks the conditions below and runs
the artifact directly (docs/cpu.md, "Against torch.compile(forward_native)").

Artifacts. One per (function, Inductor options, dtype of every tensor, hidden size, the values of
the non-tensor arguments, one row or more): the graph for two or more rows is dynamic in the rows
(its shape environment assumes ``rows >= 2``, as Dynamo's does: Dynamo specialises size 1), and
one-row calls get a static graph of their own. So a new token count never compiles.

Widths. The norms' families keep the hidden size static (a model constant, which their warm-up
knows from the weight). Width-dynamic families (``dynamic_hidden``: the activations and QuantFP8,
whose width ``customop.warmup`` cannot know) leave the width out of the key: x's last dim (in x,
the row tensors and a ``[hidden]`` weight) is traced as ``quantum * w`` with ``w`` a symbol of its
own (passed to the artifact as its first argument), ``quantum`` the power of two that the plain
trace's guards require the width to be a multiple of (2 for the gated split, the group size for
per-group quant, else 1: indexing by ``quantum * w`` rather than dividing the width ran per-group
quant 1.7-2.4x faster). After the trace and again after Inductor's compile, every guard in ``w``
is kept (``standalone_compile.Widths``); each new width is checked once against them with its value substituted,
for every sample row count where a guard names the rows too (``w >= 2`` always: a shape
environment specialises 0 and 1), and the verdict is cached per width. A width that fails never
gets the shared artifact, so never a wrong result: where only a guard excludes it (Inductor's
fp32 sums are chunked above 4096 elements, decided by a guard on the width), a width-dynamic
artifact of its class, traced at the first such width and shared by every later width it passes
(``_width_class_artifact``); otherwise (not a multiple of the quantum, or below two of it) an
artifact traced for that width alone, or the Dynamo path where that one is refused. Widths 0 and
1 are keyed by value.

Guards: what the artifact's code assumes, and whatever else Dynamo guards on that could change
the result. Any failure returns None and the caller takes the Dynamo path, so a failed guard costs
speed, never a wrong result:

- no tracing or interception around the call: not inside ``torch.compile`` (the caller tests
  that first), no torch-dispatch mode (make_fx, FakeTensorMode), no torch-function mode, no
  functorch transform (vmap, grad), no JIT tracer, autocast off (on any device: one cheap call);
- every tensor a plain ``torch.Tensor`` or ``nn.Parameter`` (a subclass keeps its type through the
  spec and would not through compiled code), on the CPU, contiguous (the strides the graph was
  traced with), without the lazy negation bit, its dtype the artifact's;
- x and every tensor of x's shape: at least 2-D, at least one row, the artifact's hidden size or
  (width-dynamic) a width its guards pass (ranks above 2 run as views of their rows, like the Dynamo path; with ``two_d_only``, for specs
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
whose trace constrains the rows beyond ``>= 2`` (QuantFP8's padding to a token count; checked on
sample row counts at the traced width) is not compiled: its calls take the Dynamo path (remembered per key, logged).

If ``standalone_compile`` is missing (older torch) or fails for a graph, that is logged (once a
process, once a graph) and those calls take the Dynamo path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from customop.backends.cpu.standalone_compile import Widths, compile_graph

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
    hidden size (not with ``dynamic_hidden``), the non-tensor arguments, one row or more (None
    where building failed: those calls take the Dynamo path). Callers keep the object
    (``CpuTiers.standalone_family``), so a call hashes only its shape class.

    ``dynamic_hidden``: the artifacts are traced with the width symbolic too and serve every width
    that passes their recorded width guards (``standalone_compile.Widths``); False: one artifact per
    width. ``aligned``: calls of two or more rows whose width is a multiple of ``_ALIGNED`` run a
    second width-dynamic artifact traced as ``_ALIGNED`` x a symbol (``_aligned_artifact``)."""

    __slots__ = ("form", "options", "dynamic_hidden", "aligned", "artifacts")

    def __init__(self, form: Callable[..., Any], options: dict[str, Any], dynamic_hidden: bool = False,
                 aligned: bool = False) -> None:
        self.form, self.options, self.dynamic_hidden = form, options, dynamic_hidden
        self.aligned = aligned and dynamic_hidden
        self.artifacts: dict[tuple[Any, ...], Any] = {}


_families: dict[tuple[Any, ...], Family] = {}


def family(form: Callable[..., Any], options: dict[str, Any], dynamic_hidden: bool = False,
           aligned: bool = False) -> Family:
    """The one ``Family`` of ``form`` compiled with ``options`` (width-dynamic or per width; with
    ``aligned``, an aligned artifact for widths that are multiples of ``_ALIGNED``)."""
    key = (form, tuple(sorted(options.items())), dynamic_hidden, aligned)
    fam = _families.get(key)
    if fam is None:
        fam = _families[key] = Family(form, dict(options), dynamic_hidden, aligned)
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


def intercepted() -> bool:
    """Whether a torch-dispatch or torch-function mode, a functorch transform, the JIT tracer or
    autocast (any device) is active: each would see or change the spec's operations, which the
    artifact would bypass."""
    return bool(_dispatch_modes() or _function_modes() or _transform() is not None
                or _jit_tracing() is not None or _autocast())


def run(fam: Family, x: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None,
        two_d_only: bool = False) -> Any:
    """``fam.form(x, *args, **kwargs)`` through its artifact, or None when a guard fails (the
    caller then takes the Dynamo path). ~2 us of checks a call. ``kwargs``: non-tensor values only
    (options, dtypes; a tensor among them returns None). ``two_d_only``: x of another rank returns
    None (specs whose outputs do not follow x's leading dims, e.g. QuantFP8's per-tensor scale)."""
    shape = x.shape
    # no mode, transform, tracer or autocast that the artifact would bypass; 1-D x (one token) is
    # left to Dynamo: its weight would look like a row tensor
    if type(x) not in _PLAIN or len(shape) < 2 or (two_d_only and len(shape) != 2) or intercepted():
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
    dynamic_hidden = fam.dynamic_hidden
    # width-dynamic: widths of 2 and more share the key (ShapeEnv specialises sizes 0 and 1)
    key = [x.dtype, None if dynamic_hidden and hidden > 1 else hidden, rows == 1]
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
    key = _with_kwargs(key, kwargs)
    if key is None:
        return None
    art = _artifact(fam, key, x, tensors, args, kwargs, dynamic_hidden and hidden > 1)
    if art is None:
        return None
    if type(art) is not Widths:
        out = art(*tensors)
    elif art.serves(hidden):
        if fam.aligned and not hidden % _ALIGNED and rows > 1 and hidden >= 2 * _ALIGNED and art.quantum < _ALIGNED:
            art = _aligned_artifact(fam, art, hidden, x, tensors, args, kwargs)
        out = art.fn(hidden // art.quantum, *tensors)  # the width symbol's value first
    else:  # a width its guards exclude: the artifact of its width class (or of this width alone),
        # never the shared one, so never a wrong result
        art = _width_class_artifact(fam, tuple(key), hidden, art.quantum, x, tensors, args, kwargs)
        if art is None:
            return None
        out = art.fn(hidden // art.quantum, *tensors) if type(art) is Widths else art(*tensors)
    if isinstance(out, list):
        out = tuple(out)
    if two_d:
        return out
    if isinstance(out, tuple):
        return tuple(t.view(*shape[:-1], t.shape[-1]) for t in out)
    return out.view(*shape[:-1], out.shape[-1])


def run_tokens(fam: Family, tokens: torch.Tensor, args: tuple[Any, ...],
               kwargs: dict[str, Any] | None = None, keep_strides: bool = False) -> Any:
    """``fam.form(tokens, *args, **kwargs)`` through its artifact for specs whose first argument is
    a token tensor: 1-D (rotary's positions ``[T]``) or ``[T, ...]`` of 3+ dims, static past its
    first (ApplyRotaryEmb's x ``[S, heads, head_size]``: its tail shape is in the key; 2-D x is
    ``run``'s), or None where a guard fails (the caller then takes the Dynamo path). Every tensor:
    plain, on the CPU, contiguous (strided ``[T, ...]`` arguments with contiguous rows at a fixed
    stride are traced with their strides, which are in the key; while that artifact does not
    exist, small ones are copied where the contiguous artifact exists, except with
    ``keep_strides`` (warm-up): ``_copied_layout``; other strided ones are copied up to
    ``_COPY_MAX`` elements), no negation bit, autograd not recording for it. Tensor
    arguments of at least 2 dims that start with ``T`` (query, key; ApplyRotaryEmb's cos and sin
    ``[S, rot/2]``) share the token symbol (static in every other dim: the head counts, the head
    size, the rotary width, in the key); the others (the cos/sin cache) are static: their whole
    shape is in the key, as is whether each tensor argument took the token symbol, so a cache
    whose length happens to equal ``T`` gets an artifact of its own. At least one ``[T, ...]``
    argument is required (else: None). Non-tensor arguments as in ``run``. One artifact serves
    every ``T`` of two or more, one more ``T == 1``."""
    if type(tokens) not in _PLAIN or tokens.dim() == 2 or intercepted():
        return None
    grad = _grad()
    shape = tokens.shape
    count = shape[0] if shape else 0
    if (not count or not tokens.is_cpu or not tokens.is_contiguous() or tokens.is_neg()
            or (grad and tokens.requires_grad)):
        return None
    tensors = [tokens]
    key: list[Any] = [_TOKENS, tokens.dtype, count == 1, shape[1:]]
    per_token = False
    strided: list[tuple[int, int]] | None = None  # (index in tensors, in key) of strided [T, ...]
    for a in args:
        kind = type(a)
        if kind is _Tensor or kind is _Parameter:
            if not a.is_cpu or a.is_neg() or (grad and a.requires_grad):
                return None
            if a.dim() >= 2 and a.shape[0] == count:  # query, key, cos, sin: [T, ...]
                row_stride = None
                if not a.is_contiguous():
                    # cos and sin chunked from one gather, q and k sliced from qkv: contiguous rows
                    # at a fixed stride, traced as they are (the stride in the key); another layout
                    # is copied while one thread copies it (32K elements), else Dynamo's path
                    row_stride = _row_stride(a)
                    if row_stride is None:
                        if a.numel() > _COPY_MAX:
                            return None
                        a = a.contiguous()  # the traced layout; a few us, not Dynamo's ~20-40
                    else:
                        if strided is None:
                            strided = []
                        strided.append((len(tensors), len(key) + 3))
                per_token = True
                key += (_PER_TOKEN, a.dtype, a.shape[1:], row_stride)
            elif not a.is_contiguous():
                return None
            else:  # the cache: static
                key += (_STATIC, a.dtype, a.shape)
            tensors.append(a)
        elif kind in _SCALARS or _plain(a):
            key += (kind, a)  # head size, is_neox_style, a None key
        else:
            return None
    if not per_token:
        return None
    key_t = _with_kwargs(list(key) if strided is not None else key, kwargs)
    if key_t is None:
        return None
    if strided is not None and not keep_strides and key_t not in fam.artifacts:
        key_t = _copied_layout(fam, tensors, key, strided, kwargs, key_t)
    art = _artifact(fam, key_t, tokens, tensors, args, kwargs, False)
    if art is None:
        return None
    out = art(*tensors)
    return tuple(out) if isinstance(out, list) else out


def _copied_layout(fam: Family, tensors: list[torch.Tensor], key: list[Any], strided: list[tuple[int, int]],
                   kwargs: dict[str, Any] | None, key_t: tuple[Any, ...]) -> tuple[Any, ...]:
    """``run_tokens``' key for row-strided ``[T, ...]`` arguments whose artifact does not exist
    (warm-up builds those of the layouts it knows: chunked cos/sin, q and k sliced from qkv):
    while each of them has at most ``_COPY_MAX`` elements (one thread copies them) and the
    contiguous artifact exists, they are copied in place in ``tensors`` and that artifact's key
    returned, so that a layout warm-up did not know compiles nothing; otherwise ``key_t`` (the
    strided artifact gets built: a copy above 32K elements opens an OpenMP region of its own,
    which stalled under load)."""
    if any(tensors[i].numel() > _COPY_MAX for i, _ in strided):
        return key_t
    for _, k in strided:
        key[k] = None
    contiguous = _with_kwargs(key, kwargs)
    if contiguous is None or fam.artifacts.get(contiguous) is None:
        return key_t
    for i, _ in strided:
        tensors[i] = tensors[i].contiguous()  # the traced layout; a few us, not Dynamo's ~20-40
    return contiguous


_TOKENS = object()  # marks a token-tensor key (run_tokens)
_PER_TOKEN = object()  # marks a [T, ...] argument's dtype and tail shape in a run_tokens key
_STATIC = object()  # marks a static argument's dtype and shape in a run_tokens key
#: run_tokens copies strided [T, ...] arguments of at most this many elements to the traced
#: contiguous layout where it does not trace them with their strides (``_copied_layout``); a
#: larger one that is not row-strided takes the Dynamo path.
#: ATen copies up to 32K elements in one thread (its grain size); a larger copy opens an OpenMP
#: region of its own, and on a loaded 2-core box each region can stall for a scheduler tick: a
#: copy of 2048 x 64-element cos and sin ran ApplyRotaryEmb's medians at 2-3x torch.compile's
#: (mins equal; BENCHMARKS.md, "issue 18, CPU, sixth day"), so large row-strided ones are traced
#: as they are instead
_COPY_MAX = 1 << 15


def _row_stride(a: torch.Tensor) -> int | None:
    """``a.stride(0)`` where every row of ``a`` (``[T, ...]``, T >= 2) is contiguous and the rows do
    not overlap, the rows at a fixed stride (cos and sin chunked from one ``[T, rot]`` gather, a
    query sliced from qkv); None for any other layout."""
    expected = 1
    for size, stride in zip(reversed(a.shape[1:]), reversed(a.stride()[1:])):
        if size != 1 and stride != expected:
            return None
        expected *= size
    row = a.stride(0)
    return row if row >= expected else None


_PLAIN_VALUES = (*_SCALARS, str, torch.dtype)


def _with_kwargs(key: list[Any], kwargs: dict[str, Any] | None) -> tuple[Any, ...] | None:
    """``key`` with the keyword arguments keyed by value, as a tuple; None where one is not a
    plain value (tensors only as positional arguments: their guards are the callers')."""
    if kwargs:
        for name, value in kwargs.items():
            if not _plain(value):
                return None
            key += (name, type(value), value)
    return tuple(key)


def _artifact(fam: Family, key: tuple[Any, ...], x: torch.Tensor, tensors: list[torch.Tensor],
              args: tuple[Any, ...], kwargs: dict[str, Any] | None, dynamic_hidden: bool) -> Any:
    """The family's artifact for ``key``, built on first use (None: building failed, or an
    unhashable argument, which Dynamo knows what to do with)."""
    try:
        return fam.artifacts[key]
    except KeyError:
        pass
    except TypeError:
        return None
    if not dynamic_hidden:
        art = fam.artifacts[key] = _build(fam, x, tensors, args, kwargs or {}, False)
        return art
    # the shared (width-free) key never holds an artifact whose trace fixed the width (per-group
    # quant one group wide: the group count 1 specialises, and the width with it): that one goes to
    # the width's own slot, and the next width builds the shared one. Before, the first one-row call
    # at 1x128 (per group 128) sent every later one-row width to Dynamo's path: 1x4096 31.5 us
    # against 18.4 when it came first. A refused build (None: the rows constrained, a mutation)
    # stays under the shared key, as before: no width builds it again
    per_width = key + (x.shape[-1],)
    if per_width in fam.artifacts:
        return fam.artifacts[per_width]
    art = _build(fam, x, tensors, args, kwargs or {}, True)
    if art is not None and art.width is None:
        fam.artifacts[per_width] = art
    else:
        fam.artifacts[key] = art
    return art


#: ``Family.aligned``: widths that are a multiple of this run an artifact traced as this x a symbol
#: (a multiple of both vector lengths, 16 fp32 and 32 bf16 lanes). The shared artifact's code tests
#: every vector step of a row for the row's tail (masked loads and stores for a width that is not
#: a multiple of the vector): at 4096x28672 fp32 its silu_and_mul kernel took 30.4-31.3 ms against
#: 29.8 for torch.compile's per-shape code and for the aligned artifact (the kernels alone, into
#: one output; docs/cpu.md, "The 4096x28672 gated rows"). One more artifact per shape class of two
#: or more rows (warm-up's width 256 builds it).
_ALIGNED = 64


def _aligned_artifact(fam: Family, art: Widths, hidden: int, x: torch.Tensor, tensors: list[torch.Tensor],
                      args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Widths:
    """``art``'s aligned counterpart where it serves ``hidden`` (a multiple of ``_ALIGNED``, at
    least two of it), built on first use and kept on ``art``; else ``art`` itself (the aligned
    build refused or failed, logged once, or a width the aligned one's guards exclude)."""
    aligned = art.aligned
    if aligned is None:
        aligned = _build(fam, x, tensors, args, kwargs or {}, True, _ALIGNED)
        # a trace that fixed the width serves only that width; refused: remembered as False
        art.aligned = aligned = aligned if aligned is not None and aligned.quantum >= _ALIGNED else False
    if aligned is not False and aligned.serves(hidden):
        return aligned
    return art


_CLASSES = object()  # marks a key's list of width-class artifacts (``_width_class_artifact``)
#: the width of a class artifact traced at a multiple of it is traced as that multiple of a symbol
#: (``compile_graph``'s ``aligned``): the vector loops then have no tails. gelu_and_mul_sparse's
#: two-pass form at 256x28672 fp32: 1910 us p5 against 2123 with the plain quantum (per-width
#: artifact 1938); 512x8192 bf16 985 against 1040 (969); bitwise the same (2 threads)
_CLASS_ALIGNMENT = 64


def _width_class_artifact(fam: Family, key: tuple[Any, ...], hidden: int, quantum: int, x: torch.Tensor,
                          tensors: list[torch.Tensor], args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Any:
    """For a width the key's first width-dynamic artifact excludes, kept per width: where the
    width is one the symbol can take (a multiple of ``quantum``, at least 2 of it) and only a
    guard excludes it, the width-dynamic artifact among those traced at such widths whose guards
    pass it, else one traced at this width; otherwise, or where that build fails, an artifact of
    this width alone (static), as for every excluded width before (None: building failed,
    Dynamo's path). Inductor splits some graphs in width classes (an fp32 sum over more than
    4096 elements is chunked, decided by a guard on the width: gelu_and_mul_sparse's row
    statistics), so a width of the other class shares one artifact with its class (which warm-up
    can build) instead of compiling one per width. A class artifact traced at a multiple of
    ``_CLASS_ALIGNMENT`` serves only such widths (an unaligned one gets a class artifact of its
    own): with the vector tails gone its code runs as fast as a per-width artifact's."""
    per_width = key + (hidden,)
    if per_width in fam.artifacts:
        return fam.artifacts[per_width]
    art = None
    if hidden % quantum == 0 and hidden // quantum >= 2:
        classes = fam.artifacts.setdefault(key + (_CLASSES,), [])
        if hidden % _CLASS_ALIGNMENT == 0 and hidden // _CLASS_ALIGNMENT >= 2:
            # an aligned width takes an aligned class artifact, though a plain one may serve it
            art = next((c for c in classes if c.quantum >= _CLASS_ALIGNMENT and c.serves(hidden)), None)
        else:
            art = next((c for c in classes if c.serves(hidden)), None)
        if art is None:
            art = _build(fam, x, tensors, args, kwargs or {}, True, _CLASS_ALIGNMENT)
            if art is not None:
                classes.append(art)
    if art is None:
        art = _build(fam, x, tensors, args, kwargs or {}, False)
    fam.artifacts[per_width] = art
    return art


def _plain(value: Any) -> bool:
    """A value the graph may bake in, keyed by value: a scalar, a string, a dtype, or a tuple of
    those (GroupShape). Anything else (a tensor, a container of tensors, an object) is not."""
    if type(value) in _PLAIN_VALUES:
        return True
    return isinstance(value, tuple) and all(type(v) in _PLAIN_VALUES for v in value)


_WEIGHT = object()  # marks a [hidden] tensor's dtype in a key (a row tensor's stands alone)
_ONE = object()  # marks a one-element tensor's rank and dtype in a key


def _build(fam: Family, x: torch.Tensor, tensors: list[torch.Tensor], args: tuple[Any, ...],
           kwargs: dict[str, Any], dynamic_hidden: bool, aligned: int = 1) -> Any:
    """The artifact for this call's key (a ``Widths`` when ``dynamic_hidden``, its width traced as
    a multiple of ``aligned`` where this width is one: ``compile_graph``), or None (logged) where
    it cannot be built."""
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
        art = compile_graph(compile_fn, form, fam.options, tensors, args, kwargs, dynamic_hidden, aligned)
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
