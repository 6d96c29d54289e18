"""The activation kernels (backends/triton/activation.py) under the Triton interpreter, against
float64 references written here, directly and through ``torch.ops.customop.*``."""

from __future__ import annotations

import pytest
import torch

from customop.backends.triton import _tuning
from customop.backends.triton import activation as act
from customop.testing import assert_close
from tests.backends.triton.conftest import as_cpu_kernel
from tests.backends.triton.references import (
    ref_fatrelu_and_mul, ref_gelu_and_mul, ref_gelu_and_mul_sparse, ref_gelu_fast, ref_gelu_new, ref_mul_and_silu,
    ref_quick_gelu, ref_relu2, ref_silu_and_mul, ref_swigluoai_and_mul, ref_xielu,
)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# name -> (launcher, reference, extra args after x, gated)
CASES = {
    "silu_and_mul": (act.silu_and_mul, ref_silu_and_mul, (), True),
    "mul_and_silu": (act.mul_and_silu, ref_mul_and_silu, (), True),
    "gelu_and_mul[none]": (act.gelu_and_mul, ref_gelu_and_mul, ("none",), True),
    "gelu_and_mul[tanh]": (act.gelu_and_mul, ref_gelu_and_mul, ("tanh",), True),
    "gelu_and_mul_sparse[none]": (act.gelu_and_mul_sparse, ref_gelu_and_mul_sparse, (0.8416, "none"), True),
    "gelu_and_mul_sparse[tanh]": (act.gelu_and_mul_sparse, ref_gelu_and_mul_sparse, (-0.5, "tanh"), True),
    "fatrelu_and_mul": (act.fatrelu_and_mul, ref_fatrelu_and_mul, (0.25,), True),
    "swigluoai_and_mul": (act.swigluoai_and_mul, ref_swigluoai_and_mul, (1.702, 1.5), True),
    "gelu_new": (act.gelu_new, ref_gelu_new, (), False),
    "gelu_fast": (act.gelu_fast, ref_gelu_fast, (), False),
    "quick_gelu": (act.quick_gelu, ref_quick_gelu, (), False),
    "relu2": (act.relu2, ref_relu2, (), False),
    "xielu": (act.xielu, ref_xielu, "xielu", False),
}

# leading shape x last dim: one row; odd row counts and widths (masks) incl. d = 4231; 3-D
GATED_SHAPES = ((1, 16), (7, 2 * 4231), (33, 2 * 100), (3, 5, 2 * 64))
UNARY_SHAPES = ((1, 1), (7, 4231), (33, 100), (2, 3, 64))


def _extra(case, dtype):
    extra = CASES[case][2]
    if extra == "xielu":
        # 1-element alphas as the op class passes them (softplus already applied), in x's dtype
        return (torch.tensor([0.8], dtype=dtype), torch.tensor([1.3], dtype=dtype), 0.5, -1e-6)
    return extra


def _reference(case, x, extra):
    ref = CASES[case][1]
    extra64 = tuple(e.double() if isinstance(e, torch.Tensor) else e for e in extra)
    return ref(x.double(), *extra64)


def _input(shape, dtype, scale=2.0):
    return (torch.randn(shape, dtype=torch.float32) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_float64_reference(case, dtype, poison_empty):
    launcher, _, _, gated = CASES[case]
    extra = _extra(case, dtype)
    for shape in GATED_SHAPES if gated else UNARY_SHAPES:
        x = _input(shape, dtype)
        x_before = x.clone()
        out = launcher(x, *extra)
        expected = _reference(case, x, extra)
        assert out.dtype == dtype and out.is_contiguous()
        assert_close(out, expected.to(dtype), dtype, what=f"{case} {shape}")
        assert torch.equal(x, x_before), f"{case} mutated its input"


@pytest.mark.parametrize("case", ["silu_and_mul", "mul_and_silu", "swigluoai_and_mul", "gelu_and_mul_sparse[none]"])
def test_gated_row_strided_input(case, poison_empty):
    """A slice of a wider buffer (row stride > 2d) is read in place, not copied wrong."""
    launcher, _, _, _ = CASES[case]
    extra = _extra(case, torch.float32)
    wide = _input((9, 2 * 300 + 40), torch.float32)
    x = wide[:, : 2 * 300]
    assert not x.is_contiguous()
    assert_close(launcher(x, *extra), _reference(case, x, extra).float(), torch.float32)


def test_unary_non_contiguous_input(poison_empty):
    x = _input((40, 33), torch.float32).t()
    out = act.gelu_new(x)
    assert out.shape == x.shape
    assert_close(out, ref_gelu_new(x.double()).float(), torch.float32)


@pytest.mark.parametrize("config", [_tuning.TileConfig(2, 64, 1), _tuning.TileConfig(1, 512, 2), _tuning.TileConfig(4, 32, 1)],
                         ids=str)
@pytest.mark.parametrize("case", ["silu_and_mul", "gelu_and_mul[tanh]", "swigluoai_and_mul"])
def test_gated_tile_configs(case, config, poison_empty):
    """Other tilings than the table's pick (what --sweep may select) give the same result."""
    x = _input((5, 2 * 200), torch.float32)
    extra = _extra(case, torch.float32)
    if case == "swigluoai_and_mul":
        out = act.swigluoai_and_mul(x, *extra, config=config)
    else:
        out = act._and_mul(x, act.GELU_TANH if "gelu" in case else act.SILU, config=config)
    assert_close(out, _reference(case, x, extra).float(), torch.float32)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gelu_sparse_looped_path(approximate, dtype, poison_empty):
    """Rows wider than one tile take the chunked two-pass variant (forced with a small chunk),
    also with a large mean next to the spread (where naive sum-of-squares variance loses digits)."""
    x = _input((3, 2 * 1000), dtype)
    x[..., :1000] += 30.0
    cfg = _tuning.RowConfig(1, 128, 4, False)
    out = act.gelu_and_mul_sparse(x, 1.2, approximate, config=cfg)
    assert_close(out, ref_gelu_and_mul_sparse(x.double(), 1.2, approximate).to(dtype), dtype)


def test_large_unary_grid_uses_several_programs(poison_empty):
    x = _input((3, 5000), torch.float32)
    cfg = _tuning.TileConfig(1, 1024, 2)
    assert_close(act._unary(x, act.QUICK_GELU, config=cfg), ref_quick_gelu(x.double()).float(), torch.float32)


def test_gelu_and_mul_rejects_unknown_approximation():
    with pytest.raises(ValueError, match="approximate"):
        act.gelu_and_mul(torch.randn(2, 8), "erf")


@pytest.mark.parametrize("case", ["silu_and_mul", "gelu_new"])
def test_empty_input(case):
    launcher, _, _, gated = CASES[case]
    x = torch.randn(0, 16)
    assert launcher(x).shape == ((0, 8) if gated else (0, 16))


def test_xielu_alpha_is_read_on_device():
    """The 1-element alphas are tensors read by the kernel (no .item() host sync)."""
    x = _input((4, 64), torch.float32)
    a = act.xielu(x, torch.tensor([0.8]), torch.tensor([1.3]), 0.5, -1e-6)
    b = act.xielu(x, torch.tensor([0.4]), torch.tensor([1.3]), 0.5, -1e-6)
    assert not torch.equal(a, b)


# ---- through torch.ops.customop.* ---------------------------------------------------------------


def _op_name(case):
    return case.split("[")[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_library_op_runs_kernel_and_passes_opcheck_and_compile(case):
    """With the launcher as the op's CPU kernel: the op output equals the reference, opcheck
    passes (schema, fake, aot dispatch), and torch.compile(fullgraph=True) runs the kernel."""
    launcher, _, _, gated = CASES[case]
    dtype = torch.bfloat16 if case in ("silu_and_mul", "xielu") else torch.float32
    extra = _extra(case, dtype)
    x = _input((3, 2 * 40) if gated else (3, 40), dtype)
    op = getattr(torch.ops.customop, _op_name(case))
    with as_cpu_kernel(_op_name(case), launcher) as calls:
        out = op(x, *extra)
        assert len(calls) == 1
        assert_close(out, _reference(case, x, extra).to(dtype), dtype)
        torch.library.opcheck(op.default, (x, *extra))
        torch.compiler.reset()
        compiled = torch.compile(lambda t: op(t, *extra), fullgraph=True)
        before = len(calls)
        assert_close(compiled(x), out, dtype, atol=0, rtol=0)
        assert len(calls) > before, "the compiled graph did not call the Triton kernel"
    calls.clear()
    op(x, *extra)  # the reference implementation is back
    assert not calls
