"""Benchmark specs of the rotary embedding: tokens {1, 16, 256, 4096, 32768} x (32 query + 8 key
heads of 128), full rotary, a cos/sin cache of 8192 positions in the input dtype, random
positions; neox and gptj. The op rotates query and key in place.

Bytes: query and key read and written once, the positions, and one cache row per token (cos and
sin). Peers: ``torch.compile`` of the native spec (out of place: the same bytes) and, for neox,
Liger's rope, which takes cos/sin already gathered per token as ``[1, T, 128]`` (each half
repeated, the HF layout); the gather is done outside its timing, as HF models do it once per
forward for all layers.
"""

from __future__ import annotations

from typing import Any

import torch

from customop.benchmarks.specs import OpSpec, Shape, compiled, liger_module, token_shapes
from customop.math import rotary as native

Q_HEADS, K_HEADS, HEAD_SIZE, MAX_POS = 32, 8, 128, 8192
SHAPES = token_shapes(hidden=(Q_HEADS * HEAD_SIZE,), label_fn=lambda t, h: f"{t}x({Q_HEADS}+{K_HEADS})x{HEAD_SIZE}")


def _inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    t = shape.tokens
    inv_freq = native.rope_inv_freq(10000.0, HEAD_SIZE).to(device)
    cache = native.cos_sin_cache(torch.arange(MAX_POS, device=device), inv_freq).to(dtype)
    positions = torch.randint(0, MAX_POS, (t,), device=device)
    half = HEAD_SIZE // 2
    rows = cache[positions]
    return {"positions": positions, "cache": cache,
            "query": torch.randn(t, Q_HEADS * HEAD_SIZE, device=device).to(dtype),
            "key": torch.randn(t, K_HEADS * HEAD_SIZE, device=device).to(dtype),
            # Liger's inputs: gathered rows, each half repeated ([1, T, head_size])
            "cos": rows[:, :half].repeat(1, 2).unsqueeze(0).contiguous(),
            "sin": rows[:, half:].repeat(1, 2).unsqueeze(0).contiguous()}


def _bytes(shape: Shape, dtype: torch.dtype) -> int:
    t = shape.tokens
    qk = 2 * t * (Q_HEADS + K_HEADS) * HEAD_SIZE * dtype.itemsize
    return qk + t * 8 + t * HEAD_SIZE * dtype.itemsize


def _impls(is_neox: bool) -> dict:
    def customop(i):
        positions, q, k, cache = i["positions"], i["query"], i["key"], i["cache"]

        def run():
            torch.ops.customop.rotary_embedding(positions, q, k, HEAD_SIZE, cache, is_neox)
            return q, k

        return run

    def eager(i):
        a = (i["positions"], i["query"], i["key"], HEAD_SIZE, i["cache"], is_neox)
        return lambda: native.rotary_embedding(*a)

    def compile_(i):
        f = compiled(native.rotary_embedding)
        a = (i["positions"], i["query"], i["key"], HEAD_SIZE, i["cache"], is_neox)
        return lambda: f(*a)

    table = {"customop": customop, "eager": eager, "compile": compile_}
    if is_neox:
        table["liger"] = _liger_rope
    return table


def _liger_rope(i):
    rope = liger_module("rope")
    if rope is None:
        return None
    t = i["query"].shape[0]
    # Liger wants [batch, heads, seq, head_dim] views of [batch, seq, heads, head_dim] storage and
    # rotates that storage in place.
    q4 = i["query"].view(1, t, Q_HEADS, HEAD_SIZE).transpose(1, 2)
    k4 = i["key"].view(1, t, K_HEADS, HEAD_SIZE).transpose(1, 2)
    q, k, cos, sin = i["query"], i["key"], i["cos"], i["sin"]

    def run():
        rope.rope_forward(q4, k4, cos, sin)
        return q, k

    return run


SPECS = [
    OpSpec(name=f"rotary_embedding[{style}]", family="rotary", shapes=SHAPES, make_inputs=_inputs,
           bytes_moved=_bytes, impls=_impls(style == "neox"), mutates=("query", "key"))
    for style in ("neox", "gptj")
]
