"""The CUDA C++ row norm (``cuda_rownorm.cu``) timed beside customop, Liger and compile in the
GPU runner's own rows, timer and rounds: its variants join the four RMSNorm specs as extra
implementations ``cpp<threads>`` (threads per block; a variant that does not divide the row is
left out), checked against eager like every column. Needs nvcc and a CUDA build of torch.

    python3 benchmarks/experiments/cuda_rownorm.py OUT --ops 'rms_norm,gemma_*,fused_add_rms_norm' \\
        --tokens 1,16,256,4096 --rounds 5

``CPP_THREADS`` (default 128,256,512,1024) picks the variants."""

import os
import sys
import time

import torch
from torch.utils.cpp_extension import load_inline

from customop.benchmarks import runner
from customop.benchmarks.specs import layernorm as specs

_DECLARATION = ("void norm(torch::Tensor x, torch::Tensor r, torch::Tensor w, torch::Tensor out, double eps, "
                "bool gemma, bool has_r, int64_t threads);")
# spec -> (Gemma's 1 + w in fp32 rather than Llama's multiply in bf16, in-place residual add)
_VARIANTS = {"rms_norm": (False, False), "gemma_rms_norm": (True, False), "fused_add_rms_norm": (False, True),
             "gemma_fused_add_rms_norm": (True, True)}


def build():
    started = time.time()
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_rownorm.cu")) as f:
        ext = load_inline("customop_cuda_rownorm", cpp_sources=_DECLARATION, cuda_sources=f.read(),
                          functions=["norm"], extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"])
    print(f"cuda_rownorm built in {time.time() - started:.0f} s", flush=True)
    return ext


def factory(ext, gemma: bool, residual: bool, threads: int):
    def make(inputs):
        x = inputs["x"]
        vectors = x.shape[1] // 8  # 16-byte vectors of bf16 per row
        if vectors < threads or vectors % threads:
            return None
        w = inputs["gemma_weight" if gemma else "weight"]
        if residual:  # in place, as the customop column: x <- normed, residual <- x + residual
            r = inputs["residual"]

            def fused_add():
                ext.norm(x, r, w, x, specs.EPS, gemma, True, threads)
                return x, r

            return fused_add

        def norm():
            out = torch.empty_like(x)
            ext.norm(x, x, w, out, specs.EPS, gemma, False, threads)
            return out

        return norm

    return make


def main() -> int:
    ext = build()
    threads = [int(v) for v in os.environ.get("CPP_THREADS", "128,256,512,1024").split(",")]
    for spec in specs.SPECS:
        if spec.name in _VARIANTS:
            for n in threads:
                spec.impls[f"cpp{n}"] = factory(ext, *_VARIANTS[spec.name], n)
    return runner.main(["--out", sys.argv[1], *sys.argv[2:]])


if __name__ == "__main__":
    sys.exit(main())
