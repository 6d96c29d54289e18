"""The encoder-attention kernel (backends/triton/attention.py) under the Triton interpreter: the
table (``customop/samples/attention.py``) through ``forward_kernel`` with the launcher as the CPU
kernel of ``customop::mm_encoder_attn``, against the float64 references (``tests/cases/attention.py``);
then the Triton kernel directly with small tiles (several key tiles per segment, masked tails),
strided views, the clamping of a malformed ``cu_seqlens``, the launcher's own reading of it, the
reference fallback above 256 lanes, opcheck and torch.compile with the kernel, and a compile of
every tile configuration for sm_90 and gfx942 (which the interpreter cannot check)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from customop.backends.triton import attention as attn
from customop.samples.attention import CASES, DTYPES, SIZES, Packing
from customop.testing import assert_close, randn
from tests.backends.triton.conftest import as_cpu_kernel
from tests.cases.attention import ref_packed, reference

pytestmark = pytest.mark.interpret

OP = "mm_encoder_attn"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

#: the interpreter tier (20-80 ms per program): every case in bf16 (the GPU's dtype), fp32 and
#: fp16 on the odd mix; 64 segments directly below, with one head (64 programs)
SMALL = SIZES["small"]
ODD_MIX = Packing(1, (1, 7, 0, 33, 20))


def _params():
    for case in CASES:
        for packing in SMALL:
            if len(packing.lengths or ()) == 64:
                continue
            for dtype in DTYPES if packing == ODD_MIX else (torch.bfloat16,):
                yield pytest.param(case, packing, dtype, id=f"{case.label}-{packing.label}-{str(dtype)[6:]}")


@pytest.mark.parametrize("case,packing,dtype", list(_params()))
def test_kernel_matches_float64_reference(case, packing, dtype, poison_empty):
    op = case.build()
    q, k, v = case.inputs(packing, dtype, generator=torch.Generator().manual_seed(1))
    expected = reference(case, op, packing, q, k, v)
    with as_cpu_kernel(OP, attn.mm_encoder_attn) as calls:
        got = op.forward_kernel(q, k, v, packing.cu_seqlens(), torch.tensor(packing.max_seqlen))
    assert len(calls) == 1, "forward_kernel did not reach the Triton launcher"
    assert_close(got, expected, dtype, what=case.label)


# ---- the kernel directly -------------------------------------------------------------------------


def _packed(lengths, hq, hkv, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q, k = randn(t, hq, d, dtype=dtype, scale=2.0, generator=gen), randn(t, hkv, d, dtype=dtype, scale=2.0, generator=gen)
    v = randn(t, hkv, d, dtype=dtype, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


@pytest.mark.parametrize("head_size,dtype", [(64, torch.bfloat16), (72, torch.bfloat16), (80, torch.bfloat16),
                                             (96, torch.bfloat16), (128, torch.bfloat16), (80, torch.float32),
                                             (80, torch.float16)], ids=str)
def test_small_tiles_stream_several_key_tiles(head_size, dtype, poison_empty):
    """16 x 16 tiles: a 40-token segment takes three key tiles (the online softmax's rescaling)
    and three query tiles, the last of each masked; 1 and 7 tokens take one partial tile."""
    lengths = (1, 7, 40, 0, 33)
    q, k, v, cu = _packed(lengths, 4, 2, head_size, dtype)
    got = attn.triton_varlen_attention(q, k, v, cu, 40, 0.1, block_m=16, block_n=16)
    assert_close(got, ref_packed(q, k, v, list(lengths), 0.1), dtype)


def test_64_segments_of_one_to_three_tokens(poison_empty):
    lengths = SIZES["small"][3].lengths
    assert len(lengths) == 64
    q, k, v, cu = _packed(lengths, 1, 1, 64, torch.bfloat16)
    got = attn.triton_varlen_attention(q, k, v, cu, 3, 0.125, block_m=32, block_n=32)
    assert_close(got, ref_packed(q, k, v, list(lengths), 0.125), torch.bfloat16)


def test_strided_views_of_a_fused_qkv_buffer(poison_empty):
    """q, k and v as head slices of one [T, 3 * H, D] buffer (a ViT's qkv projection): the kernel
    reads through the token and head strides."""
    lengths = (5, 11)
    qkv = randn(16, 3 * 4, 64, scale=2.0)
    q, k, v = qkv[:, :4], qkv[:, 4:8], qkv[:, 8:]
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    got = attn.mm_encoder_attn(q, k, v, cu, 11, 0.125)
    assert got.is_contiguous()
    assert_close(got, ref_packed(q, k, v, list(lengths), 0.125), torch.float32)


def test_malformed_cu_seqlens_is_clamped_into_the_sequence(poison_empty):
    """With max_seqlen given the launcher does not read cu_seqlens; the kernel clamps every segment
    into [0, T], so a bad entry gives the clamped segments' rows, never an access outside the
    tensors: an end of 99 in a 12-token sequence acts as 12, a start of -5 as 0, and after a
    decrease ([0, 9, 4, 12]) segment [9, 4) is empty while [4, 12) overlaps [0, 9)."""
    q, k, v, _ = _packed((12,), 2, 2, 64, torch.float32)
    cu = lambda *e: torch.tensor(e, dtype=torch.int32)  # noqa: E731
    got = attn.triton_varlen_attention(q, k, v, cu(0, 5, 99), 12, 0.125)
    assert_close(got, ref_packed(q, k, v, [5, 7], 0.125), torch.float32)
    got = attn.triton_varlen_attention(q, k, v, cu(-5, 12), 12, 0.125)
    assert_close(got, ref_packed(q, k, v, [12], 0.125), torch.float32)
    got = attn.triton_varlen_attention(q, k, v, cu(0, 9, 4, 12), 12, 0.125)
    assert_close(got[:4], ref_packed(q[:9], k[:9], v[:9], [9], 0.125)[:4], torch.float32)
    assert_close(got[9:], ref_packed(q[4:], k[4:], v[4:], [8], 0.125)[5:], torch.float32)
    assert got[4:9].isfinite().all()  # written by both overlapping segments


def test_launcher_reads_and_checks_cu_seqlens_when_max_seqlen_is_unknown():
    q, k, v, cu = _packed((3, 20, 6), 2, 1, 80, torch.bfloat16)
    assert_close(attn.mm_encoder_attn(q, k, v, cu, 0, 0.1), ref_packed(q, k, v, [3, 20, 6], 0.1), torch.bfloat16)
    with pytest.raises(ValueError, match="cu_seqlens ends at 28, but the sequence has 29 tokens"):
        attn.mm_encoder_attn(q, k, v, torch.tensor([0, 3, 28], dtype=torch.int32), 0, 0.1)


def test_heads_above_256_lanes_run_the_reference(monkeypatch):
    def no_kernel(*args, **kwargs):
        raise AssertionError("the Triton kernel ran for a head of 264 lanes")

    monkeypatch.setattr(attn, "triton_varlen_attention", no_kernel)
    q, k, v, cu = _packed((4, 9), 2, 2, 264, torch.float32)
    assert_close(attn.mm_encoder_attn(q, k, v, cu, 9, 0.06), ref_packed(q, k, v, [4, 9], 0.06), torch.float32)


def test_launcher_rejects_shapes_outside_the_schema():
    q, k, v, cu = _packed((4,), 4, 3, 64, torch.float32)
    with pytest.raises(ValueError, match="Hkv dividing Hq"):
        attn.mm_encoder_attn(q, k, v, cu, 4, 0.1)
    q, k, v, cu = _packed((4,), 4, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="cu_seqlens must be 1-D int32"):
        attn.mm_encoder_attn(q, k, v, cu.long(), 4, 0.1)


def test_cpu_tensors_never_take_torchs_flash_path():
    q, k, _, _ = _packed((4,), 2, 2, 64, torch.bfloat16)
    assert not attn.torch_flash_serves(q, k)


# ---- through torch.ops.customop -------------------------------------------------------------------


def test_opcheck_and_compile_with_the_kernel():
    q, k, v, cu = _packed((1, 7), 2, 1, 72, torch.bfloat16)
    expected = ref_packed(q, k, v, [1, 7], 0.1)
    with as_cpu_kernel(OP, attn.mm_encoder_attn) as calls:
        torch.library.opcheck(torch.ops.customop.mm_encoder_attn.default, (q, k, v, cu, 7, 0.1))
        got = torch.compile(lambda *a: torch.ops.customop.mm_encoder_attn(*a, cu, 7, 0.1), fullgraph=True)(q, k, v)
    assert calls, "the kernel did not run"
    assert_close(got, expected, torch.bfloat16)


# ---- compiled for the GPUs (no GPU needed) ---------------------------------------------------------

_AOT = textwrap.dedent("""
    import json
    from tests.backends.triton.aot_check import compile_one
    from customop.backends.triton import attention as A
    import torch
    STRIDES = ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_ot", "stride_oh")
    report = {}
    for target in ("cuda:90", "hip:gfx942"):
        for dtype, head in (("bf16", 80), ("fp16", 128), ("bf16", 256), ("fp32", 64), ("fp32", 256)):
            block_d = max(16, 1 << (head - 1).bit_length())
            torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
            bm, bn, warps, _ = A._config(torch_dtype, block_d, "cuda")
            p = "*" + dtype
            sig = {"Q": p, "K": p, "V": p, "O": p, "CU": "*i32", "total": "i32", "qk_scale": "fp32",
                   **{s: "i32" for s in STRIDES}}
            const = {"GROUP": 2, "HEAD_DIM": head, "BLOCK_D": block_d, "BLOCK_M": bm, "BLOCK_N": bn,
                     "PRECISION": "ieee" if dtype == "fp32" else "tf32", "UPCAST": False}
            try:
                info = compile_one(A._varlen_attention_kernel, sig, const, warps, ("Q", "K", "V", "O", *STRIDES), target)
            except Exception as err:
                info = {"error": f"{type(err).__name__}: {str(err)[:1000]}"}
            report[f"{target} {dtype} d{head}"] = info
    print(json.dumps(report))
""")


def test_every_tile_configuration_compiles_for_sm90_and_gfx942_without_spills():
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", _AOT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no report (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    report = json.loads(lines[-1])
    assert len(report) == 10
    for label, info in report.items():
        assert "error" not in info, f"{label}: {info['error']}"
        if label.startswith("cuda"):
            assert info["spill_bytes"] == 0 and info["local_bytes"] == 0, f"{label} spills: {info}"
