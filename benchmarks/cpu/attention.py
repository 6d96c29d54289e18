"""CPU timings of encoder attention (``mm_encoder_attn``): the spec's segment loop vs SDPA's CPU
flash kernel on the whole packed sequence with a block-diagonal mask vs ``forward_cpu`` (runs of
equal segments batched into one SDPA call each).

    .venv/bin/python -m benchmarks.cpu.attention [--dtypes fp32,bf16] [--heads 16x80,16x64]
        [--packings 1024/4,...] [--min-time 0.4] [--threads N] [--clock wall|cpu]

A packing ``T/N`` is T tokens in N equal segments; ``T/mixed`` is T tokens in segments of
uneven lengths (windows of 64 with one odd-sized image). Cells are ``p5 / median`` milliseconds
per call, the paths taking turns call by call in a shuffled order (``benchmarks/cpu/layernorm.py``
says why); every path is first checked against the loop (bitwise for ``forward_cpu``). The masked
path does ``T^2`` work where the others do ``sum(L_i^2)``: skipped with ``--no-mask`` and above
``--mask-max-tokens``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.cpu.layernorm import time_us
from benchmarks.cpu.timing import add_timing_args, start_run
from customop.config import Config, use_config
from customop.ops.attention import MMEncoderAttention

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PACKINGS = ("256/1", "256/4", "1024/1", "1024/4", "1024/16", "1024/64", "4096/4", "4096/16", "4096/64",
            "4096/mixed")


def lengths_of(packing: str) -> list[int]:
    tokens, segments = packing.split("/")
    t = int(tokens)
    if segments == "mixed":  # 64-token windows around one image of an odd size
        odd = t // 4 + 7
        return [64] * ((t - odd) // 64) + [odd] + [1] * ((t - odd) % 64)
    n = int(segments)
    return [t // n] * n


def masked(op: MMEncoderAttention, q, k, v, cu_seqlens):
    """One SDPA over the packed sequence with a block-diagonal boolean mask."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    segment = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    mask = segment[:, None] == segment[None, :]
    q4, k4, v4 = (t.view(1, t.shape[1], -1, op.head_size).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=op.scale,
                                         enable_gqa=op.num_heads != op.num_kv_heads)
    return out.transpose(1, 2).reshape(q.shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--heads", default="16x80,16x64", help="heads x head_size, comma-separated")
    parser.add_argument("--packings", default=",".join(PACKINGS))
    parser.add_argument("--mask-max-tokens", type=int, default=4096)
    parser.add_argument("--no-mask", action="store_true")
    add_timing_args(parser)
    args = parser.parse_args()
    clock = start_run(args)
    print("| dtype | heads | packing | loop = forward_native (ms) | masked packed SDPA (ms) | forward_cpu (ms) | "
          "masked x | forward_cpu x |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    with torch.no_grad():
        for dtype_name in args.dtypes.split(","):
            dtype = DTYPES[dtype_name]
            for heads in args.heads.split(","):
                h, d = (int(n) for n in heads.split("x"))
                with use_config(Config(custom_ops=["all"])):
                    op = MMEncoderAttention(h, d)
                for packing in args.packings.split(","):
                    lengths = lengths_of(packing)
                    t = sum(lengths)
                    q, k, v = (torch.randn(1, t, h * d).to(dtype) for _ in range(3))
                    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
                    paths = [lambda: op.forward_native(q, k, v, cu), lambda: op.forward_cpu(q, k, v, cu)]
                    want = paths[0]()
                    assert torch.equal(paths[1](), want), "forward_cpu is not bitwise the loop"
                    use_mask = not args.no_mask and t <= args.mask_max_tokens
                    if use_mask:
                        paths.append(lambda: masked(op, q, k, v, cu))
                        err = (paths[2]().float() - want.float()).abs().max().item()
                        assert err < (1e-4 if dtype == torch.float32 else 3e-2), f"masked path off by {err}"
                    times = time_us(paths, args.min_time, clock)
                    loop, ours = times[0], times[1]
                    mask = times[2] if use_mask else None
                    cell = lambda m: "-" if m is None else f"{m[0] / 1e3:.2f} / {m[1] / 1e3:.2f}"  # noqa: E731
                    ratio = "-" if mask is None else f"{loop[0] / mask[0]:.2f}"
                    print(f"| {dtype_name} | {heads} | {packing} | {cell(loop)} | {cell(mask)} | {cell(ours)} | "
                          f"{ratio} | {loop[0] / ours[0]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
