"""CPU timings of the attention family, one sub-command per op:

- ``encoder`` (the default: the commands recorded in benchmarks/results/cpu_attention.md still run
  without it): encoder attention (``mm_encoder_attn``), the spec's segment loop vs SDPA's CPU flash
  kernel on the whole packed sequence with a block-diagonal mask vs ``forward_cpu`` (runs of equal
  segments batched into one SDPA call each) vs ``torch.compile(forward_native)``;
- ``rel_pos``: SAM attention with decomposed relative positions (``rel_pos_attention``), the spec
  vs ``forward_cpu`` (the bias built in blocks) vs ``torch.compile(forward_native)``, plus the
  blocked form at other block sizes;
- ``mla``: DeepSeek MLA over a paged latent cache (``multi_head_latent_attention``), decode and
  prefill batches: the spec vs ``torch.compile(forward_native)`` vs ``forward_kernel`` (the
  library ops' CPU bodies) vs ``forward_cpu``.

    .venv/bin/python -m benchmarks.cpu.attention [encoder] [--dtypes fp32,bf16] [--heads 16x80,16x64]
        [--packings 1024/4,...] [--mask-max-tokens 4096] [--no-mask] [--no-compile] [TIMING]
    .venv/bin/python -m benchmarks.cpu.attention rel_pos [--dtypes fp32,bf16] [--heads 12x64]
        [--grids 1x14x14,25x14x14,1x64x64] [--blocks 20,24,all] [TIMING]
    .venv/bin/python -m benchmarks.cpu.attention mla [--dtypes bf16,fp32] [--cases decode:1x512,...]
        [--heads 16] [--dims 128,64,128,512] [--q-lora 0] [--hidden 2048] [--block-size 64] [--no-compile] [TIMING]

``TIMING``: ``[--min-time 0.4] [--threads N] [--clock wall|cpu]`` (``benchmarks/cpu/timing.py``).
Cells are ``p5 / median`` milliseconds per call, the paths taking turns call by call in a shuffled
order (``benchmarks/cpu/layernorm.py`` says why); every path is first checked (each sub-command's
help says against what).
"""

from __future__ import annotations

import argparse
import copy
import math
import sys

import torch
import torch.nn.functional as F

from customop.benchmarks.cpu.timing import (TOLERANCE, add_timing_args, checked_times, fresh_compile, ms_cells,
                                            start_run, time_us)
from customop.config import Config, use_config
from customop.math.attention import rel_pos_attention_blocked
from customop.math.mla import MLAMetadata
from customop.ops.attention import MMEncoderAttention, RelPosAttention
from customop.ops.layernorm import RMSNorm
from customop.ops.linear import ReplicatedLinear
from customop.ops.mla import MLAModules, MultiHeadLatentAttentionWrapper
from customop.ops.rotary_embedding.deepseek_yarn import DeepseekScalingRotaryEmbedding

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ---- encoder: mm_encoder_attn ---------------------------------------------------------------------

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


def add_encoder_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--heads", default="16x80,16x64", help="heads x head_size, comma-separated")
    parser.add_argument("--packings", default=",".join(PACKINGS))
    parser.add_argument("--mask-max-tokens", type=int, default=4096)
    parser.add_argument("--no-mask", action="store_true")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile(forward_native) column")


def run_encoder(args: argparse.Namespace) -> None:
    """Encoder attention (``mm_encoder_attn``). A packing ``T/N`` is T tokens in N equal segments;
    ``T/mixed`` is T tokens in segments of uneven lengths (windows of 64 with one odd-sized image).
    Every path is checked against the loop (bitwise for ``forward_cpu``). The masked path does
    ``T^2`` work where the others do ``sum(L_i^2)``: skipped with ``--no-mask`` and above
    ``--mask-max-tokens``. ``compile`` is ``torch.compile(forward_native)`` with static shapes, a
    fresh graph per case (the segment lengths are read on the host, so Dynamo traces the loop
    unrolled for this case's lengths; skipped with ``--no-compile``). Ratios: the loop's time over
    the masked path's and ``forward_cpu``'s (p5), and ``compile``'s over ``forward_cpu``'s as
    ``p5 / median``. Measured 2026-12-03 (2 threads, every default size, bf16 and fp32):
    ``forward_cpu`` 1.00-2.35x ``compile``, parity (the same flash kernel) at one segment
    (docs/cpu.md, "The encoder and MoE benchmarks against torch.compile")."""
    clock = start_run(args)
    print("| dtype | heads | packing | loop = forward_native (ms) | masked packed SDPA (ms) | forward_cpu (ms) | "
          "compile (ms) | masked x | forward_cpu x | forward_cpu x compile |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    cell = lambda m: "-" if m is None else f"{m[0] / 1e3:.2f} / {m[1] / 1e3:.2f}"  # noqa: E731
    with torch.no_grad():
        for dtype_name in args.dtypes.split(","):
            dtype = DTYPES[dtype_name]
            tolerance = 1e-4 if dtype == torch.float32 else 3e-2
            for heads in args.heads.split(","):
                h, d = (int(n) for n in heads.split("x"))
                with use_config(Config(custom_ops=["all"])):
                    op = MMEncoderAttention(h, d)
                for packing in args.packings.split(","):
                    lengths = lengths_of(packing)
                    t = sum(lengths)
                    q, k, v = (torch.randn(1, t, h * d).to(dtype) for _ in range(3))
                    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
                    paths = {"loop": lambda: op.forward_native(q, k, v, cu),
                             "ours": lambda: op.forward_cpu(q, k, v, cu)}
                    want = paths["loop"]()
                    assert torch.equal(paths["ours"](), want), "forward_cpu is not bitwise the loop"
                    if not args.no_mask and t <= args.mask_max_tokens:
                        paths["mask"] = lambda: masked(op, q, k, v, cu)
                    if not args.no_compile:
                        compiled = fresh_compile(op.forward_native)
                        paths["compile"] = lambda compiled=compiled: compiled(q, k, v, cu)
                    for name in ("mask", "compile"):
                        if name in paths:
                            err = (paths[name]().float() - want.float()).abs().max().item()
                            assert err < tolerance, f"{name} path off by {err}"
                    times = dict(zip(paths, time_us(list(paths.values()), args.min_time, clock)))
                    loop, ours, mask, comp = (times.get(n) for n in ("loop", "ours", "mask", "compile"))
                    ratio = "-" if mask is None else f"{loop[0] / mask[0]:.2f}"
                    vs_compile = "-" if comp is None else f"{comp[0] / ours[0]:.2f} / {comp[1] / ours[1]:.2f}"
                    print(f"| {dtype_name} | {heads} | {packing} | {cell(loop)} | {cell(mask)} | {cell(ours)} | "
                          f"{cell(comp)} | {ratio} | {loop[0] / ours[0]:.2f} | {vs_compile} |", flush=True)


# ---- rel_pos: rel_pos_attention -------------------------------------------------------------------


def build_rel_pos(dim: int, heads: int, height: int, width: int, dtype: torch.dtype) -> RelPosAttention:
    with use_config(Config(custom_ops=["all"])):
        op = RelPosAttention(dim, heads, use_rel_pos=True, input_size=(height, width), params_dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in op.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() == 2 and p.shape[0] < dim else dim ** -0.5))
    return op.requires_grad_(False)


def add_rel_pos_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--heads", default="12x64", help="heads x head_dim")
    parser.add_argument("--grids", default="1x14x14,25x14x14,1x64x64")
    parser.add_argument("--blocks", default="20,24,all", help="log2 block sizes of the extra blocked columns")


def run_rel_pos(args: argparse.Namespace) -> None:
    """SAM attention with decomposed relative positions: the spec (``forward_native``: the whole
    ``[B, heads, H*W, H*W]`` bias, then one SDPA) vs ``forward_cpu`` (``forward_kernel``: the bias
    built contiguous, a block of entries per SDPA call) vs ``torch.compile(forward_native)``
    (static shapes), plus the blocked form at other block sizes. A grid ``BxHxW`` is B images (or
    windows) of H x W tokens, on position tables for that grid (no interpolation: it costs the same
    on both paths). ``--blocks``: log2 of the block in bias entries, ``all`` for one block (only
    the layout differs from the spec). Each path is checked against the spec (``=`` marks a bitwise
    equal result)."""
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
                op = build_rel_pos(h * d, h, height, width, dtype)
                x = torch.randn(batch, height, width, h * d).to(dtype)
                params = (op.qkv.weight, op.qkv.bias, op.proj.weight, op.proj.bias, op.num_heads, op.rel_pos_h,
                          op.rel_pos_w)
                compiled = fresh_compile(op.forward_native)
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


# ---- mla: multi_head_latent_attention --------------------------------------------------------------

MLA_CASES = ("decode:1x512", "decode:1x4096", "decode:8x512", "decode:8x4096", "prefill:1x512")


def build_mla(args: argparse.Namespace, dtype: torch.dtype, gen: torch.Generator) -> MultiHeadLatentAttentionWrapper:
    """A DeepSeek-style layer of random weights (customop's own submodules, enabled as an eager CPU
    server runs them) with DeepSeek-YaRN RoPE (factor 4 over 4096 positions) and DeepSeek's
    softmax scale (``(P + R) ** -0.5`` times YaRN's ``mscale ** 2``)."""
    nope, rope, v, rank = (int(n) for n in args.dims.split(","))
    heads, hidden, q_lora = args.heads, args.hidden, args.q_lora or None

    def linear(n_in: int, n_out: int) -> ReplicatedLinear:
        layer = ReplicatedLinear(n_in, n_out, bias=False, params_dtype=dtype, disable_tp=True)
        layer.weight.data = (torch.randn(n_out, n_in, generator=gen) * n_in ** -0.5).to(dtype)
        return layer

    def norm(n: int) -> RMSNorm:
        layer = RMSNorm(n, dtype=dtype)
        layer.weight.data = (1.0 + 0.2 * torch.randn(n, generator=gen)).to(dtype)
        return layer

    with use_config(Config(custom_ops=["all"])):
        rotary = DeepseekScalingRotaryEmbedding(rope, rope, 4096, 10000.0, False, 4.0, torch.float32, mscale=1.0,
                                                mscale_all_dim=1.0)
        common = {"kv_a_layernorm": norm(rank), "kv_b_proj": linear(rank, heads * (nope + v)), "rotary_emb": rotary,
                  "o_proj": linear(heads * v, hidden)}
        if q_lora:
            modules = MLAModules(**common, fused_qkv_a_proj=linear(hidden, q_lora + rank + rope),
                                 kv_a_proj_with_mqa=None, q_a_layernorm=norm(q_lora),
                                 q_b_proj=linear(q_lora, heads * (nope + rope)), q_proj=None)
        else:
            modules = MLAModules(**common, fused_qkv_a_proj=None, kv_a_proj_with_mqa=linear(hidden, rank + rope),
                                 q_a_layernorm=None, q_b_proj=None, q_proj=linear(hidden, heads * (nope + rope)))
        scale = (nope + rope) ** -0.5 * (0.1 * math.log(4.0) + 1.0) ** 2
        op = MultiHeadLatentAttentionWrapper(hidden, heads, scale, nope, rope, v, q_lora, rank, modules)
    return op.requires_grad_(False)


def mla_batch(case: str, op: MultiHeadLatentAttentionWrapper, block_size: int, dtype: torch.dtype,
              gen: torch.Generator):
    """``(positions, hidden_states, kv_cache, metadata)`` of a case ``decode:BxC`` (B requests at a
    context of C, one new token each, C - 1 cached rows of random latents) or ``prefill:BxC`` (B
    fresh prompts of C tokens). Blocks are handed out in a shuffled order, as a serving cache's are."""
    kind, shape = case.split(":")
    requests, context = (int(n) for n in shape.split("x"))
    new = 1 if kind == "decode" else context
    per_request = -(-context // block_size)
    order = torch.randperm(requests * per_request, generator=gen)
    table = order.view(requests, per_request).to(torch.int32)
    width = op.kv_lora_rank + op.qk_rope_head_dim
    cache = torch.randn(requests * per_request, block_size, width, generator=gen).to(dtype)
    pos = torch.arange(context - new, context).repeat(requests)
    req = torch.arange(requests).repeat_interleave(new)
    slots = table[req, pos // block_size].long() * block_size + pos % block_size
    meta = MLAMetadata(slots, table, torch.full((requests,), context), torch.arange(requests + 1) * new,
                       requests if kind == "decode" else 0)
    hidden = torch.randn(requests * new, op.hidden_size, generator=gen).to(dtype)
    return pos, hidden, cache, meta


def add_mla_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--cases", default=",".join(MLA_CASES), help="decode:BxC or prefill:BxC, comma-separated")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dims", default="128,64,128,512", help="qk_nope, qk_rope, v_head, kv_lora_rank")
    parser.add_argument("--q-lora", type=int, default=0, help="q_lora_rank (0: a plain q projection, as V2-Lite)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile(forward_native) column")


def run_mla(args: argparse.Namespace) -> None:
    """DeepSeek MLA (``MultiHeadLatentAttentionWrapper``, DeepSeek-V2-Lite's attention shapes by
    default) on a decode or prefill batch: the layer's whole forward, projections included, with
    the batch's cache rows written on every call (the same rows each time). Paths: the spec
    (``forward_native``: one absorbed decode or up-projected prefill per request);
    ``torch.compile(forward_native)`` (static shapes; the attention is the opaque
    ``customop::mla_attention`` running the spec's walk, so only the projections, norms and rotary
    around it compile); ``forward_kernel`` (the accelerators' route: decode rows through
    ``customop::mla_decode``, fresh prefills packed through ``customop::varlen_attn``, here their
    CPU bodies); ``forward_cpu`` (that route with ``backends/cpu/mla.py``'s decode). Every path is
    first checked against a float64 run of the spec on the same inputs (normwise relative error,
    printed; fp32 within 1e-5, 16-bit within four unit roundoffs)."""
    clock = start_run(args)
    print(f"{args.heads} heads, qk_nope/qk_rope/v/kv_lora {args.dims}, q_lora {args.q_lora or 'none'}, hidden "
          f"{args.hidden}, block size {args.block_size}")
    print()
    names = ["forward_native", *([] if args.no_compile else ["compile"]), "forward_kernel", "forward_cpu"]
    ratio_heads = "forward_cpu x native | " + ("" if args.no_compile else "forward_cpu x compile | ")
    print("| dtype | case | " + " | ".join(f"{n} (ms)" for n in names) + f" | {ratio_heads}error vs float64 ("
          + ", ".join(names) + ") |")
    print("|---|---|" + "---:|" * (len(names) + 2 + (not args.no_compile)))
    with torch.no_grad():
        for dtype_name in args.dtypes.split(","):
            dtype = DTYPES[dtype_name]
            gen = torch.Generator().manual_seed(0)
            op = build_mla(args, dtype, gen)
            reference = copy.deepcopy(op).to(torch.float64)
            for case in args.cases.split(","):
                pos, hidden, cache, meta = mla_batch(case, op, args.block_size, dtype, gen)
                want = reference.forward_native(pos, hidden.double(), cache.double(), meta)
                compiled = fresh_compile(op.forward_native)
                fns = {"forward_native": op.forward_native, "compile": compiled, "forward_kernel": op.forward_kernel,
                       "forward_cpu": op.forward_cpu}
                paths = {n: lambda fn=fns[n]: fn(pos, hidden, cache, meta) for n in names}
                times, errors = checked_times(paths, want, TOLERANCE[dtype], f"{case} {dtype_name}",
                                              args.min_time, clock)
                cells = ms_cells(times, names)
                ratios = [times["forward_native"][1] / times["forward_cpu"][1]]
                if not args.no_compile:
                    ratios.append(times["compile"][1] / times["forward_cpu"][1])
                print(f"| {dtype_name} | {case} | {cells} | " + " | ".join(f"{r:.2f}" for r in ratios)
                      + f" | {', '.join(errors)} |", flush=True)


# ---- the command line ------------------------------------------------------------------------------

FAMILIES = {"encoder": ("mm_encoder_attn: segment loop vs masked packed SDPA vs forward_cpu vs compile",
                         add_encoder_args, run_encoder),
            "rel_pos": ("rel_pos_attention: spec vs forward_cpu vs compile, blocked forms", add_rel_pos_args,
                        run_rel_pos),
            "mla": ("multi_head_latent_attention: spec vs compile vs forward_kernel vs forward_cpu", add_mla_args,
                    run_mla)}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in FAMILIES and argv[0] not in ("-h", "--help"):
        argv = ["encoder", *argv]  # the script's form before it had sub-commands
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="family", required=True)
    for name, (summary, add_args, run) in FAMILIES.items():
        sub = commands.add_parser(name, help=summary, description=run.__doc__)
        add_args(sub)
        add_timing_args(sub)
        sub.set_defaults(run=run)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
