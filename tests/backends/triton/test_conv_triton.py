"""The conv family's Triton launcher (``backends/triton/conv.py``) under the interpreter: every case of
the table (``customop/samples/conv.py``: patch projections in 2-D and 3-D with and without bias,
sizes with remainders, and the convolutions that are not patch projections) through the op's
kernel path on CPU tensors, against the float64 references; the gathered rows themselves, with
their zero padding, on a poisoned buffer."""

from __future__ import annotations

import pytest
import torch

from customop.backends.triton import conv as launcher
from customop.samples.conv import CASES, DTYPES
from customop.testing import assert_close
from tests.backends.triton.conftest import as_cpu_kernel
from tests.cases.conv import reference

pytestmark = pytest.mark.interpret


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_table_through_the_kernel_path(case, dtype, poison_empty):
    gen = torch.Generator().manual_seed(0)
    op = case.build(dtype, generator=gen)
    with as_cpu_kernel(case.op, launcher.conv) as calls:
        for shape in case.shapes["small"]:
            x = case.input(shape, dtype, generator=gen)
            got = op.forward_kernel(x)
            expected = reference(op, x)
            assert got.shape == expected.shape and got.dtype == dtype
            assert_close(got, expected.to(dtype), what=f"{case.label} {shape}")
    assert calls


@pytest.mark.parametrize("kernel, shape", [((14, 14), (2, 3, 29, 30)), ((2, 3, 3), (1, 2, 5, 7, 6))],
                         ids=["2d K=588 padded", "3d K=36"])
def test_rows_are_the_patches_then_zeros(kernel, shape, poison_empty):
    x = torch.randn(shape)
    rows = launcher.patch_rows(x, kernel)
    n = len(kernel)
    expected = x
    for dim, k in enumerate(kernel):
        expected = expected.unfold(2 + dim, k, k)
    expected = expected.permute(0, *range(2, 2 + n), 1, *range(2 + n, 2 + 2 * n)).reshape(rows.shape[0], -1)
    width = expected.shape[1]
    assert rows.shape[1] % launcher.ALIGN == 0 and rows.shape[1] - width < launcher.ALIGN
    assert torch.equal(rows[:, :width], expected)
    assert torch.equal(rows[:, width:], torch.zeros_like(rows[:, width:]))


def test_one_contiguous_patch_per_sample_skips_the_gather(monkeypatch):
    """Qwen2-VL's layout: the spec's rows are a view, so no gather runs (and the result is the spec's)."""
    gathered = []
    real = launcher.patch_rows
    monkeypatch.setattr(launcher, "patch_rows", lambda *a: gathered.append(1) or real(*a))
    weight, bias = torch.randn(16, 3, 2, 4, 4), torch.randn(16)
    x = torch.randn(5, 3, 2, 4, 4)
    got = launcher.conv(x, weight, bias, [2, 4, 4], [0, 0, 0], [1, 1, 1], 1, "zeros")
    assert not gathered
    torch.testing.assert_close(got, torch.nn.functional.conv3d(x, weight, bias, (2, 4, 4)))
    launcher.conv(x[:, :, :, :, :3].contiguous(), weight[..., :3], bias, [2, 4, 3], [0, 0, 0], [1, 1, 1], 1, "zeros")
    launcher.conv(torch.randn(2, 3, 4, 8, 8), weight, bias, [2, 4, 4], [0, 0, 0], [1, 1, 1], 1, "zeros")
    assert len(gathered) == 1  # the second call has one patch per sample too; the third has 8
