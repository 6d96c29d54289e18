"""CPU timings of SAM attention with decomposed relative positions (``rel_pos_attention``): the spec
(``forward_native``: the whole ``[B, heads, H*W, H*W]`` bias, then one SDPA) vs ``forward_cpu``
(``forward_kernel``: the bias built contiguous, a block of entries per SDPA call) vs
``torch.compile(forward_native)`` (static shapes), plus the blocked form at other block sizes.

    .venv/bin/python -m benchmarks.cpu.rel_pos [--dtypes fp32,bf16] [--heads 12x64]
        [--grids 1x14x14,25x14x14,1x64x64] [--blocks 20,24,all] [--min-time 0.4] [--threads N]
        [--clock wall|cpu]

A grid ``BxHxW`` is B images (or windows) of H x W tokens, on position tables for that grid (no
interpolation: it costs the same on both paths). ``--blocks``: log2 of the block in bias
entries, ``all`` for one block (only the layout differs from the spec). Cells are ``p5 / median``
milliseconds per call, the paths taking turns call by call in a shuffled order
(``benchmarks/cpu/layernorm.py`` says why); each path is first checked against the spec (``=``
marks a bitwise equal result).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.cpu.layernorm import time_us
from benchmarks.cpu.timing import add_timing_args, start_run
from customop.config import Config, use_config
from customop.math.attention import rel_pos_attention_blocked
from customop.ops.attention import RelPosAttention

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def build(dim: int, heads: int, height: int, width: int, dtype: torch.dtype) -> RelPosAttention:
    with use_config(Config(custom_ops=["all"])):
        op = RelPosAttention(dim, heads, use_rel_pos=True, input_size=(height, width), params_dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in op.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() == 2 and p.shape[0] < dim else dim ** -0.5))
    return op.requires_grad_(False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--heads", default="12x64", help="heads x head_dim")
    parser.add_argument("--grids", default="1x14x14,25x14x14,1x64x64")
    parser.add_argument("--blocks", default="20,24,all", help="log2 block sizes of the extra blocked columns")
    add_timing_args(parser)
    args = parser.parse_args()
    clock = start_run(args)
    blocks = [b for b in args.blocks.split(",") if b]
    print(f"forward_cpu's block: 2^{RelPosAttention.bias_block['cpu'].bit_length() - 1} entries")
    print()
    print("| dtype | heads | grid | spec = forward_native (ms) | forward_cpu (ms) | compile (ms) | "
          + "".join(f"block 2^{b} (ms) | " if b != "all" else "one block (ms) | " for b in blocks)
          + "forward_cpu x spec | forward_cpu x compile |")
    print("|---|---|---|---:|---:|---:|" + "---:|" * len(blocks) + "---:|---:|")
    cell = lambda m, same: f"{m[0] / 1e3:.1f} / {m[1] / 1e3:.1f}{' =' if same else ''}"  # noqa: E731
    with torch.no_grad():
        for dtype_name in args.dtypes.split(","):
            dtype = DTYPES[dtype_name]
            h, d = (int(n) for n in args.heads.split("x"))
            for grid in args.grids.split(","):
                batch, height, width = (int(n) for n in grid.split("x"))
                op = build(h * d, h, height, width, dtype)
                x = torch.randn(batch, height, width, h * d).to(dtype)
                params = (op.qkv.weight, op.qkv.bias, op.proj.weight, op.proj.bias, op.num_heads, op.rel_pos_h,
                          op.rel_pos_w)
                compiled = torch.compile(op.forward_native, dynamic=False)
                paths = [lambda: op.forward_native(x), lambda: op.forward_cpu(x), lambda: compiled(x)]
                for b in blocks:
                    size = batch * h * (height * width) ** 2 if b == "all" else 1 << int(b)
                    paths.append(lambda size=size: rel_pos_attention_blocked(x, *params, block=size))
                want = paths[0]()
                same = [True]
                for path in paths[1:]:
                    got = path()
                    err = (got.float() - want.float()).abs().max().item()
                    assert err < (1e-4 if dtype == torch.float32 else 3e-2), f"a blocked path is off by {err}"
                    same.append(torch.equal(got, want))
                times = time_us(paths, args.min_time, clock)
                cells = " | ".join(cell(t, s) for t, s in zip(times, same))
                print(f"| {dtype_name} | {h}x{d} | {grid} | {cells} | {times[0][1] / times[1][1]:.2f} | "
                      f"{times[2][1] / times[1][1]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
