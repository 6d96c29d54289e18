"""CPU timings of the patch-embedding convolutions (``conv2d``, ``conv3d``): the linear form (one
GEMM over the unfolded patches) against oneDNN's convolution (``F.conv2d``/``F.conv3d``), and
``forward_cpu`` (the shipped choice).

    .venv/bin/python -m benchmarks.cpu.conv [--dtypes fp32,bf16] [--min-time 0.4] [--threads N] [--clock wall|cpu]

Shapes are vision encoders' patch embeddings: Qwen2-VL's 3x(2,14,14) -> 1280 over 256 to 4096
patches (pixel values arrive as ``[patches, 3, 2, 14, 14]``), CLIP/SigLIP-style 14- and 16-pixel
2-D patches of 336-448 pixel images -> 1024-1280. Cells are ``p5 / median`` milliseconds per call,
the paths taking turns call by call in a shuffled order (``benchmarks/cpu/layernorm.py`` says
why); every path is first checked against the convolution.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.cpu.layernorm import time_us
from benchmarks.cpu.timing import add_timing_args, start_run
from customop.config import Config, use_config
from customop.ops.conv import Conv2dLayer, Conv3dLayer, conv, patch_linear

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: (label, class, input shape, out channels, kernel)
CASES = (
    ("qwen2-vl 256 patches", Conv3dLayer, (256, 3, 2, 14, 14), 1280, (2, 14, 14)),
    ("qwen2-vl 1024 patches", Conv3dLayer, (1024, 3, 2, 14, 14), 1280, (2, 14, 14)),
    ("qwen2-vl 4096 patches", Conv3dLayer, (4096, 3, 2, 14, 14), 1280, (2, 14, 14)),
    ("video 1x3x4x224x224", Conv3dLayer, (1, 3, 4, 224, 224), 1280, (2, 14, 14)),
    ("clip 1x3x336x336 /14", Conv2dLayer, (1, 3, 336, 336), 1024, (14, 14)),
    ("clip 4x3x336x336 /14", Conv2dLayer, (4, 3, 336, 336), 1024, (14, 14)),
    ("siglip 1x3x384x384 /16", Conv2dLayer, (1, 3, 384, 384), 1152, (16, 16)),
    ("2x3x448x448 /14", Conv2dLayer, (2, 3, 448, 448), 1280, (14, 14)),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="fp32,bf16")
    add_timing_args(parser)
    args = parser.parse_args()
    clock = start_run(args)
    print("| dtype | shape | out | oneDNN conv (ms) | linear form (ms) | forward_cpu (ms) | linear x | forward_cpu x |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    with torch.no_grad():
        for dtype_name in args.dtypes.split(","):
            dtype = DTYPES[dtype_name]
            for label, cls, shape, out, kernel in CASES:
                with use_config(Config(custom_ops=["all"])):
                    op = cls(shape[1], out, kernel, stride=kernel, params_dtype=dtype)
                op.weight.normal_(0, 0.02)
                op.bias.normal_()
                x = torch.randn(shape).to(dtype)
                a = (op.stride, op.padding, op.dilation, op.groups)
                paths = [lambda: conv(x, op.weight, op.bias, *a), lambda: patch_linear(x, op.weight, op.bias),
                         lambda: op.forward_cpu(x)]
                want = paths[0]().float()
                for p in paths[1:]:
                    err = (p().float() - want).abs().max().item()
                    assert err < (1e-3 if dtype == torch.float32 else 0.1), f"{label}: off by {err}"
                times = time_us(paths, args.min_time, clock)
                cells = " | ".join(f"{b / 1e3:.2f} / {m / 1e3:.2f}" for b, m in times)
                print(f"| {dtype_name} | {label} | {out} | {cells} | {times[0][0] / times[1][0]:.2f} | "
                      f"{times[0][0] / times[2][0]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
