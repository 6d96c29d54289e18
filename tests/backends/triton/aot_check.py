"""Compiles the activation and norm kernels for a real GPU (sm_90, the H200) on a machine with
no GPU, and reports what the machine code looks like.

The interpreter accepts programs the GPU compiler rejects (loop-carried type changes, shape
mismatches in untaken branches) and says nothing about speed; this compiles every kernel variant
the launchers can pick and reads registers, local memory (spills) and how many global accesses
are 16 bytes wide. ``test_aot_compile.py`` runs it in a subprocess (the kernels must be imported
with ``TRITON_INTERPRET=0``); by hand:

    TRITON_INTERPRET=0 python -m tests.backends.triton.aot_check [--target cuda:90] [--only TEXT]

``--target hip:gfx942`` (MI300) compiles through Triton's AMD backend instead; the resource and
vector-width report is NVIDIA-only (it reads PTX and the cubin). ``--one-per-kernel`` compiles the
first case of each kernel only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("aot_check: run with TRITON_INTERPRET=0 (compiling needs real JIT functions)")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from customop.backends.triton import activation as act  # noqa: E402
from customop.backends.triton import grouped_norm  # noqa: E402
from customop.backends.triton import layernorm as norm  # noqa: E402

# (label, kernel, {arg: type}, {constexpr: value}, num_warps, args known to be multiples of 16)
P = "*bf16"


def _norm_sig(x=P, w=P):
    return {"x_ptr": x, "res_ptr": x, "out_ptr": x, "w_ptr": w, "b_ptr": w, "g_ptr": x, "ro_ptr": x, "n_rows": "i32",
            "n_cols": "i32", "x_stride": "i32", "res_stride": "i32", "out_stride": "i32", "g_stride": "i32",
            "ro_stride": "i32", "eps": "fp32"}


def _norm_const(res=False, weight=True, gemma=False, single=True, bm=1, bn=8192, stages=1, kind=None, bias=False):
    kind = kind if kind is not None else (norm.GEMMA if gemma else norm.RMS)
    return {"KIND": kind.value, "HAS_RESIDUAL": res, "HAS_WEIGHT": weight, "HAS_BIAS": bias, "SINGLE_TILE": single,
            "BLOCK_M": bm, "BLOCK_N": bn, "STAGES": stages}


ALIGNED_NORM = ("x_ptr", "res_ptr", "out_ptr", "w_ptr", "g_ptr", "ro_ptr", "n_cols", "x_stride", "res_stride", "out_stride",
                "g_stride", "ro_stride")
_GATED_SIG = {"x_ptr": P, "z_ptr": P, "out_ptr": P, "w_ptr": P, "n_rows": "i32", "group_size": "i32",
              "x_stride": "i32", "z_stride": "i32", "out_stride": "i32", "eps": "fp32"}
ALIGNED_LN = ALIGNED_NORM + ("b_ptr",)
_AND_MUL_SIG = {"x_ptr": P, "out_ptr": P, "n_rows": "i32", "d": "i32", "x_stride": "i32", "out_stride": "i32",
                "gate_offset": "i32", "up_offset": "i32", "param": "fp32", "param2": "fp32", "param3": "fp32",
                "param4": "fp32"}
_OAI_SIG = {"x_ptr": P, "out_ptr": P, "n_rows": "i32", "d": "i32", "x_stride": "i32", "out_stride": "i32",
            "alpha": "fp32", "limit": "fp32"}
_SPARSE_SIG = {"x_ptr": P, "out_ptr": P, "n_rows": "i32", "d": "i32", "x_stride": "i32", "out_stride": "i32",
               "std_multiplier": "fp32"}
_UNARY_SIG = {"x_ptr": P, "out_ptr": P, "numel": "i32", "alpha_p_ptr": "*fp32", "alpha_n_ptr": "*fp32",
              "beta": "fp32", "eps": "fp32"}
ROW_ALIGNED = ("x_ptr", "out_ptr", "d", "x_stride", "out_stride", "gate_offset", "up_offset")


def cases():
    k = norm._norm_kernel
    yield "rms_norm 8192", k, _norm_sig(), _norm_const(), 16, ALIGNED_NORM
    yield "rms_norm 128x32rows", k, _norm_sig(), _norm_const(bm=32, bn=128), 4, ALIGNED_NORM
    yield "rms_norm 32768", k, _norm_sig(), _norm_const(bn=32768), 32, ALIGNED_NORM
    yield "rms_norm noweight 8192", k, _norm_sig(), _norm_const(weight=False), 16, ALIGNED_NORM
    yield "rms_norm fp32 weight", k, _norm_sig(w="*fp32"), _norm_const(), 16, ALIGNED_NORM
    yield "rms_norm unaligned 4231", k, _norm_sig(), _norm_const(), 16, ("x_ptr", "res_ptr", "out_ptr", "w_ptr")
    yield "rms_norm looped", k, _norm_sig(), _norm_const(single=False), 16, ALIGNED_NORM
    yield "fused_add 8192", k, _norm_sig(), _norm_const(res=True), 16, ALIGNED_NORM
    yield "rms_norm persistent 8192", k, _norm_sig(), _norm_const(stages=2), 16, ALIGNED_NORM
    yield "fused_add persistent 4096", k, _norm_sig(), _norm_const(res=True, bn=4096, stages=2), 8, ALIGNED_NORM
    yield "fused_add fp32 4096", k, _norm_sig(x="*fp32", w="*fp32"), _norm_const(res=True, bn=4096), 8, ALIGNED_NORM
    yield "fused_add looped", k, _norm_sig(), _norm_const(res=True, single=False), 16, ALIGNED_NORM
    # the looped kernel with the width compiled in (RowConfig.const_width): chunks that divide it
    yield "rms_norm looped const width", k, _norm_sig(), {**_norm_const(single=False, bn=4096), "WIDTH": 8192}, 16, \
        ALIGNED_NORM
    yield "fused_add looped const width", k, _norm_sig(), {**_norm_const(res=True, single=False, bn=4096), "WIDTH": 4096}, \
        16, ALIGNED_NORM
    yield ("fused_add looped const width store evict", k, _norm_sig(),
           {**_norm_const(res=True, single=False, bn=4096), "WIDTH": 4096, "STORE_POLICY": "evict_first"}, 16, ALIGNED_NORM)
    yield ("fused_add single tile evict-first stores", k, _norm_sig(),
           {**_norm_const(res=True, bn=4096), "STORE_POLICY": "evict_first"}, 16, ALIGNED_NORM)
    yield "gemma 8192", k, _norm_sig(w="*fp32"), _norm_const(gemma=True), 16, ALIGNED_NORM
    yield "gemma fused_add", k, _norm_sig(), _norm_const(res=True, gemma=True), 16, ALIGNED_NORM
    # the code-generation knobs (RowConfig even / int32 / w_first / evict) and the warps the rms
    # sweep times: no bounds checks, 32-bit offsets, the weight first
    new = {"ROW_MASK": 0, "EVEN_N": True, "INT64": False, "W_FIRST": True}
    for bn, warps in ((4096, 2), (4096, 4), (4096, 8), (4096, 16), (8192, 4), (8192, 8), (8192, 16), (8192, 32)):
        for res, gemma in ((False, False), (True, False), (True, True)):
            yield (f"rms new bn={bn} w={warps} res={res} gemma={gemma}", k, _norm_sig(),
                   dict(_norm_const(res=res, gemma=gemma, bn=bn), **new), warps, ALIGNED_NORM)
    yield "rms new 8192 no evict hint", k, _norm_sig(), {**_norm_const(), **new, "POLICY": ""}, 8, ALIGNED_NORM
    yield ("rms new tail-masked 128x32rows", k, _norm_sig(), {**_norm_const(bm=32, bn=128), **new, "ROW_MASK": 1}, 4,
           ALIGNED_NORM)
    yield ("fused_add new persistent tail 8192x2rows", k, _norm_sig(),
           {**_norm_const(res=True, bm=2, stages=2), **new, "ROW_MASK": 1, "PERSISTENT": True}, 16, ALIGNED_NORM)
    yield ("fused_add new persistent 4096", k, _norm_sig(),
           {**_norm_const(res=True, bn=4096, stages=2), **new, "PERSISTENT": True}, 8, ALIGNED_NORM)
    yield ("rms new unaligned 4231 int64", k, _norm_sig(), {**_norm_const(), **new, "EVEN_N": False, "INT64": True}, 16,
           ("x_ptr", "res_ptr", "out_ptr", "w_ptr"))
    g = grouped_norm._rms_norm_gated_kernel
    gal = ("x_ptr", "z_ptr", "out_ptr", "w_ptr", "group_size", "x_stride", "z_stride", "out_stride")
    for z, nbg, sig in ((True, False, False), (True, True, True)):
        const = {"HAS_Z": z, "NORM_BEFORE_GATE": nbg, "SIGMOID": sig, "SINGLE_TILE": True, "BLOCK_M": 1, "BLOCK_N": 8192}
        yield f"gated z={z} nbg={nbg} sigmoid={sig}", g, _GATED_SIG, const, 16, gal
    const = {"HAS_Z": True, "NORM_BEFORE_GATE": False, "SIGMOID": False, "SINGLE_TILE": True, "BLOCK_M": 4, "BLOCK_N": 1024}
    yield "gated group 1024 x4 rows", g, _GATED_SIG, const, 4, gal
    const = {"HAS_Z": True, "NORM_BEFORE_GATE": True, "SIGMOID": False, "SINGLE_TILE": False, "BLOCK_M": 1, "BLOCK_N": 8192}
    yield "gated looped", g, _GATED_SIG, const, 16, gal
    # fused_rms_norm_gated / fused_add_rms_norm_gated: the row-norm kernel (KIND RMS_FP32) with a
    # gate, no weight / an fp32 residual sum into a buffer of its own
    fused = _norm_const(kind=norm.RMS_FP32, bn=4096)
    yield ("fused_rms_norm_gated noweight 4096", k, _norm_sig(),
           dict(fused, HAS_WEIGHT=False, GATE=norm.SILU_GATE.value), 8, ALIGNED_NORM)
    yield ("fused_add_rms_norm_gated 4096", k, dict(_norm_sig(), ro_ptr="*fp32"),
           dict(fused, HAS_RESIDUAL=True, GATE=norm.SIGMOID_GATE.value, **new), 8, ALIGNED_NORM)
    yield ("fused_add_rms_norm_gated looped", k, dict(_norm_sig(), ro_ptr="*fp32"),
           dict(fused, HAS_RESIDUAL=True, GATE=norm.SILU_GATE.value, SINGLE_TILE=False), 16, ALIGNED_NORM)
    # the layer norms: the same kernel, centred (KIND LAYER / NEMOTRON), with a bias
    ln = norm._norm_kernel

    def ln_const(res=False, one_plus=False, single=True, bm=1, bn=8192, stages=1, weight=True, bias=True):
        return _norm_const(res=res, weight=weight, single=single, bm=bm, bn=bn, stages=stages, bias=bias,
                           kind=norm.NEMOTRON if one_plus else norm.LAYER)

    yield "layer_norm 8192", ln, _norm_sig(), ln_const(), 16, ALIGNED_LN
    yield "layer_norm noaffine 128x32rows", ln, _norm_sig(), ln_const(weight=False, bias=False, bm=32, bn=128), 4, ALIGNED_LN
    yield "layer_norm fp32 weight", ln, _norm_sig(w="*fp32"), ln_const(), 16, ALIGNED_LN
    yield "layer_norm looped", ln, _norm_sig(), ln_const(single=False, bn=4096), 16, ALIGNED_LN
    yield "nemotron 8192", ln, _norm_sig(), ln_const(one_plus=True), 16, ALIGNED_LN
    yield "nemotron fused_add persistent 4096", ln, _norm_sig(), ln_const(res=True, one_plus=True, bn=4096, stages=2), 8, ALIGNED_LN
    yield "nemotron fused_add looped", ln, _norm_sig(), ln_const(res=True, one_plus=True, single=False, bn=4096), 16, ALIGNED_LN
    for bn, warps in ((4096, 8), (8192, 16)):
        for res, one_plus in ((False, False), (True, True)):
            yield (f"layer new bn={bn} w={warps} res={res} nemotron={one_plus}", ln, _norm_sig(),
                   dict(ln_const(res=res, one_plus=one_plus, bn=bn), **new), warps, ALIGNED_LN)
    for name, code in (("silu", act.SILU), ("gelu", act.GELU), ("fatrelu", act.FATRELU), ("swiglustep", act.SWIGLUSTEP),
                       ("silu_clamp", act.SILU_CLAMP), ("situ", act.SITU), ("situ_linear", act.SITU_LINEAR)):
        yield f"and_mul {name} 1x2048", act._and_mul_kernel, _AND_MUL_SIG, {"ACT": code.value, "BLOCK_M": 1, "BLOCK_N": 2048}, 4, ROW_ALIGNED
    for name, code in (("situ", act.SITU), ("situ_linear", act.SITU_LINEAR)):
        # the hardware tanh (inline PTX): NVIDIA targets only
        yield (f"and_mul {name} fast-tanh even int32 1x2048 nvidia-only", act._and_mul_kernel, _AND_MUL_SIG,
               {"ACT": code.value, "BLOCK_M": 1, "BLOCK_N": 2048, "EVEN": True, "INT64": False, "FAST_TANH": True}, 8,
               ROW_ALIGNED)
    yield "and_mul silu 1x512", act._and_mul_kernel, _AND_MUL_SIG, {"ACT": act.SILU.value, "BLOCK_M": 1, "BLOCK_N": 512}, 1, ROW_ALIGNED
    yield "and_mul silu 16x128", act._and_mul_kernel, _AND_MUL_SIG, {"ACT": act.SILU.value, "BLOCK_M": 16, "BLOCK_N": 128}, 4, ROW_ALIGNED
    # the tile sweep's shapes with the code-generation knobs (no bounds checks, 32-bit offsets)
    for bn, warps in ((128, 1), (256, 1), (256, 2), (512, 2), (512, 4), (512, 8), (1024, 2), (1024, 4), (1024, 8),
                      (2048, 4), (2048, 8), (4096, 8)):
        # below 8 bf16 elements (16 bytes) a thread, no 16-byte access exists to compile to
        narrow = " narrow-tile" if bn < 8 * 32 * warps else ""
        yield (f"and_mul silu even int32 1x{bn} w={warps}{narrow}", act._and_mul_kernel, _AND_MUL_SIG,
               {"ACT": act.SILU.value, "BLOCK_M": 1, "BLOCK_N": bn, "EVEN": True, "INT64": False}, warps, ROW_ALIGNED)
    yield ("and_mul gelu even int32 1x1024", act._and_mul_kernel, _AND_MUL_SIG,
           {"ACT": act.GELU.value, "BLOCK_M": 1, "BLOCK_N": 1024, "EVEN": True, "INT64": False}, 2, ROW_ALIGNED)
    # the small decode grids: the width compiled in, indexed flat (TILE_TABLE's small_grid_*)
    for name, code, bn, warps in (("gelu", act.GELU, 256, 4), ("fatrelu", act.FATRELU, 512, 8)):
        yield (f"and_mul {name} small-grid const-width 1x{bn} w={warps} narrow-tile", act._and_mul_kernel, _AND_MUL_SIG,
               {"ACT": code.value, "BLOCK_M": 1, "BLOCK_N": bn, "EVEN": True, "INT64": False, "WIDTH": 14336}, warps,
               ROW_ALIGNED)
    yield ("swigluoai int32 1x2048", act._swigluoai_kernel, _OAI_SIG, {"BLOCK_M": 1, "BLOCK_N": 2048, "INT64": False}, 4,
           ROW_ALIGNED)
    yield "swigluoai 1x2048", act._swigluoai_kernel, _OAI_SIG, {"BLOCK_M": 1, "BLOCK_N": 2048}, 4, ROW_ALIGNED
    for approx in (False, True):
        yield (f"gelu_sparse 16384 tanh={approx}", act._gelu_sparse_kernel, _SPARSE_SIG,
               {"APPROX_TANH": approx, "SINGLE_TILE": True, "BLOCK_M": 1, "BLOCK_N": 16384}, 32, ROW_ALIGNED)
    yield ("gelu_sparse looped", act._gelu_sparse_kernel, _SPARSE_SIG,
           {"APPROX_TANH": False, "SINGLE_TILE": False, "BLOCK_M": 1, "BLOCK_N": 8192}, 16, ROW_ALIGNED)
    for name in ("GELU", "GELU_NEW", "QUICK_GELU", "XIELU"):
        yield (f"unary {name.lower()} 4096", act._unary_kernel, _UNARY_SIG, {"ACT": getattr(act, name).value, "BLOCK": 4096},
               8, ("x_ptr", "out_ptr", "numel", "alpha_p_ptr", "alpha_n_ptr"))
    yield ("unary gelu_new 4096 i64 numel", act._unary_kernel, dict(_UNARY_SIG, numel="i64"),
           {"ACT": act.GELU_NEW.value, "BLOCK": 4096}, 8, ("x_ptr", "out_ptr", "numel"))
    # Inductor's code for a streaming op: no bounds checks, 32-bit offsets, no eviction hint
    yield ("unary quick_gelu even int32 no-evict 2048", act._unary_kernel, _UNARY_SIG,
           {"ACT": act.QUICK_GELU.value, "BLOCK": 2048, "EVEN": True, "INT64": False, "EVICT": ""}, 4,
           ("x_ptr", "out_ptr", "numel", "alpha_p_ptr", "alpha_n_ptr"))
    yield ("and_mul silu even int32 no-evict 1x1024", act._and_mul_kernel, _AND_MUL_SIG,
           {"ACT": act.SILU.value, "BLOCK_M": 1, "BLOCK_N": 1024, "EVEN": True, "INT64": False, "EVICT": ""}, 4,
           ROW_ALIGNED)


def _resource_usage(cubin: bytes, ptx: str, arch: int) -> dict[str, int]:
    """Registers from the cubin; spill bytes from ``ptxas -v`` on the PTX (the cubin's stack
    frame size also counts frames that are not spills)."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "--dump-resource-usage", f.name],
                              capture_output=True, text=True).stdout
    usage = {key.lower(): int(val) for key, val in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text)}
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        for tool in ("ptxas-blackwell", "ptxas"):  # the one that accepts this PTX version
            path = os.path.join(bin_dir, tool)
            if not os.path.exists(path):
                continue
            out = subprocess.run([path, f"-arch=sm_{arch}a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
            found = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out.stderr)
            if out.returncode == 0 and found:
                usage["spill_bytes"] = int(found.group(1)) + int(found.group(2))
                break
    return usage


def compile_one(kernel, sig, const, warps, aligned, target):
    fn = kernel if isinstance(kernel, triton.runtime.jit.JITFunction) else kernel.fn
    sig, const = dict(sig), dict(const)
    for param in fn.params:  # constexprs a case leaves out take the kernel's defaults
        if param.is_constexpr and param.name not in sig and param.name not in const and param.has_default:
            const[param.name] = param.default
    for name in const:
        sig[name] = "constexpr"
    names = fn.arg_names
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned if a in names}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    backend, arch = target.split(":")
    if backend == "hip":  # a wavefront is 64 lanes: half the warps for the same threads
        compiled = triton.compile(src, target=GPUTarget("hip", arch, 64), options={"num_warps": max(1, warps // 2)})
        return {"compiled": sorted(compiled.asm)}
    compiled = triton.compile(src, target=GPUTarget("cuda", int(arch), 32), options={"num_warps": warps})
    ptx = compiled.asm["ptx"]
    usage = _resource_usage(compiled.asm["cubin"], ptx, int(arch))
    return {
        "regs": usage.get("reg"), "local_bytes": usage.get("local", 0), "spill_bytes": usage.get("spill_bytes"),
        "shared": usage.get("shared", 0),
        "ld": len(re.findall(r"\bld\.global", ptx)), "ld_v4": len(re.findall(r"\bld\.global[.\w:]*\.v4", ptx)),
        "st": len(re.findall(r"\bst\.global", ptx)), "st_v4": len(re.findall(r"\bst\.global[.\w:]*\.v4", ptx)),
        "cp_async": len(re.findall(r"\bcp\.async\.", ptx)), "dyn_shared": compiled.metadata.shared,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="cuda:90", help="cuda:<sm> or hip:<gfx arch>")
    parser.add_argument("--one-per-kernel", action="store_true")
    parser.add_argument("--only", default="")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    report, failures, seen = {}, 0, set()
    for label, kernel, sig, const, warps, aligned in cases():
        if (args.only and args.only not in label) or (args.one_per_kernel and kernel in seen):
            continue
        if "nvidia-only" in label and not args.target.startswith("cuda"):
            continue
        seen.add(kernel)
        t0 = time.perf_counter()
        try:
            info = compile_one(kernel, sig, const, warps, aligned, args.target)
        except Exception as err:  # reported per case; the exit status says whether any failed
            info = {"error": f"{type(err).__name__}: {str(err)[:2000]}"}
            failures += 1
        info["seconds"] = round(time.perf_counter() - t0, 2)
        info["warps"] = warps
        report[label] = info
        if not args.json:
            print(f"{label:40s} {info}", flush=True)
    if args.json:
        print(json.dumps(report))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
