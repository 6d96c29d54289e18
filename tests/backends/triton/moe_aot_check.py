"""Compiles the MoE kernels for the H200 (sm_90) and MI300 (gfx942) on a machine without a GPU,
with ``aot_check.compile_one``, and reports registers, spills and shared memory per variant.

The interpreter runs programs the GPU compiler rejects (and widens bf16 dots to fp32 there, so
the bf16 ``tl.dot`` the GPU runs is only compiled here). Run by test_moe_triton.py in a
subprocess; by hand:

    TRITON_INTERPRET=0 python -m tests.backends.triton.moe_aot_check [--target hip:gfx942]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("moe_aot_check: run with TRITON_INTERPRET=0 (compiling needs real JIT functions)")

from customop.backends.triton import moe, moe_routing  # noqa: E402
from tests.backends.triton.aot_check import compile_one  # noqa: E402

_GEMM_SIG = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "bias_ptr": "*bf16", "w_ptr": "*fp32",
             "sorted_ptr": "*i32", "expert_ids_ptr": "*i32", "ntpp_ptr": "*i32", "N": "i32", "K": "i32",
             "n_slots": "i32", "n_experts": "i32", "grid_m": "i32", "a_stride": "i32", "b_stride_e": "i64", "b_stride_n": "i32",
             "c_stride": "i32", "bias_stride_e": "i32", "up_offset": "i32", "gate_step": "i32", "alpha": "fp32",
             "limit": "fp32", "beta": "fp32"}
_ALIGNED = ("a_ptr", "b_ptr", "c_ptr", "K", "a_stride", "b_stride_n", "c_stride")


def _gemm(gated, act=0, bias=False, w_in=False, w_out=True, bm=64, bn=64, bk=64, dtype="bf16", precision=None,
          naive=False):
    sig = {k: (f"*{dtype}" if v == "*bf16" else v) for k, v in _GEMM_SIG.items()}
    const = {"A_DIV": 2 if gated else 1, "GATED": gated, "ACT": act, "HAS_BIAS": bias, "W_ON_INPUT": w_in,
             "W_ON_OUTPUT": w_out, "UPCAST": False, "PRECISION": precision, "NAIVE": naive, "BLOCK_M": bm, "BLOCK_N": bn,
             "BLOCK_K": bk, "GROUP_M": 8}
    return sig, const


def cases():
    k = moe._moe_gemm_kernel
    for name, code in (("silu", moe.SILU), ("gelu", moe.GELU), ("gelu_tanh", moe.GELU_TANH), ("swiglu", moe.SWIGLU)):
        yield (f"gemm1 {name} 64x64x64", k, *_gemm(True, code.value, w_out=False), 4, _ALIGNED)
    yield ("gemm1 silu bias on-input 16x64x64", k, *_gemm(True, 0, bias=True, w_in=True, w_out=False, bm=16), 4, _ALIGNED)
    yield ("gemm1 silu 128x64x64", k, *_gemm(True, 0, w_out=False, bm=128, bn=64), 8, _ALIGNED)
    yield ("gemm2 64x128x64", k, *_gemm(False, bn=128), 4, _ALIGNED)
    yield ("gemm1 silu decode 16x64x64", k, *_gemm(True, 0, w_out=False, bm=16, naive=True), 4, _ALIGNED)
    yield ("gemm2 decode 16x64x64", k, *_gemm(False, bm=16, naive=True), 4, _ALIGNED)
    yield ("gemm2 bias 16x64x64", k, *_gemm(False, bias=True, bm=16), 4, _ALIGNED)
    yield ("gemm2 fp16 128x128x64", k, *_gemm(False, bm=128, bn=128, dtype="fp16"), 8, _ALIGNED)
    yield ("gemm1 fp32 ieee 32x64x32", k, *_gemm(True, 0, w_out=False, bm=32, bk=32, dtype="fp32", precision="ieee"),
           4, _ALIGNED)
    ids = {"ids_ptr": "*i32", "map_ptr": "*i32"}
    yield ("align count", moe._count_kernel, {**ids, "counts_ptr": "*i32", "n_slots": "i32", "n_ids": "i32"},
           {"HAS_MAP": True, "BLOCK": 256}, 4, ())
    yield ("align offsets E128", moe._offsets_kernel,
           {"counts_ptr": "*i32", "cursor_ptr": "*i32", "expert_ids_ptr": "*i32", "ntpp_ptr": "*i32",
            "n_experts": "i32", "n_blocks": "i32"}, {"BLOCK_SIZE": 16, "BLOCK_E": 128, "BLOCK_B": 32}, 4, ())
    yield ("align scatter", moe._scatter_kernel, {**ids, "cursor_ptr": "*i32", "sorted_ptr": "*i32", "n_slots": "i32",
                                            "n_ids": "i32"},
           {"HAS_MAP": False, "BLOCK": 256}, 4, ())
    yield ("topk sum k8", moe._topk_sum_kernel, {"c_ptr": "*bf16", "ids_ptr": "*i32", "map_ptr": "*i32",
                                                  "out_ptr": "*bf16", "H": "i32", "n_ids": "i32"},
           {"TOPK": 8, "HAS_MAP": True, "BLOCK_H": 1024}, 4, ("c_ptr", "out_ptr", "H"))
    routing = {"logits_ptr": "*bf16", "bias_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i32",
               "n_tokens": "i32", "n_experts": "i32", "logits_stride": "i32", "scale": "fp32"}
    for label, const in (("topk softmax E8 k2", dict(TOPK=2, BLOCK_K=2, SOFTMAX=True, HAS_BIAS=False, GROUPS=1,
                                                       TOPK_GROUP=1, BLOCK_G=1, BLOCK_T=16, BLOCK_E=8)),
                         ("grouped V3 E256 k8", dict(TOPK=8, BLOCK_K=8, SOFTMAX=False, HAS_BIAS=True, GROUPS=8,
                                                     TOPK_GROUP=4, BLOCK_G=8, BLOCK_T=4, BLOCK_E=256))):
        yield label, moe_routing._topk_kernel, routing, {"RENORMALIZE": True, **const}, 4, ()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="cuda:90")
    args = parser.parse_args(argv)
    report = {}
    for label, kernel, sig, const, warps, aligned in cases():
        try:
            report[label] = compile_one(kernel, sig, const, warps, aligned, args.target)
        except Exception as err:  # reported per case
            report[label] = {"error": f"{type(err).__name__}: {str(err)[:1500]}"}
    print(json.dumps(report))
    return 1 if any("error" in info for info in report.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
