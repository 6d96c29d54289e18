"""One launch of every activation and norm kernel variant (the case tables' rows), for
``compute-sanitizer``:

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
    from customop.backends.triton import grouped_norm
    from customop.backend_loader import load_backend
    from customop.samples.activation import CASES
    from customop.samples.layernorm import CASES as NORMS

    dev = "cuda"
    bf = torch.bfloat16

    def rnd(*shape, dtype=bf):
        return torch.randn(*shape, device=dev).to(dtype)

    launched = 0
    # every activation variant of the case table, with the arguments its op passes
    for case in CASES:
        op = case.build().to(dev)
        args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in op.math_args())
        launcher = act.KERNELS[f"customop::{case.op}"]
        inputs = ((rnd(7, 2 * 4231), rnd(3, 2 * 14336), rnd(40, 2 * 64), rnd(9, 2 * 300 + 40)[:, :600])
                  if case.gated else (rnd(7, 4231), rnd(1, 1), rnd(33, 100), rnd(4, 8192)))
        for x in inputs:
            launcher(x, *args)
            launched += 1
    wide = rnd(2, 2 * 40000)  # gelu_and_mul_sparse's looped variant
    act.gelu_and_mul_sparse(wide, 0.8, "tanh")
    # every norm variant of the case table, through forward_kernel (the kernels registered for CUDA)
    load_backend("cuda")
    for shape in ((7, 4231), (33, 100), (2, 8192), (2, 40000)):
        for case in NORMS:
            op = case.build(shape[-1], bf).to(dev)
            op.forward_kernel(*(rnd(*shape) for _ in case.arguments))
            launched += 1
    x = rnd(12, 256)
    grouped_norm.rms_norm_gated(x, rnd(256), rnd(12, 256), 1e-5, 64, False, False)
    torch.cuda.synchronize()
    print(f"sanitize_kernels: {launched + 2} launches done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
