"""Test helpers shared by customop's own tests, ``customop check`` and out-of-tree vendors.

- ``TOLERANCES``: (atol, rtol) per dtype, with the reasoning next to each entry.
- ``oracle``: runs a float64 reference on float64 copies of the inputs.
- ``assert_close`` / ``mismatch_report``: compare and say where and how much.
- input factories: ``randn``, ``poisoned``.
- samples: each op family registers ``OpSample`` builders (``customop/samples/``) so that
  ``assert_conforms`` and ``customop check`` can run any registered op on random inputs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

# (atol, rtol). A kernel and a float64 oracle each round once to the output dtype, so the bound is
# about two ulps of the output dtype relative (rtol) plus an absolute floor for results near zero,
# where relative error is meaningless (rounding of intermediates dominates there).
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    # fp32 ulp is 2^-23 (1.2e-7); reductions over ~8k elements in a different order add ~1e-6.
    torch.float32: (1e-5, 1e-5),
    # fp16 ulp is 2^-10 (9.8e-4): two ulps relative; intermediates rounded to fp16 near zero.
    torch.float16: (1e-3, 2e-3),
    # bf16 ulp is 2^-7 (7.8e-3) at 1.0; 2 ulps relative. The Triton interpreter truncates
    # fp32->bf16 instead of rounding it, which is still within one ulp.
    torch.bfloat16: (1e-2, 1.6e-2),
    # fp8 outputs are compared dequantized: e4m3 has 3 mantissa bits, one ulp is 2^-3 relative.
    torch.float8_e4m3fn: (1e-2, 0.125),
    torch.float8_e4m3fnuz: (1e-2, 0.125),
}

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
POISON = float("nan")


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    if dtype not in TOLERANCES:
        raise KeyError(f"customop.testing: no tolerance for {dtype}; known: {list(TOLERANCES)}")
    return TOLERANCES[dtype]


# ---- inputs ---------------------------------------------------------------------------------


def randn(*shape: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
          scale: float = 1.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """Normal random values, drawn in fp32 and cast (so every dtype sees the same numbers)."""
    x = torch.randn(*shape, dtype=torch.float32, generator=generator) * scale
    return x.to(device=device, dtype=dtype)


def poisoned(shape: Sequence[int], dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
    """An output buffer full of NaN (or 0x7f.. bits for non-float dtypes): unwritten lanes show."""
    if dtype.is_floating_point and dtype not in FP8_DTYPES:
        return torch.full(tuple(shape), POISON, dtype=dtype, device=device)
    return torch.full(tuple(shape), 0x7F, dtype=torch.uint8, device=device).view(dtype) \
        if dtype.itemsize == 1 else torch.full(tuple(shape), -1, dtype=dtype, device=device)


def to64(value: Any) -> Any:
    """Float tensors (nested in tuples/lists/dicts too) to float64; everything else unchanged."""
    if isinstance(value, torch.Tensor):
        return value.double() if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(to64(v) for v in value)
    if isinstance(value, dict):
        return {k: to64(v) for k, v in value.items()}
    return value


def oracle(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Runs ``fn`` on float64 copies of every float tensor argument."""
    return fn(*to64(args), **to64(kwargs))


# ---- comparison -----------------------------------------------------------------------------


def _as_float(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64) if t.is_floating_point() else t


def mismatch_report(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float,
                    max_items: int = 5) -> str | None:
    """None when close; else a report with the count, the worst indices and their values."""
    if actual.shape != expected.shape:
        return f"shape mismatch: got {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    a, e = _as_float(actual.detach().cpu()), _as_float(expected.detach().cpu())
    if not a.is_floating_point():
        bad = a != e
        if not bad.any():
            return None
        idx = bad.nonzero()[:max_items].tolist()
        return f"{int(bad.sum())} of {a.numel()} differ; first at {idx}"
    err = (a - e).abs()
    bound = atol + rtol * e.abs()
    bad = ~(err <= bound) & ~(a.isnan() & e.isnan())
    bad |= a.isnan() ^ e.isnan()
    if not bad.any():
        return None
    n_bad = int(bad.sum())
    finite_err = torch.where(bad, err.nan_to_num(float("inf")), torch.zeros_like(err))
    worst = finite_err.flatten().topk(min(max_items, n_bad)).indices
    lines = [f"{n_bad} of {a.numel()} elements exceed atol={atol:g} rtol={rtol:g}; "
             f"max abs err {float(err.nan_to_num(float('inf')).max()):.4g}"]
    for flat in worst.tolist():
        where = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape))
        lines.append(f"  at {where}: got {a.flatten()[flat].item():.6g}, expected {e.flatten()[flat].item():.6g}")
    return "\n".join(lines)


def assert_close(actual: Any, expected: Any, dtype: torch.dtype | None = None,
                 atol: float | None = None, rtol: float | None = None, what: str = "output") -> None:
    """Compares tensors (or tuples of them) under the dtype's tolerance; fp8 is compared dequantized
    by the caller. ``None`` must match ``None``."""
    if isinstance(actual, (tuple, list)):
        if not isinstance(expected, (tuple, list)) or len(actual) != len(expected):
            raise AssertionError(f"{what}: got {len(actual)} outputs, expected {expected!r}")
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_close(a, e, dtype, atol, rtol, what=f"{what}[{i}]")
        return
    if actual is None or expected is None:
        if actual is not expected:
            raise AssertionError(f"{what}: got {actual!r}, expected {expected!r}")
        return
    d_atol, d_rtol = tolerance(dtype or actual.dtype)
    report = mismatch_report(actual, expected, d_atol if atol is None else atol, d_rtol if rtol is None else rtol)
    if report:
        raise AssertionError(f"{what} ({actual.dtype}, shape {tuple(actual.shape)}): {report}")


def max_error(actual: Any, expected: Any) -> float:
    """The largest absolute difference over (nested) float tensors; 0.0 for no tensors."""
    if isinstance(actual, (tuple, list)):
        return max((max_error(a, e) for a, e in zip(actual, expected)), default=0.0)
    if not isinstance(actual, torch.Tensor):
        return 0.0
    return float((_as_float(actual.cpu()) - _as_float(expected.cpu())).abs().max()) if actual.numel() else 0.0


# ---- samples and conformance ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sample:
    """One way to call an op: constructor kwargs, call arguments, and weights to load."""

    init_kwargs: dict[str, Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    state: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    #: Compares outputs; defaults to ``assert_close`` under the input dtype's tolerance.
    compare: Callable[[Any, Any, torch.dtype], None] | None = None
    label: str = ""


#: builder(dtype, device, generator) -> list of Samples
SampleBuilder = Callable[[torch.dtype, str, torch.Generator], list[Sample]]


@dataclasses.dataclass(frozen=True)
class OpSamples:
    op: str
    build: SampleBuilder
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES


_SAMPLES: dict[str, OpSamples] = {}


def register_samples(op: str, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES) -> Callable[[SampleBuilder], SampleBuilder]:
    """Decorator for a sample builder of the registered op ``op``."""

    def decorator(fn: SampleBuilder) -> SampleBuilder:
        _SAMPLES[op] = OpSamples(op, fn, tuple(dtypes))
        return fn

    return decorator


def op_samples(op: str) -> OpSamples | None:
    importlib.import_module("customop.samples")  # registers the in-tree builders
    return _SAMPLES.get(op)


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_clone(v) for v in value)
    return value


@contextlib.contextmanager
def forced_platform(platform: Any) -> Iterator[Any]:
    """Temporarily makes ``platform`` (a Platform object or a built-in name) the current one."""
    from customop import platforms

    if isinstance(platform, str):
        platform = platforms.BUILTIN_PLATFORMS[platform]()
    previous = platforms._current
    platforms.set_current_platform(platform)
    try:
        yield platform
    finally:
        platforms.set_current_platform(previous)


def build_op(op_cls: type, sample: Sample, device: str) -> Any:
    """Builds ``op_cls`` enabled (under ``custom_ops=["all"]``) and loads the sample's weights."""
    from customop.config import Config, use_config

    with use_config(Config(custom_ops=["all"])):
        op = op_cls(**sample.init_kwargs)
    op.to(device)
    with torch.no_grad():
        for key, value in sample.state.items():
            target = op.get_parameter(key) if key in dict(op.named_parameters()) else op.get_buffer(key)
            target.copy_(value)
    return op


def run_conformance(op_cls: type, platform: Any = None, dtypes: Sequence[torch.dtype] | None = None,
                    device: str = "cpu", seed: int = 0) -> Iterator[tuple[str, torch.dtype, str, float, str | None]]:
    """Yields (label, dtype, method run, max error, failure or None) for each sample and dtype."""
    from customop.custom_op import CustomOp

    name = op_cls.name
    samples = op_samples(name)
    if samples is None:
        raise LookupError(f"customop.testing: no samples registered for op {name!r}")
    in_tree = CustomOp.op_registry[name]
    ctx = forced_platform(platform) if platform is not None else contextlib.nullcontext()
    with ctx:
        for dtype in dtypes or samples.dtypes:
            gen = torch.Generator().manual_seed(seed)
            for sample in samples.build(dtype, device, gen):
                op = build_op(op_cls, sample, device)
                method = getattr(op._forward_method, "__name__", str(op._forward_method))
                yield (sample.label, dtype, method, *_compare_once(op, in_tree, sample, dtype))


def _compare_once(op: Any, in_tree: type, sample: Sample, dtype: torch.dtype) -> tuple[float, str | None]:
    """(max error, failure or None) of ``op``'s resolved forward against the in-tree spec."""
    try:
        got_args, want_args = _clone((sample.args, sample.kwargs)), _clone((sample.args, sample.kwargs))
        with torch.no_grad():  # inference ops; parameters must not drag autograd into the check
            got = op(*got_args[0], **got_args[1])
            want = in_tree.forward_native(op, *want_args[0], **want_args[1])
        (sample.compare or (lambda a, e, d: assert_close(a, e, d)))(got, want, dtype)
        _compare_written(_tensors((sample.args, sample.kwargs)), _tensors(got_args), _tensors(want_args), dtype)
        return max_error(got, want), None
    except Exception as err:  # reported, not raised: the caller decides
        return float("nan"), f"{type(err).__name__}: {err}"


def _tensors(value: Any) -> list[tuple[str, torch.Tensor]]:
    """The tensors of nested args/kwargs, each with its place (``args[2]``, ``kwargs['cache']``)."""
    args, kwargs = value
    return ([(f"args[{i}]", a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
            + [(f"kwargs[{k!r}]", v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equal (NaN poison included), for any dtype."""
    flat = [t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(*flat)


def _compare_written(original: list, got: list, want: list, dtype: torch.dtype) -> None:
    """The inputs that the spec writes in place (state caches, in-place outputs) must end up the
    same on the path under test, all of each tensor: a write to another request's or the padding
    slot fails here. Inputs the spec leaves alone are not compared (a kernel may write its
    documented in-place results into them, e.g. the fused residual add)."""
    for (where, before), (_, g), (_, w) in zip(original, got, want):
        if _same_bits(before, w):
            continue
        if w.is_floating_point():  # the tolerance of the call's dtype, relative to the tensor's scale
            atol, rtol = tolerance(dtype)
            scale = max(float(w.double().nan_to_num(0.0).abs().max()), 1.0)
            assert_close(g, w, dtype, atol=atol * scale, rtol=rtol, what=f"{where} (written in place)")
        else:
            assert_close(g, w, what=f"{where} (written in place)")


def assert_conforms(op_cls: type, platform: Any = None, dtypes: Sequence[torch.dtype] | None = None,
                    device: str = "cpu", seed: int = 0) -> None:
    """Runs ``op_cls``'s resolved forward against the in-tree ``forward_native`` on the op's
    registered samples in every supported dtype; raises with every failure listed.

    Out-of-tree vendors call this on their replacement class, e.g.
    ``assert_conforms(MyRMSNorm, platform=MyPlatform(), device="npu")``.
    """
    failures = [f"{label or 'sample'} {dtype}: {err}"
                for label, dtype, _m, _e, err in run_conformance(op_cls, platform, dtypes, device, seed) if err]
    if failures:
        raise AssertionError(f"{op_cls.__qualname__} does not conform:\n" + "\n".join(failures))


#: The paths a bad input is sent through here: the spec, the CPU tiers, and the accelerator
#: call (``forward_kernel``: its validation runs before the kernel, on any device's tensors).
ERROR_PATHS = ("forward_native", "forward_cpu", "forward_kernel")


def assert_same_error(op: Any, args: Sequence[Any], error: type[BaseException], match: str,
                      kwargs: dict[str, Any] | None = None) -> list[str]:
    """Sends one bad input through every path ``op`` has here and asserts each raises ``error``
    with a message matching ``match`` (a regex), never a result. Returns the paths checked."""
    import re

    checked = []
    for path in ERROR_PATHS:
        method = getattr(op, path, None)
        if method is None:
            continue
        try:
            method(*_clone(tuple(args)), **(kwargs or {}))
        except error as err:
            if not re.search(match, str(err)):
                raise AssertionError(f"{type(op).__name__}.{path}: {error.__name__} {str(err)!r} does not match "
                                     f"{match!r}") from err
        except Exception as err:  # noqa: BLE001  (any other exception is the failure being reported)
            raise AssertionError(f"{type(op).__name__}.{path} raised {type(err).__name__}: {err}; "
                                 f"expected {error.__name__} matching {match!r}") from err
        else:
            raise AssertionError(f"{type(op).__name__}.{path} returned a result for a bad input; "
                                 f"expected {error.__name__} matching {match!r}")
        checked.append(path)
    return checked
