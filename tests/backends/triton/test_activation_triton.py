"""The activation kernels (backends/triton/activation.py, _activation_kernels.py) under the Triton
interpreter: every case of the table (``customop/samples/activation.py``) through
``forward_kernel`` (the launcher as the CPU kernel of its ``customop::`` op) against the float64
references (``tests/cases/activation.py``), then the launchers directly (strided inputs, tilings,
the looped variant) and through ``torch.ops.customop.*`` (opcheck, torch.compile)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import triton
import triton.language as tl

from customop.backends.triton import _tuning
from customop.backends.triton import activation as act
from customop.ops.activation import SituAndMul
from customop.samples.activation import BY_LABEL, CASES, DTYPES, ActivationCase
from customop.testing import assert_close
from tests.backends.triton.conftest import as_cpu_kernel
from tests.cases.activation import assert_matches, reference

pytestmark = pytest.mark.interpret

LAUNCHERS = {name.removeprefix("customop::"): launcher for name, launcher in act.KERNELS.items()}


def build(case: ActivationCase):
    return case.build()


def kernel_args(op) -> tuple:
    """The library op's arguments after x, as ``forward_kernel`` passes them."""
    return tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in op.math_args())


def run_launcher(case: ActivationCase, x: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(the launcher's output on x, the float64 reference)."""
    op = build(case)
    return LAUNCHERS[case.op](x, *kernel_args(op), **kwargs), reference(case, x.double(), op)


PARAMS = [pytest.param(c, s, id=f"{c.label}-{'x'.join(map(str, s))}") for c in CASES for s in c.shapes("small")]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case,shape", PARAMS)
def test_kernel_matches_float64_reference(case, shape, dtype, poison_empty):
    op = build(case)
    x = case.input(shape, dtype)
    x_before = x.clone()
    with as_cpu_kernel(case.op, LAUNCHERS[case.op]) as calls, torch.no_grad():
        out = op.forward_kernel(x)
    assert len(calls) == 1, "forward_kernel did not reach the Triton launcher"
    assert out.is_contiguous()
    assert_matches(case, op, x, out)
    assert torch.equal(x, x_before), f"{case.label} mutated its input"


def _input(shape, dtype, scale=2.0):
    return (torch.randn(shape, dtype=torch.float32) * scale).to(dtype)


@pytest.mark.parametrize("label", ["silu_and_mul", "mul_and_silu", "swigluoai_and_mul", "swiglustep_and_mul",
                                   "silu_and_mul_with_clamp[1.702,1]", "situ_and_mul[4,25]",
                                   "gelu_and_mul_sparse[0.95]"])
def test_gated_row_strided_input(label, poison_empty):
    """A slice of a wider buffer (row stride > 2d) is read in place, not copied wrong."""
    wide = _input((9, 2 * 300 + 40), torch.float32)
    x = wide[:, : 2 * 300]
    assert not x.is_contiguous()
    out, expected = run_launcher(BY_LABEL[label], x)
    assert_close(out, expected, torch.float32)


def test_unary_non_contiguous_input(poison_empty):
    x = _input((40, 33), torch.float32).t()
    out, expected = run_launcher(BY_LABEL["gelu_new"], x)
    assert out.shape == x.shape
    assert_close(out, expected, torch.float32)


#: the gated launches that take a tiling: label -> (x, op, config) -> output
TILED = {
    "silu_and_mul": lambda x, op, cfg: act._and_mul(x, act.SILU, config=cfg),
    "gelu_and_mul[tanh]": lambda x, op, cfg: act._and_mul(x, act.GELU_TANH, config=cfg),
    "swiglustep_and_mul": lambda x, op, cfg: act._and_mul(x, act.SWIGLUSTEP, param=op.limit, config=cfg),
    "silu_and_mul_with_clamp[1.702,1]":
        lambda x, op, cfg: act.silu_and_mul_with_clamp(x, *kernel_args(op), config=cfg),
    "situ_and_mul[4,25]": lambda x, op, cfg: act.situ_and_mul(x, *kernel_args(op), config=cfg),
    "swigluoai_and_mul": lambda x, op, cfg: act.swigluoai_and_mul(x, *kernel_args(op), config=cfg),
}


@pytest.mark.parametrize("config", [_tuning.TileConfig(2, 64, 1), _tuning.TileConfig(1, 512, 2), _tuning.TileConfig(4, 32, 1),
                                    _tuning.TileConfig(2, 64, 1, grid2d=True, const_width=True)], ids=str)
@pytest.mark.parametrize("label", list(TILED))
def test_gated_tile_configs(label, config, poison_empty):
    """Other tilings than the table's pick (what --sweep may select) give the same result."""
    case = BY_LABEL[label]
    op = build(case)
    x = _input((5, 2 * 200), torch.float32)
    assert_close(TILED[label](x, op, config), reference(case, x.double(), op), torch.float32)


def spy_launches(monkeypatch, name: str) -> list[dict]:
    """Replaces the Triton kernel ``act.<name>`` by a pass-through that records each launch's
    keyword arguments (the constexprs the launcher picked) in the returned list."""
    launches, kernel = [], getattr(act, name)

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(kwargs)
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(act, name, Spy())
    return launches


# (rows, d, config) -> (EVEN, INT64) the launcher must pick
_TILE_CODEGEN = [
    ((4, 256), _tuning.TileConfig(2, 64, 1), (True, False)),  # the tile divides the output: no checks
    ((5, 200), _tuning.TileConfig(2, 64, 1), (False, False)),  # neither rows nor columns divide
    ((5, 256), _tuning.TileConfig(2, 64, 2), (False, False)),  # only the rows do not
    ((4, 200), _tuning.TileConfig(1, 128, 2), (False, False)),  # only the columns do not
    ((4, 256), _tuning.TileConfig(2, 64, 1, int32=False), (True, True)),  # 64-bit forced
    ((5, 200), _tuning.TileConfig(4, 32, 1, even=False, int32=False), (False, True)),  # the previous code
    ((4, 256), _tuning.TileConfig(2, 64, 1, even=False), (False, False)),
    ((5, 200), _tuning.TileConfig(2, 64, 1, evict=False), (False, False)),  # no eviction hint
    ((4, 256), _tuning.TileConfig(2, 64, 1, evict=False), (True, False)),
    ((5, 200), _tuning.TileConfig(2, 64, 1, grid2d=True), (False, False)),  # (column, row) block grid
    ((4, 256), _tuning.TileConfig(2, 64, 1, grid2d=True), (True, False)),
    ((1, 200), _tuning.TileConfig(1, 64, 1, grid2d=True, evict=False), (False, False)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,config,expect", _TILE_CODEGEN,
                         ids=[f"{r}x{d}-{c.block_m}x{c.block_n}-even{e}-int64{i}" for (r, d), c, (e, i) in _TILE_CODEGEN])
@pytest.mark.parametrize("label", ["silu_and_mul", "gelu_and_mul[tanh]", "swigluoai_and_mul"])
def test_gated_tile_codegen_knobs(label, shape, config, expect, dtype, monkeypatch, poison_empty):
    """The gated tile kernels' code generation (no bounds checks when the tile divides the
    output, 32- / 64-bit offsets, the eviction hint) on odd shapes: the launcher picks the expected
    constexprs and the output (allocated NaN-poisoned) matches the float64 reference."""
    launches = spy_launches(monkeypatch, "_swigluoai_kernel" if label == "swigluoai_and_mul" else "_and_mul_kernel")
    case = BY_LABEL[label]
    op = build(case)
    rows, d = shape
    x = _input((rows, 2 * d), dtype)
    got = TILED[label](x, op, config)
    assert [(k["EVEN"], k["INT64"], k["EVICT"]) for k in launches] == [(*expect, "evict_first" if config.evict else "")]
    assert_close(got, reference(case, x.double(), op).to(dtype), dtype)


# (numel, config) -> (EVEN, INT64) the unary launcher must pick
_FLAT_CODEGEN = [
    (4096, _tuning.TileConfig(1, 1024, 4), (True, False)),  # the block divides numel: no checks
    (4231, _tuning.TileConfig(1, 1024, 4), (False, False)),
    (7, _tuning.TileConfig(1, 1024, 4, evict=False), (False, False)),
    (2048, _tuning.TileConfig(1, 512, 1, even=False, int32=False), (False, True)),  # the previous code
    # relu2's light class: 4096-element blocks at 8 warps, whole and with a tail
    (12288, _tuning.TileConfig(1, 4096, 8, evict=False), (True, False)),
    (8231, _tuning.TileConfig(1, 4096, 8, evict=False), (False, False)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("numel,config,expect", _FLAT_CODEGEN,
                         ids=[f"{n}-{c.block_n}-even{e}-int64{i}-evict{c.evict}" for n, c, (e, i) in _FLAT_CODEGEN])
@pytest.mark.parametrize("label", ["quick_gelu", "relu2", "gelu_new"])
def test_unary_flat_codegen_knobs(label, numel, config, expect, dtype, monkeypatch, poison_empty):
    """The unary kernel's code generation (no bounds checks when the block divides numel, 32- /
    64-bit offsets, the eviction hint): the expected constexprs, and the poisoned output matches
    the float64 reference."""
    launches = spy_launches(monkeypatch, "_unary_kernel")
    case = BY_LABEL[label]
    op = build(case)
    x = _input((numel,), dtype)
    with _tuning.override("flat", **{f.name: getattr(config, f.name) for f in dataclasses.fields(config)}):
        got = LAUNCHERS[case.op](x, *kernel_args(op))
    assert [(k["EVEN"], k["INT64"], k["EVICT"]) for k in launches] == [(*expect, "evict_first" if config.evict else "")]
    assert_close(got, reference(case, x.double(), op).to(dtype), dtype)


def test_tile_2d_grid_falls_back_to_flat_past_the_row_limit(monkeypatch, poison_empty):
    """More row blocks than a grid's second axis takes: the flat grid, same result."""
    monkeypatch.setattr(act, "_GRID_Y", 2)
    launches = spy_launches(monkeypatch, "_and_mul_kernel")
    case = BY_LABEL["silu_and_mul"]
    x = _input((7, 2 * 100), torch.float32)
    got = TILED["silu_and_mul"](x, build(case), _tuning.TileConfig(2, 64, 1, grid2d=True))
    assert [k["GRID2D"] for k in launches] == [False]
    assert_close(got, reference(case, x.double(), None), torch.float32)


@pytest.mark.parametrize("label", ["silu_and_mul", "gelu_and_mul[tanh]", "swigluoai_and_mul"])
def test_tile_const_width_takes_the_flat_grid(label, monkeypatch, poison_empty):
    """A config that asks for both the width compiled in and the 2-D grid launches flat with
    WIDTH = d where the rows are packed (the small grids' launch), keeps the runtime width and
    the 2-D grid on strided rows and in the kernel without a WIDTH (swigluoai); the poisoned
    outputs match the float64 reference every time."""
    kernel = "_swigluoai_kernel" if label == "swigluoai_and_mul" else "_and_mul_kernel"
    launches = spy_launches(monkeypatch, kernel)
    case = BY_LABEL[label]
    op = build(case)
    cfg = _tuning.TileConfig(1, 64, 2, grid2d=True, const_width=True)
    packed = _input((3, 2 * 200), torch.float32)
    strided = _input((3, 2 * 200 + 8), torch.float32)[:, : 2 * 200]
    for x in (packed, strided):
        assert_close(TILED[label](x, op, cfg), reference(case, x.double(), op), torch.float32)
    flat = kernel == "_and_mul_kernel"
    assert [(k["GRID2D"], k.get("WIDTH", 0)) for k in launches] == [(not flat, 200 if flat else 0), (True, 0)]


def test_tile_decode_class_and_sweep_filters():
    """The decode rows of TILE_TABLE and the ``tile`` sweep's shape filters."""
    # fewer than two programs per SM at the decode tile (1-16 tokens): 512-lane tiles at 8 warps
    # with the width compiled in, 256 lanes at 4 where 512 would leave fewer programs than SMs
    small = dict(grid2d=True, const_width=True)
    assert _tuning._tile_config("cuda", 132, 1, 14336) == _tuning.TileConfig(1, 256, 4, **small)
    assert _tuning._tile_config("cuda", 132, 16, 14336) == _tuning.TileConfig(1, 512, 8, **small)
    assert _tuning._tile_config("cuda", 132, 1, 4096) == _tuning.TileConfig(1, 256, 4, **small)
    assert _tuning._tile_config("cuda", 132, 64, 14336) == _tuning.TileConfig(1, 1024, 2, grid2d=True)
    # the small flat grids (unary ops and per-tensor quant alike): the same blocks and halving
    assert _tuning._flat_config("cuda", 132, 16 * 8192, True) == _tuning.TileConfig(1, 512, 8)
    assert _tuning._flat_config("cuda", 132, 16 * 8192) == _tuning.TileConfig(1, 512, 8)
    assert _tuning._flat_config("cuda", 132, 16 * 4096, True) == _tuning.TileConfig(1, 256, 4)
    assert _tuning._flat_config("cuda", 132, 8192) == _tuning.TileConfig(1, 256, 4)
    assert _tuning._flat_config("cuda", 132, 2048 * 8192) == _tuning.TileConfig(1, 2048, 4)
    assert _tuning._tile_config("cuda", 132, 255, 14336).evict  # decode class: the hint stays
    # from rotating_min_rows (256) rows the streaming-class ops drop it; the erf gate keeps it at 4 warps
    assert _tuning._tile_config("cuda", 132, 256, 14336) == _tuning.TileConfig(1, 1024, 2, evict=False, grid2d=True)
    assert _tuning._tile_config("cuda", 132, 256, 14336, False) == _tuning.TileConfig(1, 1024, 4, grid2d=True)
    assert _tuning._tile_config("cuda", 132, 255, 14336, False) == _tuning.TileConfig(1, 1024, 2, grid2d=True)
    assert _tuning._tile_config("cuda", 132, 256, 14336).grid2d  # and the 2-D grid
    assert not _tuning._tile_config("cuda", 132, 257, 14336).grid2d
    assert _tuning._tile_config("cuda", 132, 32768, 14336) == _tuning.TileConfig(1, 2048, 8, evict=False)
    assert _tuning._tile_config("cuda", 132, 32768, 14336, False) == _tuning.TileConfig(1, 1024, 2)  # erf gate
    # situ (compute-bound): the mid-size tile at 4 warps beyond the small grids
    assert _tuning._tile_config("cuda", 132, 32768, 14336, False, True) == _tuning.TileConfig(1, 1024, 4)
    assert _tuning._tile_config("cuda", 132, 16, 14336, False, True) == _tuning.TileConfig(1, 512, 8, **small)
    # the unary streaming class, and per-tensor quant's flat blocks left as they were
    assert _tuning._flat_config("cuda", 132, 32768 * 8192, True) == _tuning.TileConfig(1, 1024, 4, evict=False)
    assert _tuning._flat_config("cuda", 132, 32768 * 8192) == _tuning.TileConfig(1, 2048, 4)
    assert _tuning._flat_config("cuda", 132, 64 * 8192, True).evict
    # relu2 (light): 4096-element blocks at 8 warps from the streaming size up to light_mid_numel
    assert _tuning._flat_config("cuda", 132, 256 * 4096, True, True) == _tuning.TileConfig(1, 4096, 8, evict=False)
    assert _tuning._flat_config("cuda", 132, 256 * 8192, True, True) == _tuning.TileConfig(1, 4096, 8, evict=False)
    assert _tuning._flat_config("cuda", 132, 512 * 8192, True, True) == _tuning.TileConfig(1, 1024, 4, evict=False)
    assert _tuning._flat_config("cuda", 132, 64 * 8192, True, True) == _tuning._flat_config("cuda", 132, 64 * 8192, True)
    assert _tuning._flat_config("hip", 304, 256 * 8192, True, True).num_warps == 4
    decode = _tuning.sweep_alternatives(_tuning.SWEEP["tile"], 16, 14336)
    prefill = _tuning.sweep_alternatives(_tuning.SWEEP["tile"], 32768, 14336)
    assert {"even": False, "int32": False} in decode and {"even": False, "int32": False} in prefill
    assert {"block_n": 256, "num_warps": 1} in decode and {"block_n": 256, "num_warps": 1} not in prefill
    assert {"block_n": 512, "num_warps": 8} in prefill
    assert {"evict": False} in decode and {"evict": False} in prefill
    assert {"evict": False, "block_n": 1024, "num_warps": 4} in prefill
    assert {"grid2d": True} in decode and {"grid2d": True} not in prefill


@pytest.mark.parametrize("label", ["gelu_and_mul_sparse[0.95]", "gelu_and_mul_sparse[0.3,tanh]"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gelu_sparse_looped_path(label, dtype, poison_empty):
    """Rows wider than one tile take the chunked two-pass variant (forced with a small chunk),
    also with a large mean next to the spread (where naive sum-of-squares variance loses digits)."""
    x = _input((3, 2 * 1000), dtype)
    x[..., :1000] += 30.0
    out, expected = run_launcher(BY_LABEL[label], x, config=_tuning.RowConfig(1, 128, 4, False))
    assert_close(out, expected, dtype)


def test_large_unary_grid_uses_several_programs(poison_empty):
    x = _input((3, 5000), torch.float32)
    cfg = _tuning.TileConfig(1, 1024, 2)
    expected = reference(BY_LABEL["quick_gelu"], x.double(), None)
    assert_close(act._unary(x, act.QUICK_GELU, config=cfg), expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_situ_tanh_keeps_relative_accuracy_near_zero(dtype, poison_empty):
    """Gate (row 0) and up (row 1) values down to 1e-30, the other half ones: the kernel's tanh has
    no cancellation there (2 sigmoid(2v) - 1 would give 0 or whole ulps of 1 instead of ~v)."""
    tiny = torch.logspace(-30, 0, 64, dtype=torch.float64) * torch.tensor([1.0, -1.0]).repeat(32)
    ones = torch.ones(64, dtype=torch.float64)
    x = torch.stack([torch.cat([tiny, ones]), torch.cat([ones, tiny])]).to(dtype)
    out, expected = run_launcher(BY_LABEL["situ_and_mul[4,25]"], x)
    relative = (out.double() / expected - 1).abs().max()
    # a few fp32 roundings (tanh, sigmoid, products); a cancelling tanh is off by orders of magnitude
    assert relative <= 8 * torch.finfo(dtype).eps, f"relative error {relative:.3g}"


def _wide_values(n: int = 512) -> torch.Tensor:
    """Magnitudes from 1e-30 to 100 of both signs (and zeros): the exp of a sigmoid / tanh at its
    ends (underflow to 0, overflow to inf, the ~1e-30 results of |x| ~ 70) and near 0."""
    mag = torch.logspace(-30, 2, n // 2 - 1, dtype=torch.float64)
    return torch.cat([mag, -mag, torch.tensor([0.0, -0.0], dtype=torch.float64)])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("beta,linear_beta", [(4.0, 25.0), (-4.0, None), (-0.5, -3.0), (1e-3, None), (100.0, -0.7)])
def test_situ_wide_range_and_signs_match_float64(beta, linear_beta, dtype, poison_empty):
    """situ_and_mul's portable one-division form (|beta| tanh(|a / beta|) with a's sign, the tanh
    and sigmoid denominators multiplied, a / beta as a product with the host's 1 / beta) over the
    whole range:
    gate and up each from 1e-30 to 100 of both signs against the other half's values shuffled,
    negative / tiny / large beta and linear_beta, every dtype."""
    vals = _wide_values()
    shuffled = vals[torch.randperm(vals.numel(), generator=torch.Generator().manual_seed(0))]
    x = torch.stack([torch.cat([vals, shuffled]), torch.cat([shuffled, vals])]).to(dtype)
    out = act.situ_and_mul(x, beta, linear_beta)
    assert_close(out, reference(BY_LABEL["situ_and_mul"], x.double(), SituAndMul(beta, linear_beta)), dtype)


def test_situ_special_values(poison_empty):
    """Infinite gates saturate (|beta| b and -0), zeros stay 0, also with a subnormal beta (whose
    1 / beta overflows in fp32; _fp32_reciprocal clamps it, see the next test)."""
    a = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 1.0, -3.0])
    x = torch.cat([a, torch.full_like(a, -2.0)])[None, :]
    for beta, linear_beta in [(4.0, None), (-4.0, 25.0), (1e-40, None), (1e-40, 1e-40)]:
        out = act.situ_and_mul(x, beta, linear_beta)
        expected = reference(BY_LABEL["situ_and_mul"], x.double(), SituAndMul(beta, linear_beta))
        assert not out.isnan().any(), f"beta={beta} linear_beta={linear_beta}: {out}"
        assert_close(out, expected, torch.float32, what=f"beta={beta} linear_beta={linear_beta}")


@triton.jit
def _portable_tanh_kernel(inv_ptr, x_ptr, tanh_ptr):
    # the portable branch's tanh(|x / p|) = -m / (2 + m), m = expm1(-2 |x| |1 / p|)
    offs = tl.arange(0, 4)
    m = act.expm1_neg(tl.abs(tl.load(x_ptr + offs)) * (-2.0 * tl.abs(tl.load(inv_ptr))))
    tl.store(tanh_ptr + offs, -m / (2.0 + m))


@pytest.mark.parametrize("p", [4.0, -0.5, 25.0, 1e-40, -1e-45, 3e38])
def test_fp32_reciprocal_stays_finite(p):
    """The host's 1 / beta for the kernel's fp32 beta: the reciprocal of beta rounded to fp32
    (an fp32 argument on the GPU; the interpreter keeps a python float outside fp32's normal range
    in fp64, so situ_and_mul's own test cannot reach this), within +-FLT_MAX / 2: a subnormal
    beta's tanh(0 / beta) is 0 rather than NaN, tanh(+-1 / beta) saturates to 1, and the portable
    form's -2 / |beta| stays finite."""
    p32 = float(torch.tensor(p, dtype=torch.float32))
    half_max = torch.finfo(torch.float32).max / 2
    inv = act._fp32_reciprocal(p)
    assert inv == math.copysign(min(abs(1.0 / p32), half_max), p32)
    inv32 = torch.tensor([inv], dtype=torch.float32)
    assert torch.isfinite(-2.0 * inv32).all()
    tanh = torch.empty(4)
    _portable_tanh_kernel[(1,)](inv32, torch.tensor([0.0, -0.0, 1.0, -1.0]), tanh)
    want = torch.tanh(torch.tensor([0.0, 0.0, 1.0, 1.0], dtype=torch.float64) / abs(p32))
    assert_close(tanh, want, torch.float32)


@pytest.mark.parametrize("label", ["silu_and_mul", "mul_and_silu", "swiglustep_and_mul",
                                   "silu_and_mul_with_clamp[1.702,1]", "swigluoai_and_mul", "gelu_and_mul[tanh]",
                                   "gelu_tanh", "gelu_new", "gelu_fast", "quick_gelu"])
def test_sigmoid_forms_wide_range(label, poison_empty):
    """The ops whose sigmoid is x / (1 + exp2(z * -k log2 e)) (_common.mul_sigmoid) from 1e-30 to 100 of
    both signs in fp32: the exp at its ends (0, inf: the quotient is then x or +-0, no NaN) and
    where the result is small."""
    case = BY_LABEL[label]
    vals = _wide_values()
    shuffled = vals[torch.randperm(vals.numel(), generator=torch.Generator().manual_seed(1))]
    x = torch.stack([torch.cat([vals, shuffled]), torch.cat([shuffled, vals])]).float() if case.gated else vals.float()
    out, expected = run_launcher(case, x)
    assert not out.isnan().any()
    assert_close(out, expected, torch.float32)


def test_gelu_and_mul_rejects_unknown_approximation():
    with pytest.raises(ValueError, match="approximate"):
        act.gelu_and_mul(torch.randn(2, 8), "erf")


@pytest.mark.parametrize("label", ["silu_and_mul", "gelu_new"])
def test_empty_input(label):
    case = BY_LABEL[label]
    x = torch.randn(0, 16)
    assert LAUNCHERS[case.op](x).shape == ((0, 8) if case.gated else (0, 16))


def test_xielu_alpha_is_read_on_device():
    """The 1-element alphas are tensors read by the kernel (no .item() host sync)."""
    x = _input((4, 64), torch.float32)
    a = act.xielu(x, torch.tensor([0.8]), torch.tensor([1.3]), 0.5, -1e-6)
    b = act.xielu(x, torch.tensor([0.4]), torch.tensor([1.3]), 0.5, -1e-6)
    assert not torch.equal(a, b)


# ---- through torch.ops.customop.* ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.label for c in CASES])
def test_library_op_runs_kernel_and_passes_opcheck_and_compile(case):
    """With the launcher as the op's CPU kernel: the op output equals the reference, opcheck
    passes (schema, fake, aot dispatch), and torch.compile(fullgraph=True) runs the kernel."""
    dtype = torch.bfloat16 if case.op in ("silu_and_mul", "xielu") else torch.float32
    op_module = build(case)
    extra = kernel_args(op_module)
    x = case.input((3, 2 * 40) if case.gated else (3, 40), dtype)
    op = getattr(torch.ops.customop, case.op)
    with as_cpu_kernel(case.op, LAUNCHERS[case.op]) as calls:
        out = op(x, *extra)
        assert len(calls) == 1
        assert_close(out, reference(case, x.double(), op_module), dtype)
        torch.library.opcheck(op.default, (x, *extra))
        torch.compiler.reset()
        compiled = torch.compile(lambda t: op(t, *extra), fullgraph=True)
        before = len(calls)
        assert_close(compiled(x), out, dtype, atol=0, rtol=0)
        assert len(calls) > before, "the compiled graph did not call the Triton kernel"
    calls.clear()
    op(x, *extra)  # the reference implementation is back
    assert not calls


@pytest.mark.parametrize("label,streaming,compute_bound", [
    ("silu_and_mul", True, False), ("mul_and_silu", True, False), ("fatrelu_and_mul", True, False),
    ("gelu_and_mul[tanh]", True, False), ("gelu_and_mul[none]", False, False), ("swigluoai_and_mul", False, False),
    ("swiglustep_and_mul", False, False), ("situ_and_mul[4,25]", False, True)])
def test_streaming_tile_only_for_the_measured_gated_ops(label, streaming, compute_bound, monkeypatch):
    """Above the decode rows only the gated ops measured faster in the streaming tile ask for it,
    and only situ for the compute-bound tile; the others keep the mid-size tile at every size
    (and the result is right either way)."""
    asked = []
    real = _tuning.tile_config

    def spy(device, n_rows, n_cols, streaming_class=True, compute_bound=False):
        asked.append((streaming_class, compute_bound))
        return real(device, n_rows, n_cols, streaming_class, compute_bound)

    monkeypatch.setattr(_tuning, "tile_config", spy)
    case = BY_LABEL[label]
    x = _input((300, 2 * 40), torch.float32)
    got, want = run_launcher(case, x)
    assert asked == [(streaming, compute_bound)]
    assert_close(got, want, torch.float32)


def test_situ_tile_class_follows_its_tanh():
    """situ_and_mul with the hardware tanh (bf16 on NVIDIA) is a streaming op with the width
    compiled in; with libdevice's tanh it keeps the compute-bound tile; silu is unchanged."""
    kernel = act._and_mul_kernel
    assert act._tile_class(kernel, {"ACT": act.SITU.value, "FAST_TANH": True}) == \
        {"streaming_class": True, "const_width": True}
    assert act._tile_class(kernel, {"ACT": act.SITU_LINEAR.value, "FAST_TANH": False}) == \
        {"streaming_class": False, "compute_bound": True}
    assert act._tile_class(kernel, {"ACT": act.SILU.value}) == {"streaming_class": True}
    fast = _tuning._tile_config("cuda", 132, 4096, 14336, streaming_class=True, const_width=True)
    assert fast.const_width and not fast.evict
    assert not _tuning._tile_config("cuda", 132, 64, 14336, streaming_class=True, const_width=True).const_width
    # the hardware tanh is NVIDIA's and bf16-only
    assert not act._fast_tanh(torch.zeros(2, dtype=torch.bfloat16))
    assert not act._fast_tanh(torch.zeros(2, dtype=torch.float16, device="meta"))
