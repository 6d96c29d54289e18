"""The conv family's Triton launcher (``backends/triton/conv.py``) under the interpreter: every case of
the table (``customop/samples/conv.py``: patch projections in 2-D and 3-D with and without bias,
sizes with remainders, and the convolutions that are not patch projections) through the op's
kernel path on CPU tensors, against the float64 references; the gathered rows themselves, with
their zero padding, on a poisoned buffer; the implicit GEMM (``conv_gemm.py``) against float64
``F.conv*`` at both weight layouts, its routing and weight cache; and the kernels compiled for
the H200 (sm_90) without spills."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from customop.backends.triton import conv as launcher
from customop.backends.triton import conv_gemm
from customop.samples.conv import CASES, DTYPES
from customop.testing import assert_close
from tests.backends.triton import aot_subprocess
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


# ---- the implicit GEMM (conv_gemm.py) -------------------------------------------------------------
#: small tiles so that the tiny shapes still take several row, column and K blocks, with tails
_SMALL = conv_gemm.ConvGemmConfig(block_m=32, block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=2)


def _spec_layout(out, x, kernel, n_out):
    grid = [s // k for s, k in zip(x.shape[2:], kernel)]
    n = len(kernel)
    return out.view(x.shape[0], *grid, n_out).permute(0, n + 1, *range(1, n + 1))


def _conv64(x, weight, bias, kernel):
    fn = F.conv2d if len(kernel) == 2 else F.conv3d
    return fn(x.double(), weight.double(), None if bias is None else bias.double(), kernel)


@pytest.mark.parametrize("weight_kn", [False, True], ids=["w NK", "w KN"])
@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "no bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kernel, shape, n_out", [
    ((14, 14), (2, 3, 28, 42), 33),  # K = 588: the K tail masked; 2 x 2 x 3 = 12 patches
    ((16, 16), (2, 3, 33, 50), 17),  # remainders dropped: 2 x 2 x 3 patches
    ((2, 14, 14), (1, 3, 5, 29, 28), 9),  # 3-D, K = 1176
    ((2, 14, 14), (37, 3, 2, 14, 14), 5),  # one contiguous patch per sample (ROWS)
], ids=["2d 14", "2d 16", "3d (2,14,14)", "3d rows"])
def test_implicit_gemm_matches_the_convolution(kernel, shape, n_out, dtype, has_bias, weight_kn, poison_empty):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen).to(dtype)
    weight = (torch.randn(n_out, shape[1], *kernel, generator=gen) * 0.05).to(dtype)
    bias = torch.randn(n_out, generator=gen).to(dtype) if has_bias else None
    got = conv_gemm.patch_gemm(x, weight, bias, dataclasses.replace(_SMALL, weight_kn=weight_kn))
    assert got.dtype == dtype and got.shape == (x.shape[0] * _spec_layout_count(x, kernel), n_out)
    assert_close(_spec_layout(got, x, kernel, n_out), _conv64(x, weight, bias, kernel).to(dtype), what=str(kernel))


def _spec_layout_count(x, kernel):
    count = 1
    for s, k in zip(x.shape[2:], kernel):
        count *= s // k
    return count


def test_implicit_gemm_reads_any_strides(poison_empty):
    """A channels-last image and a sliced one (row part and column part both through the strides)."""
    x = torch.randn(2, 3, 30, 44)
    weight, bias = torch.randn(11, 3, 14, 14) * 0.05, torch.randn(11)
    for view in (x.to(memory_format=torch.channels_last), x[:, :, 1:29, 2:]):
        got = conv_gemm.patch_gemm(view, weight, bias, _SMALL)
        assert_close(_spec_layout(got, view, (14, 14), 11), _conv64(view, weight, bias, (14, 14)).float())


def test_the_route_table_and_override_pick_the_implicit_gemm(monkeypatch, poison_empty):
    x, weight, bias = torch.randn(2, 3, 32, 48).half(), (torch.randn(7, 3, 16, 16) * 0.05).half(), torch.randn(7).half()
    args = ([16, 16], [0, 0], [1, 1], 1, "zeros")
    expected = _conv64(x, weight, bias, (16, 16)).half()
    ran = []
    real = conv_gemm.patch_gemm
    monkeypatch.setattr(conv_gemm, "patch_gemm", lambda *a: ran.append(a[-1]) or real(*a))
    launcher.conv(x, weight, bias, *args)
    assert not ran  # not in the table: the gather
    monkeypatch.setitem(conv_gemm.TABLE, ("cpu", (16, 16), 3, 7, "float16"), ((11, "gather", None), (12, "implicit", _SMALL)))
    got = launcher.conv(x, weight, bias, *args)  # 12 patches: the second row
    assert ran == [_SMALL]
    assert got.shape == expected.shape and got.stride() == torch.ops.customop.conv2d(x, weight, bias, *args).stride()
    assert_close(got, expected)
    with conv_gemm.override("implicit"):
        launcher.conv(x, weight, bias, *args)
    assert ran[-1] == conv_gemm.DEFAULT
    with conv_gemm.override("view"):  # not a view here: the gather
        launcher.conv(x, weight, bias, *args)
    assert len(ran) == 2
    with pytest.raises(ValueError, match="route"):
        with conv_gemm.override("im2col"):
            pass


def test_patches_spanning_int32_fall_back_to_the_gather():
    x = torch.empty_strided((1, 3, 16, 16), (2 ** 32, 2 ** 30, 16, 1), device="meta")  # 2^31 elements apart
    assert not conv_gemm.span_fits_int32(x, (16, 16))
    with conv_gemm.override("implicit"):
        assert conv_gemm.choose(x, torch.empty(4, 3, 16, 16, device="meta"), False)[0] == "gather"
    assert conv_gemm.span_fits_int32(torch.empty(1, 3, 16, 16), (16, 16))


def test_the_prepared_weight_follows_in_place_updates():
    weight = torch.randn(6, 3, 2, 2)
    first = conv_gemm.prepared_weight(weight)
    assert torch.equal(first, weight.reshape(6, -1).t()) and first.stride() == (6, 1)
    assert conv_gemm.prepared_weight(weight) is first  # cached
    with torch.no_grad():
        weight.mul_(2)
    again = conv_gemm.prepared_weight(weight)
    assert again is not first and torch.equal(again, weight.reshape(6, -1).t())
    clone = weight.clone()  # same values, another tensor: prepared on its own
    assert conv_gemm.prepared_weight(clone) is not again
    with torch.inference_mode():
        frozen = torch.randn(6, 3, 2, 2)
    assert torch.equal(conv_gemm.prepared_weight(frozen), frozen.reshape(6, -1).t())


# ---- compiled for the H200 (no GPU needed) -------------------------------------------------------


def _aot_cases():
    """(label, kernel, {pointer arg: type}, constexprs, warps) at the table's candidate configs."""
    for P in ("*bf16", "*fp16"):
        ptrs = {"x_ptr": P, "w_ptr": P, "bias_ptr": P, "out_ptr": P}
        for kernel, rows in (((1, 14, 14), False), ((1, 16, 16), False), ((2, 14, 14), True)):
            for cfg in conv_gemm.CANDIDATES if P == "*bf16" and kernel == (1, 14, 14) else conv_gemm.CANDIDATES[:1]:
                # the launch's specialisations: unit strides of the image's last dim and of B's contiguous dim
                unit = {"sx_w": 1, **({"sw_n": 1} if cfg.weight_kn else {"sw_k": 1})}
                const = dict(unit, KD=kernel[0], KH=kernel[1], KW=kernel[2], ROWS=rows, HAS_BIAS=True, BLOCK_M=cfg.block_m,
                             BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, PRECISION="tf32",
                             UPCAST=False)
                yield (f"{P} {kernel} rows={rows} {cfg}", conv_gemm._patch_gemm_kernel, ptrs, const, cfg.num_warps)
    ptrs = {"x_ptr": "*fp32", "w_ptr": "*fp32", "bias_ptr": "*fp32", "out_ptr": "*fp32"}
    cfg = conv_gemm.ConvGemmConfig(64, 64, 32, 8, 4, 3)
    yield ("fp32 ieee (1, 14, 14)", conv_gemm._patch_gemm_kernel, ptrs,
           dict(sx_w=1, sw_k=1, KD=1, KH=14, KW=14, ROWS=False, HAS_BIAS=True, BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8,
                PRECISION="ieee", UPCAST=False), cfg.num_warps)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["cuda:90"])
def test_kernels_compile_for_the_gpus(target):
    aot_subprocess.assert_compiles_for("tests.backends.triton.test_conv_triton", target, len(list(_aot_cases())))


#: multiples of 16 at the real shapes (the image's strides for 336/384-pixel images, N, K-major B's rows)
_ALIGNED = ("x_ptr", "w_ptr", "bias_ptr", "out_ptr", "N", "sx_b", "sx_c", "sx_d", "sx_h", "so_m")

if __name__ == "__main__":
    aot_subprocess.main(_aot_cases(), _ALIGNED)
