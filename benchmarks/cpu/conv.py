"""CPU timings of the patch-embedding convolutions (``conv2d``, ``conv3d``): the linear form (one
GEMM over the unfolded patches) against oneDNN's convolution (``F.conv2d``/``F.conv3d``),
``torch.compile(forward_native)`` (static shapes) and ``forward_cpu`` (the shipped choice).

    .venv/bin/python -m benchmarks.cpu.conv [--dtypes fp32,bf16] [--cases 0,2,...] [--no-compile]
        [--min-time 0.4] [--threads N] [--clock wall|cpu]

Shapes are vision encoders' patch embeddings: Qwen2-VL's 3x(2,14,14) -> 1280 over 256 to 4096
patches (pixel values arrive as ``[patches, 3, 2, 14, 14]``), CLIP/SigLIP-style 14- and 16-pixel
2-D patches of 336-448 pixel images -> 1024-1280. Cells are ``p5 / median`` milliseconds per call,
the paths taking turns call by call in a shuffled order (``benchmarks/cpu/layernorm.py`` says
why); every path is first checked against a float64 run of the spec on the same inputs
(normwise relative error, printed: fp32 within 1e-5, 16-bit within four unit roundoffs).
"""

from __future__ import annotations

import argparse

import torch

from customop.benchmarks.cpu.timing import TOLERANCE, add_timing_args, checked_times, ms_cells, start_run
from customop.config import Config, use_config
from customop.ops.conv import Conv2dLayer, Conv3dLayer, conv, conv_layer, patch_linear

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
    parser.add_argument("--cases", default=None, help="indices into CASES, comma-separated (default: all)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile(forward_native) column")
    add_timing_args(parser)
    args = parser.parse_args()
    clock = start_run(args)
    names = ["oneDNN conv", "linear form", *([] if args.no_compile else ["compile"]), "forward_cpu"]
    picked = CASES if args.cases is None else [CASES[int(i)] for i in args.cases.split(",")]
    print("| dtype | shape | out | " + " | ".join(f"{n} (ms)" for n in names) + " | linear x | forward_cpu x | "
          + ("" if args.no_compile else "forward_cpu x compile | ") + "error vs float64 (" + ", ".join(names) + ") |")
    print("|---|---|---:|" + "---:|" * (len(names) + 3 + (not args.no_compile)))
    with torch.no_grad():
        for dtype_name in args.dtypes.split(","):
            dtype = DTYPES[dtype_name]
            for label, cls, shape, out, kernel in picked:
                with use_config(Config(custom_ops=["all"])):
                    op = cls(shape[1], out, kernel, stride=kernel, params_dtype=dtype)
                op.weight.normal_(0, 0.02)
                op.bias.normal_()
                x = torch.randn(shape).to(dtype)
                a = (op.stride, op.padding, op.dilation, op.groups)
                want = conv_layer(x.double(), op.weight.double(), op.bias.double(), *a)
                torch._dynamo.reset()  # a fresh graph per case: static shapes, no recompile limit
                compiled = torch.compile(op.forward_native, dynamic=False)
                fns = {"oneDNN conv": lambda: conv(x, op.weight, op.bias, *a),
                       "linear form": lambda: patch_linear(x, op.weight, op.bias),
                       "compile": lambda: compiled(x), "forward_cpu": lambda: op.forward_cpu(x)}
                times, errors = checked_times({n: fns[n] for n in names}, want, TOLERANCE[dtype],
                                              f"{label} {dtype_name}", args.min_time, clock)
                cells = ms_cells(times, names)
                ratios = [times["oneDNN conv"][0] / times["linear form"][0], times["oneDNN conv"][0] / times["forward_cpu"][0]]
                if not args.no_compile:
                    ratios.append(times["compile"][1] / times["forward_cpu"][1])
                print(f"| {dtype_name} | {label} | {out} | {cells} | " + " | ".join(f"{r:.2f}" for r in ratios)
                      + f" | {', '.join(errors)} |", flush=True)

if __name__ == "__main__":
    main()
