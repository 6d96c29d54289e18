"""The case tables as rows for the backend tiers that serve ``customop::`` ops with kernels of
their own outside the Triton ones: the TPU (Pallas kernels behind the ``xla`` keys, in interpret
mode) and the XPU (IPEX's functions). A backend test takes the rows whose ``library_op`` it has a
kernel for, builds each on the CPU (``make``), runs it its own way and judges the result with
the float64 references of ``tests/cases`` (``judge``). A new row in a family's table
(``customop/samples/<family>.py``) is therefore run by every backend tier with no test edit; a
new family with such kernels adds its adapter below.

Each adapter knows, for its family: which ``SIZES`` entry gives the shapes, which
``customop::`` op ``forward_kernel`` calls for a row (``None``: the spec runs everywhere), how to
build the op and its call's arguments, and which reference judges the outputs.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from customop.platforms import current_platform
from customop.samples import activation, layernorm, quant, rotary
from tests.cases import activation as act_ref
from tests.cases import layernorm as norm_ref
from tests.cases import quant as quant_ref
from tests.cases import rotary as rope_ref

#: the fp8 dtype of the quant rows (the one every backend here writes; torch_xla has no fnuz)
FP8 = torch.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class Row:
    """One table row at one input size (for the rotary table the size is the row itself)."""

    family: str
    case: Any
    shape: Any
    is_neox: bool | None = None  # rotary rows: the pairing style
    index: int = 0  # which of the tier's sizes for this row's case
    last: bool = True  # the last of them

    @property
    def library_op(self) -> str | None:
        """The ``customop::`` op ``forward_kernel`` calls for this row (None: the spec runs)."""
        return FAMILIES[self.family].library_op(self.case)

    @property
    def distinct_kernel_call(self) -> bool:
        return FAMILIES[self.family].distinct(self.case)

    @property
    def id(self) -> str:
        if self.family == "rotary":
            return f"{self.case.label}-{rotary.style_id(self.is_neox)}"
        return f"{self.case.label}-{'x'.join(map(str, self.shape))}"

    @property
    def seed(self) -> int:
        return zlib.crc32(self.id.encode())


@dataclasses.dataclass(frozen=True)
class Family:
    rows: Callable[[str], list[Row]]
    library_op: Callable[[Any], str | None]
    #: (row, dtype, generator) -> (op, the forward's positional arguments, its keyword arguments)
    make: Callable[[Row, torch.dtype, torch.Generator], tuple[Any, tuple, dict]]
    #: (row, op, arguments as they were before the call, output, dtype, spec_rounding) -> None
    judge: Callable[..., None]
    #: False for a row whose kernel call another row makes already (quant rows that differ only
    #: in the Python around the call): a kernel test runs one of them
    distinct: Callable[[Any], bool] = lambda case: True


# ---- activation --------------------------------------------------------------------------------


def _act_make(row, dtype, gen):
    return row.case.build(), (row.case.input(row.shape, dtype, generator=gen),), {}


def _act_judge(row, op, args, out, dtype, spec_rounding):
    act_ref.assert_matches(row.case, op, args[0], out, spec_rounding=spec_rounding)


# ---- layernorm ---------------------------------------------------------------------------------


def _norm_make(row, dtype, gen):
    op = row.case.build(row.shape[-1], dtype, gen)
    return op, row.case.inputs(row.shape, dtype, generator=gen), dict(getattr(row.case, "call_kwargs", {}))


def _norm_judge(row, op, args, out, dtype, spec_rounding):
    norm_ref.assert_matches(out, norm_ref.reference(row.case, op, *args), dtype, what=row.case.label)


# ---- rotary ------------------------------------------------------------------------------------


def _rope_rows(size):
    rows = rotary.SIZES[size]
    return [Row("rotary", case, case, is_neox, i, i == len(rows) - 1)
            for i, case in enumerate(rows) for is_neox in case.styles()]


def _rope_make(row, dtype, gen):
    return row.case.build(row.is_neox, dtype), row.case.inputs(dtype, generator=gen), {}


def _rope_judge(row, op, args, out, dtype, spec_rounding):
    rope_ref.check_rope_outputs(op, *args, *out, products_rounded=spec_rounding)


# ---- fp8 quant ---------------------------------------------------------------------------------


def _quant_make(row, dtype, gen):
    x = row.case.input(row.shape, dtype, generator=gen)
    kwargs = row.case.call_kwargs(x, quant_ref.FP8_MAX[FP8])
    platform = current_platform()  # a forced accelerator platform stays (its forward), else the CPU's with FP8
    op = quant_ref.build(row.case, FP8, None if platform.is_cpu() else platform)
    return op, (x, kwargs.get("scale"), kwargs.get("scale_ub")), {}


def _quant_judge(row, op, args, out, dtype, spec_rounding, exact_fp8=True, strides=True):
    x, scale, scale_ub = args
    kwargs = {k: v for k, v in (("scale", scale), ("scale_ub", scale_ub)) if v is not None}
    judge_quant(row.case, x, out, kwargs, exact_fp8, strides)


def judge_quant(case, x: torch.Tensor, out, kwargs: dict, exact: bool, strides: bool = True) -> None:
    """``(q, scale)`` of ``case`` on ``x``. ``exact``: the scales exactly and q bit for bit
    (``check_against_reference``). Else the table's comparison for vendor kernels
    (``compare_quant``: scales to float32 precision, q dequantized within one fp8 ulp) against
    the float64 reference: XLA divides by a constant as a multiply by its rounded reciprocal,
    which leaves ``amax / fp8_max`` an ulp off the correctly rounded quotient the spec computes
    (measured on the XLA CPU device and in Pallas interpret mode). ``strides``: check the
    column-major scales' layout (not observable on XLA tensors: they come back contiguous)."""
    if exact:
        quant_ref.check_against_reference(case, x, out, FP8, kwargs)
        return
    q, s = out
    static, group = case.init["static"], case.group_size
    want_s = kwargs["scale"] if static else quant_ref.ref_scales(case, x, FP8, kwargs.get("scale_ub"))
    want_q = quant_ref.ref_q(x, want_s, FP8, divide=group is not None and not static, group_size=group)
    if q.shape[0] > want_q.shape[0]:  # token padding: zero rows
        pad = torch.zeros((q.shape[0] - want_q.shape[0], *want_q.shape[1:])).to(FP8)
        want_q = torch.cat([want_q, pad])
    if strides and case.init.get("column_major_scales"):
        assert s.stride(-2) == 1 or s.shape[-2] == 1, f"column-major scales expected, strides {s.stride()}"
    want_s = torch.empty_strided(s.shape, s.stride()).copy_(want_s.reshape(s.shape))  # the layout is checked above
    quant.compare_quant((q, s), (want_q, want_s), x.dtype, group_size=group)


def _shaped(family, cases, shapes):
    """A row per case and shape; ``shapes(case)`` lists the case's shapes."""
    return [Row(family, case, shape, index=i, last=i == len(shapes(case)) - 1)
            for case in cases for i, shape in enumerate(shapes(case))]


def _shaped_rows(family, table):
    return lambda size: _shaped(family, table.CASES, lambda case: case.shapes(size))


FAMILIES: dict[str, Family] = {
    "activation": Family(_shaped_rows("activation", activation), lambda c: c.op, _act_make, _act_judge),
    "layernorm": Family(lambda size: _shaped("layernorm", layernorm.CASES, lambda case: layernorm.SIZES[size]),
                        lambda c: c.library_op, _norm_make, _norm_judge),
    "rotary": Family(_rope_rows, lambda c: "rotary_embedding", _rope_make, _rope_judge),
    "quant": Family(_shaped_rows("quant", quant), lambda c: c.kernel, _quant_make, _quant_judge,
                    lambda c: c in quant.KERNEL_CASES),
}


def params(size: str, keep: Callable[[Row], bool] = lambda row: True,
           dtypes: tuple[torch.dtype, ...] | None = None, last_only: bool = False) -> list:
    """``pytest.param(row)`` for every family's rows of ``SIZES[size]`` that ``keep`` accepts.

    With ``dtypes``: ``pytest.param(row, dtype)``, every table row at every size once, the dtype
    turning with the row and the size (row k at size i: ``dtypes[(k + i) % len(dtypes)]``), so
    that each family runs every dtype at every size without the product: a new compile per shape
    and dtype is what costs on the emulated tiers. ``last_only``: each table row once, at its
    last size."""
    out = []
    for family in FAMILIES.values():
        variants: dict[Any, int] = {}  # table row (for the rotary table: the style) -> its ordinal k
        for row in family.rows(size):
            k = variants.setdefault(row.is_neox if row.family == "rotary" else row.case.label, len(variants))
            if not keep(row) or (last_only and not row.last):
                continue
            name = f"{row.family}:{row.id}"
            if dtypes is None:
                out.append(pytest.param(row, id=name))
                continue
            dtype = dtypes[(k + row.index) % len(dtypes)]
            out.append(pytest.param(row, dtype, id=f"{name}-{str(dtype).removeprefix('torch.')}"))
    return out


def make(row: Row, dtype: torch.dtype) -> tuple[Any, tuple, dict]:
    """The row's op (built under the caller's platform and config) and its call's positional and
    keyword arguments, on the CPU, from a seed of the row's own."""
    return FAMILIES[row.family].make(row, dtype, torch.Generator().manual_seed(row.seed))


def snapshot(op: Any, args: tuple) -> tuple[Any, tuple]:
    """CPU copies of the op and its arguments for judging, taken before a run that may move the
    op to a device or write into the arguments."""
    return copy.deepcopy(op), tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def judge(row: Row, op: Any, args: tuple, out: Any, dtype: torch.dtype, spec_rounding: bool,
          exact_fp8: bool = True, strides: bool = True) -> None:
    """``out`` (CPU tensors) of ``op`` on ``args`` (as they were before the call) against the row's
    float64 reference. ``spec_rounding``: the path may run the spec's math and round where it
    does (the rotary products, the activations' ``SPEC_SLACK``); a kernel that computes in fp32
    and rounds once is held to the tighter bound. ``exact_fp8``: quant rows bit for bit (else
    ``judge_quant``'s vendor comparison); ``strides``: the scales' layout is observable."""
    kwargs = {"exact_fp8": exact_fp8, "strides": strides} if row.family == "quant" else {}
    FAMILIES[row.family].judge(row, op, args, out, dtype, spec_rounding, **kwargs)


@contextlib.contextmanager
def as_cpu_kernel(op_name: str, kernel: Callable) -> Iterator[list[int]]:
    """Within the block ``torch.ops.customop.<op_name>`` runs ``kernel`` (a backend's kernel for
    its own device) on CPU tensors; the yielded list counts the calls, to prove the kernel, not
    the reference, ran. On exit the op's reference implementation is back."""
    calls: list[int] = []

    def counted(*args):
        calls.append(1)
        return kernel(*args)

    lib = torch.library.Library("customop", "IMPL")
    try:
        lib.impl(op_name, counted, "CPU")
        yield calls
    finally:
        lib._destroy()
