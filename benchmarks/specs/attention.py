"""Benchmark specs of encoder attention (``mm_encoder_attn``): ViT shapes, 16 heads of 80 (Qwen2-VL)
and of 64, bf16: 16384 tokens in 4, 16 and 64 equal segments, and 1024 and 4096 tokens in one
segment and in four (issue 13).

Implementations (the runner times only those named in ``--impls``):
- ``customop``: ``torch.ops.customop.mm_encoder_attn`` (the launcher: torch's varlen flash
  attention for 16-bit inputs on sm80+, the Triton kernel otherwise);
- ``eager``: the spec, one SDPA per segment (segment lengths already on the host, as vLLM's loop
  has them after its ``tolist``);
- ``varlen_attn``: ``torch.nn.attention.varlen.varlen_attn`` called directly (what customop
  routes 16-bit inputs to: the launcher's overhead is the difference);
- ``sdpa_padded``: the segments padded to the longest into ``[N, Lmax, H, D]`` with a key-padding
  mask (SDPA's efficient backend), gather and scatter included;
- ``sdpa_runs``: equal consecutive segments as one batched SDPA call each (no mask: the flash
  backend; the CPU path's method, here with host-side lengths);
- ``triton``: the Triton kernel, forced.

    customop bench --ops mm_encoder_attn --impls customop,eager,varlen_attn,sdpa_padded,sdpa_runs,triton --out DIR
    python -m customop.benchmarks.specs.attention DIR/results.json     # TFLOP/s per implementation

Attention is bound by FLOPs, not bytes: ``bytes_moved`` is the true traffic (q, k, v read, the
output written), so the runner's GB/s columns say little; ``flops`` (``4 * sum(L_i^2) * H * D``)
and the ``__main__`` above turn its microseconds into TFLOP/s (H200 dense bf16: ~790).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.nn.functional as F

from customop.benchmarks.specs import OpSpec, Shape
from customop.math import attention as native

HEADS = 16


def _shape(tokens: int, segments: int, head_size: int, quick: bool = False) -> Shape:
    return Shape(tokens, HEADS * head_size, f"{tokens}t/{segments}s {HEADS}x{head_size}",
                 {"segments": segments, "head_size": head_size}, quick=quick)


SHAPES = tuple(
    _shape(t, s, d, quick=(t == 16384 and s == 16 and d == 80))
    for d in (80, 64)
    for t, s in ((16384, 4), (16384, 16), (16384, 64), (1024, 1), (1024, 4), (4096, 1), (4096, 4))
)


def lengths_of(shape: Shape) -> list[int]:
    """Equal segments (the first ones one token longer when the tokens do not divide: dry runs)."""
    n = min(shape.extra["segments"], shape.tokens)
    base, extra = divmod(shape.tokens, n)
    return [base + (i < extra) for i in range(n)]


def flops(shape: Shape) -> float:
    return 4.0 * sum(n * n for n in lengths_of(shape)) * HEADS * shape.extra["head_size"]


def _inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    d, lengths = shape.extra["head_size"], lengths_of(shape)
    t = shape.tokens
    q, k, v = (torch.randn(t, HEADS, d, device=device).to(dtype) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    # the padded layout: token i of segment s sits at row s, column i
    longest, count = max(lengths), len(lengths)
    segment = torch.repeat_interleave(torch.arange(count), torch.tensor(lengths))
    column = torch.arange(t) - (cu.cpu()[:-1].long())[segment]
    slot = (segment * longest + column).to(device)
    valid = torch.zeros(count * longest, dtype=torch.bool, device=device)
    valid[slot] = True
    return {"q": q, "k": k, "v": v, "cu": cu, "lengths": lengths, "max_seqlen": longest,
            "scale": d ** -0.5, "slot": slot, "mask": valid.view(count, 1, 1, longest)}


def _bytes(shape: Shape, dtype: torch.dtype) -> int:
    return 4 * shape.tokens * HEADS * shape.extra["head_size"] * dtype.itemsize


def _customop(i):
    return lambda: torch.ops.customop.mm_encoder_attn(i["q"], i["k"], i["v"], i["cu"], i["max_seqlen"], i["scale"])


def _eager(i):
    q, k, v, lengths, scale = i["q"][None], i["k"][None], i["v"][None], i["lengths"], i["scale"]
    return lambda: native.encoder_attention(q, k, v, lengths, scale)[0]


def _varlen_attn(i):
    if i["q"].device.type != "cuda" or i["q"].dtype == torch.float32:
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    q, k, v, cu, m = i["q"], i["k"], i["v"], i["cu"], i["max_seqlen"]
    return lambda: varlen_attn(q, k, v, cu, cu, m, m, scale=i["scale"])


def _sdpa_padded(i):
    q, k, v, slot, mask, scale = i["q"], i["k"], i["v"], i["slot"], i["mask"], i["scale"]
    count, longest = mask.shape[0], mask.shape[-1]

    def run():
        padded = []
        for x in (q, k, v):
            buf = x.new_zeros(count * longest, *x.shape[1:])
            buf[slot] = x
            padded.append(buf.view(count, longest, *x.shape[1:]).transpose(1, 2))
        out = F.scaled_dot_product_attention(*padded, attn_mask=mask, scale=scale)
        return out.transpose(1, 2).reshape(count * longest, *q.shape[1:])[slot]

    return run


def _sdpa_runs(i):
    from customop.backends.cpu.attention import encoder_attention_by_runs

    q, k, v, lengths, scale = i["q"][None], i["k"][None], i["v"][None], i["lengths"], i["scale"]
    return lambda: encoder_attention_by_runs(q, k, v, lengths, scale)[0]


def _triton(i):
    from customop.backends.triton.attention import triton_varlen_attention

    return lambda: triton_varlen_attention(i["q"], i["k"], i["v"], i["cu"], i["max_seqlen"], i["scale"])


SPECS = [
    OpSpec(name="mm_encoder_attn", family="attention", shapes=SHAPES, make_inputs=_inputs, bytes_moved=_bytes,
           impls={"customop": _customop, "eager": _eager, "varlen_attn": _varlen_attn, "sdpa_padded": _sdpa_padded,
                  "sdpa_runs": _sdpa_runs, "triton": _triton}),
]


def tflops_table(rows: list[dict]) -> str:
    """TFLOP/s per implementation for the mm_encoder_attn rows of a runner's results.json."""
    by_label = {s.label: s for s in SHAPES}
    names = sorted({n for r in rows for n in r["impls"]})
    lines = ["| shape | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for r in rows:
        shape = by_label.get(r["shape"].removesuffix("[dry]"))
        if r["op"] != "mm_encoder_attn" or shape is None:
            continue
        cells = [f"{flops(shape) / (r['impls'][n]['us'] * 1e6):.0f}" if "us" in r["impls"].get(n, {}) else "-"
                 for n in names]
        lines.append(f"| {r['shape']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        data = json.load(f)
    print(tflops_table(data["results"] if isinstance(data, dict) else data))
