"""One launch of every activation and norm kernel variant, for ``compute-sanitizer``:

    compute-sanitizer --tool memcheck --error-exitcode 1 python -m tests.gpu.sanitize_kernels

Shapes are small but odd (masks), include a row-strided input and the looped norm variant, and
sit next to other allocations so that an out-of-bounds access lands on memory the sanitizer
watches. ``test_sanitizer.py`` runs this under memcheck when compute-sanitizer is installed.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402


def main() -> int:
    from customop.backends.triton import activation as act
    from customop.backends.triton import layernorm as norm

    dev = "cuda"
    bf = torch.bfloat16

    def rnd(*shape, dtype=bf):
        return torch.randn(*shape, device=dev).to(dtype)

    launched = 0
    for x in (rnd(7, 2 * 4231), rnd(3, 2 * 14336), rnd(40, 2 * 64), rnd(9, 2 * 300 + 40)[:, :600]):
        for fn, extra in ((act.silu_and_mul, ()), (act.mul_and_silu, ()), (act.gelu_and_mul, ("none",)),
                          (act.gelu_and_mul, ("tanh",)), (act.fatrelu_and_mul, (0.1,)),
                          (act.swigluoai_and_mul, (1.702, 7.0)), (act.gelu_and_mul_sparse, (0.8, "none"))):
            fn(x, *extra)
            launched += 1
    wide = rnd(2, 2 * 40000)  # gelu_and_mul_sparse's looped variant
    act.gelu_and_mul_sparse(wide, 0.8, "tanh")
    alpha = torch.tensor([0.8], device=dev, dtype=bf)
    for x in (rnd(7, 4231), rnd(1, 1), rnd(33, 100), rnd(4, 8192)):
        for fn in (act.gelu_new, act.gelu_fast, act.quick_gelu, act.relu2):
            fn(x)
        act.xielu(x, alpha, alpha, 0.5, -1e-6)
        launched += 5
    for shape in ((7, 4231), (33, 100), (2, 8192), (2, 40000)):
        x, r, z = rnd(*shape), rnd(*shape), rnd(*shape)
        w = rnd(shape[-1])
        norm.rms_norm(x, w, 1e-6)
        norm.rms_norm(x, None, 1e-6)
        norm.rms_norm(x, w.float(), 1e-6)
        norm.gemma_rms_norm(x, w, 1e-6)
        norm.fused_add_rms_norm(x, r, w, 1e-6)
        norm.gemma_fused_add_rms_norm(x, r, w, 1e-6)
        norm.rms_norm_gated(x, w, z, 1e-5, shape[-1], False, False)
        norm.rms_norm_gated(x, w, z, 1e-5, shape[-1], True, True)
        norm.rms_norm_gated(x, w, None, 1e-5, shape[-1], False, False)
        launched += 9
    x = rnd(12, 256)
    norm.rms_norm_gated(x, rnd(256), rnd(12, 256), 1e-5, 64, False, False)
    torch.cuda.synchronize()
    print(f"sanitize_kernels: {launched + 2} launches done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
