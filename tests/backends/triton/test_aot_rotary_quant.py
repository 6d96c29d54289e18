"""The rotary and fp8-quant kernels compile for the H200 (sm_90) and for MI300 (gfx942, with the
fnuz fp8 dtype) on a machine with no GPU: no register spills, 16-byte global loads and stores
where rows are 16-byte aligned, and the hardware fp8 conversion. The interpreter accepts programs
the GPU compiler rejects and says nothing about either (aot_check.py, whose ``compile_one`` this
reuses). By hand:

    TRITON_INTERPRET=0 python -m tests.backends.triton.test_aot_rotary_quant [--target hip:gfx942]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# The Triton compiler in a subprocess (TRITON_INTERPRET=0): any session runs it; compile-heavy.
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_ROT_SIG = {"pos_ptr": "*i64", "q_ptr": "*bf16", "k_ptr": "*bf16", "cache_ptr": "*bf16",
            "q_stride_t": "i32", "q_stride_h": "i32", "k_stride_t": "i32", "k_stride_h": "i32",
            "cache_stride": "i32", "num_q_heads": "i32", "num_k_heads": "i32",
            "q_heads_per_split": "i32", "k_heads_per_split": "i32"}
_ROT_ALIGNED = ("pos_ptr", "q_ptr", "k_ptr", "cache_ptr", "q_stride_t", "q_stride_h", "k_stride_t",
                "k_stride_h", "cache_stride")
_ROW_ALIGNED = ("x_ptr", "w_ptr", "q_ptr", "N", "x_stride")
_FLAT_ALIGNED = ("x_ptr", "q_ptr", "numel")
#: cases with no wide store by design: one fp32 partial max per program; 16 fp16 lanes per half
#: head spread over 128 threads (8 bytes each)
_NARROW_STORES = ("absmax partials", "rotary fp16 partial 32")


def _row_sig(fp8, x="*bf16", w="*bf16"):
    return {"x_ptr": x, "w_ptr": w, "ub_ptr": "*fp32", "q_ptr": fp8, "scale_ptr": "*fp32", "M": "i32",
            "N": "i32", "x_stride": "i32", "eps": "fp32", "fp8_max": "fp32", "min_scale": "fp32"}


def cases(fp8: str):
    """(label, kernel, signature, constexprs, num_warps, args known to be multiples of 16)."""
    from customop.backends.triton import quant, rotary

    for neox in (True, False):
        style = "neox" if neox else "gptj"
        const = {"HALF": 64, "BLOCK_HALF": 64, "BLOCK_HK": 8, "IS_NEOX": neox, "HAS_KEY": True}
        yield (f"rotary {style} 32+8x128", rotary._rotary_kernel, _ROT_SIG,
               dict(const, BLOCK_HQ=32, SINGLE_TILE=True), 4, _ROT_ALIGNED)
        yield (f"rotary {style} looped", rotary._rotary_kernel, _ROT_SIG,
               dict(const, BLOCK_HQ=16, SINGLE_TILE=False), 4, _ROT_ALIGNED)
        yield (f"rotary {style} 32+8x128 8 warps", rotary._rotary_kernel, _ROT_SIG,
               dict(const, BLOCK_HQ=32, SINGLE_TILE=True), 8, _ROT_ALIGNED)
    fp16_sig = dict(_ROT_SIG, q_ptr="*fp16", k_ptr="*fp16", cache_ptr="*fp32")
    yield ("rotary fp16 partial 32", rotary._rotary_kernel, fp16_sig,
           {"HALF": 16, "BLOCK_HALF": 16, "BLOCK_HQ": 32, "BLOCK_HK": 8, "IS_NEOX": True, "HAS_KEY": False,
            "SINGLE_TILE": True}, 4, _ROT_ALIGNED)
    row = {"BLOCK_M": 1, "BLOCK_N": 8192, "ONE_PASS": True, "NORM": False, "HAS_WEIGHT": False, "HAS_UB": True}
    yield "per_token 8192", quant.row_quant_kernel, _row_sig(fp8), row, 4, _ROW_ALIGNED
    yield "per_token 8192 16 warps", quant.row_quant_kernel, _row_sig(fp8), row, 16, _ROW_ALIGNED
    yield ("per_token 256 x16 rows", quant.row_quant_kernel, _row_sig(fp8), dict(row, BLOCK_M=16, BLOCK_N=256), 4,
           _ROW_ALIGNED)
    yield "per_token looped", quant.row_quant_kernel, _row_sig(fp8), dict(row, ONE_PASS=False), 16, _ROW_ALIGNED
    norm = dict(row, NORM=True, HAS_WEIGHT=True)
    yield "rms_norm_quant 8192", quant.row_quant_kernel, _row_sig(fp8), norm, 4, _ROW_ALIGNED
    yield "rms_norm_quant fp32 weight", quant.row_quant_kernel, _row_sig(fp8, w="*fp32"), norm, 4, _ROW_ALIGNED
    yield "rms_norm_quant looped", quant.row_quant_kernel, _row_sig(fp8), dict(norm, ONE_PASS=False), 16, _ROW_ALIGNED
    group_sig = {"x_ptr": "*bf16", "q_ptr": fp8, "scale_ptr": "*fp32", "groups_per_row": "i32", "chunks_per_row": "i32",
                 "N": "i32", "x_stride": "i32", "tokens": "i32", "fp8_max": "fp32", "min_scale": "fp32"}
    for cm, ue in ((False, False), (True, True)):
        yield (f"group 128 colmajor={cm} ue8m0={ue}", quant._group_quant_kernel, group_sig,
               {"G": 128, "BLOCK_G": 128, "GROUPS": 32, "COLUMN_MAJOR": cm, "UE8M0": ue}, 4,
               ("x_ptr", "q_ptr", "N", "x_stride"))
    yield ("absmax partials", quant._absmax_partials_kernel,
           {"x_ptr": "*bf16", "partial_ptr": "*fp32", "numel": "i32", "N": "i32", "x_stride": "i32",
            "num_tiles": "i32"},
           {"BLOCK": 16384, "CONTIG": True}, 8, ("x_ptr", "numel"))
    flat_sig = {"x_ptr": "*bf16", "q_ptr": fp8, "scale_ptr": "*fp32", "partial_ptr": "*fp32", "num_partials": "i32",
                "numel": "i32", "N": "i32", "x_stride": "i32", "fp8_max": "fp32", "min_scale": "fp32"}
    for dynamic in (True, False):
        yield (f"per_tensor dynamic={dynamic}", quant._per_tensor_quant_kernel, flat_sig,
               {"BLOCK": 4096, "BLOCK_P": 512, "DYNAMIC": dynamic, "CONTIG": True}, 8, _FLAT_ALIGNED)
    small_sig = {"x_ptr": "*bf16", "q_ptr": fp8, "scale_ptr": "*fp32", "numel": "i32", "N": "i32", "x_stride": "i32",
                 "fp8_max": "fp32", "min_scale": "fp32"}
    yield ("per_tensor small", quant._per_tensor_small_kernel, small_sig, {"BLOCK": 4096, "CONTIG": True}, 8,
           _FLAT_ALIGNED)
    yield ("per_tensor strided", quant._per_tensor_quant_kernel, flat_sig,
           {"BLOCK": 4096, "BLOCK_P": 512, "DYNAMIC": False, "CONTIG": False}, 8, ())


def main(argv: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("run with TRITON_INTERPRET=0 (compiling needs real JIT functions)")
    from tests.backends.triton.aot_check import compile_one

    target = argv[argv.index("--target") + 1] if "--target" in argv else "cuda:90"
    hip = target.startswith("hip")
    report, seen = {}, set()
    for label, kernel, sig, const, warps, aligned in cases("*fp8e4b8" if hip else "*fp8e4nv"):
        if hip and kernel in seen:  # MI300: one variant per kernel (the point is that it compiles)
            continue
        seen.add(kernel)
        try:
            report[label] = compile_one(kernel, sig, const, warps, aligned, target)
        except Exception as err:  # reported per case
            report[label] = {"error": f"{type(err).__name__}: {str(err)[:1500]}"}
    print(json.dumps(report))
    return 0


def _nvidia_backend_present() -> bool:
    try:
        import triton
    except ImportError:
        return False
    return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))


@pytest.fixture(scope="module")
def reports() -> dict[str, dict]:
    """Both targets at once, in two processes (CI has two cores)."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    procs = {t: subprocess.Popen([sys.executable, "-m", "tests.backends.triton.test_aot_rotary_quant", "--target", t],
                                 cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for t in ("cuda:90", "hip:gfx942")}
    out = {}
    for target, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        lines = [line for line in stdout.splitlines() if line.startswith("{")]
        if not lines:
            pytest.fail(f"{target}: no report (exit {proc.returncode}):\n{stderr[-4000:]}")
        out[target] = json.loads(lines[-1])
    return out


#: triton 3.7.1 (CI's pin) spills 8 bytes in the 4-warp per-token row kernel at 8192 (72 registers);
#: triton 3.6 (the H200's) and 3.9 do not. A few bytes of spill traffic per row is noise next to the
#: 16 KB the row moves; a real register blow-up spills hundreds of bytes and still fails here.
MAX_SPILL_BYTES = 16


@pytest.mark.skipif(not _nvidia_backend_present(), reason="triton's NVIDIA backend (ptxas) is not installed")
def test_compile_for_h200(reports):
    problems = []
    for label, info in reports["cuda:90"].items():
        if "error" in info:
            problems.append(f"{label}: {info['error']}")
        elif info.get("local_bytes") or info.get("spill_bytes", info.get("stack", 0)) > MAX_SPILL_BYTES:
            problems.append(f"{label}: spills ({info})")
        elif "strided" not in label and info["ld_v4"] == 0:
            problems.append(f"{label}: no 16-byte global loads ({info})")
        elif label not in _NARROW_STORES and "strided" not in label and info["st_v4"] == 0:
            problems.append(f"{label}: no 16-byte global stores ({info})")
    assert not problems, "\n".join(problems)


def test_compile_for_mi300_with_fnuz(reports):
    errors = [f"{label}: {info['error']}" for label, info in reports["hip:gfx942"].items() if "error" in info]
    assert not errors, "\n".join(errors)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
