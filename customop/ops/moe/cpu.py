"""The experts on the CPU: which formulation runs, by the measurement in
benchmarks/results/cpu_moe.md (``python -m benchmarks.cpu.moe``).

Candidates, all the spec's math (``customop/math/moe.py``):

- ``spec``: the loop over experts with fp32 GEMMs (every call converts each used expert's
  weights to fp32: a full extra pass over them);
- ``per_expert``: the same loop with the GEMMs in the weights' own dtype (oneDNN's bf16/fp16
  GEMMs accumulate in fp32 and round once, which is the spec's rounding of the gate/up result;
  the down projection is rounded to the input dtype before the router weight multiplies it);
- ``grouped``: ``torch._grouped_mm`` over the slots sorted by expert (no data-dependent
  shapes: what runs inside a caller's ``torch.compile``);
- ``compiled``: Inductor's compilation of ``grouped`` (bf16 only: Dynamo's ``_grouped_mm``
  rejects other dtypes), one graph with dynamic shapes for every token count.

torch 2.8 (the torch that IPEX 2.8 needs) has no CPU kernel for ``_grouped_mm``: there the
grouped forms give way to ``per_expert``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from customop.backends.cpu.tiering import for_this_cpu, has_neg_bit
from customop.math import moe as _math

#: the formulation forward_cpu runs, per input dtype. Measured (benchmarks/results/cpu_moe.md, one
#: thread, E8 and E128 layers, 1-256 tokens): the spec is 2.5-4x slower than the rest in bf16/fp16
#: (it converts the used experts' weights to fp32 on every call); in bf16 the compiled grouped
#: form was best in 7 of 10 rows from 128 slots (T x top_k; 4-25%), within 5% in 2, and tied
#: with the eager grouped form below; Dynamo's _grouped_mm takes bf16 only, so fp16 and fp32
#: run the grouped form eagerly (best or within 10% of the best in every row).
CHOICE: dict[torch.dtype, str] = {torch.bfloat16: "compiled", torch.float16: "grouped", torch.float32: "grouped"}
#: "compiled" runs from this many (token, k) slots; below, the eager grouped form: the same speed
#: there, without a compile per layer variant (seconds each) for decode-only or check-sized calls
COMPILE_FROM_SLOTS = 128
#: dtype -> from how many (token, k) slots an expert the spec runs instead, on this CPU. On CPUs
#: whose ATen capability is AVX2 (no AVX-512: oneDNN's bf16 GEMMs get no hardware help; the AMD
#: EPYC CI machines) the bf16 grouped forms ran at 17-20 GFLOP/s, and from 16 slots an expert the
#: spec (the used experts' weights converted to fp32, fp32 GEMMs) was faster: E8 k2 H1024 I3584 at
#: 64 / 128 / 256 tokens 1.3x / 2.1x / 3.5x, E128 k8 H2048 I768 at 256 tokens 1.8x; at 8 slots an
#: expert the compiled grouped form still won (1.48x, 1.43x); 2 threads (BENCHMARKS.md, "issue 18,
#: CPU, twelfth day (3)"). Between them ("issue 18, CPU, thirteenth day"): at 10 slots an expert the spec won for
#: E128 k8 (541 against 688 ms grouped, 160 tokens) and lost for E8 k2 (130 against 103-105 ms, 40
#: tokens), at 12 and 14 it won for E8 k2 (115 / 137 against 119-129 / 145-151 ms): from 10 the
#: spec runs, at the compiled spec's speed (same math) where grouped would have been faster, and
#: never behind it. fp16 (same day): the grouped form won at 8-10 slots (1.10x, 1.43x), tied at
#: 12-16 and lost from there (E8 k2, 256 tokens: 460 against 211 ms; E128 k8 at 16 slots 880
#: against 819), so fp16 takes the spec from 16. Empty elsewhere (the Xeon's AMX and AVX512_BF16
#: GEMMs: the table above).
SPEC_FROM_SLOTS_PER_EXPERT: dict[torch.dtype, int] = for_this_cpu(
    {}, AVX2={torch.bfloat16: 10, torch.float16: 16})
#: whether this torch runs ``torch._grouped_mm`` on CPU tensors (2.8: no kernel; 2.13: a composite
#: one). A dispatcher table lookup, not a call: cheap at import and constant inside torch.compile.
GROUPED_MM_ON_CPU = torch._C._dispatch_has_computed_kernel_for_dispatch_key("aten::_grouped_mm", "CPU")


def per_expert(x, w13, w2, topk_weights, topk_ids, expert_map=None, w13_bias=None, w2_bias=None,
               activation="silu", alpha=1.0, limit=float("inf"), beta=0.0, apply_router_weight_on_input=False):
    """The spec's loop with the GEMMs in the weights' dtype (see the module docstring)."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    ids = _math.local_ids(topk_ids, expert_map)
    flat = ids.flatten()
    # one sort instead of one scan of the ids per expert: the slots of expert e are a run
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat[flat >= 0], minlength=w13.shape[0]).tolist()
    start = int((flat < 0).sum())
    k = topk_ids.shape[1]
    weights = topk_weights.float().flatten()
    for e, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[start:start + n]
        start += n
        token, weight = slots // k, weights[slots]
        xe = x[token]
        if apply_router_weight_on_input:
            xe = xe * weight.to(x.dtype)[:, None]
        h = F.linear(xe, w13[e], None if w13_bias is None else w13_bias[e])
        a = _math.act_and_mul(h.float(), activation, alpha, limit, beta).to(x.dtype)
        y = F.linear(a, w2[e]).float()
        if w2_bias is not None:
            y = y + w2_bias[e].float()
        if not apply_router_weight_on_input:
            y = y * weight[:, None]
        out.index_add_(0, token, y)
    return out.to(x.dtype)


_compiled = None


def compiled(*args):
    global _compiled
    if has_neg_bit(args):  # torch.compile would read it without the negation
        return _math.fused_experts_grouped(*args)
    if _compiled is None:
        _compiled = torch.compile(_math.fused_experts_grouped, dynamic=True)
    return _compiled(*args)


FORMULATIONS = {"spec": _math.fused_experts, "per_expert": per_expert, "grouped": _math.fused_experts_grouped,
                "compiled": compiled}


def grouped_applies(x: torch.Tensor, w2: torch.Tensor) -> bool:
    return _grouped_fits(x.shape[1], w2.shape[2], x.dtype)


def _grouped_fits(hidden: int, inter: int, dtype: torch.dtype) -> bool:
    """``torch._grouped_mm`` runs on CPU tensors here and takes these rows: 16-byte multiples (H
    and I; fp16 checks it on CPU)."""
    size = dtype.itemsize
    return GROUPED_MM_ON_CPU and (hidden * size) % 16 == 0 and (inter * size) % 16 == 0


def fused_experts(x, w13, w2, *args):
    """``forward_cpu``'s experts: the measured choice for x's dtype (the loop where the grouped
    forms do not apply). Inside a caller's ``torch.compile``: the grouped form in bf16 (static
    shapes: the caller's Inductor takes it), else the library op, one opaque node whose CPU body
    is the spec."""
    grouped = grouped_applies(x, w2)
    if torch.compiler.is_compiling():
        if grouped and x.dtype == torch.bfloat16:
            return _math.fused_experts_grouped(x, w13, w2, *args)
        return torch.ops.customop.fused_experts(x, w13, w2, *args)
    return FORMULATIONS[choice(x, w2, args[1].shape[1])](x, w13, w2, *args)


def choice(x: torch.Tensor, w2: torch.Tensor, top_k: int) -> str:
    """The formulation ``fused_experts`` runs for these inputs (outside ``torch.compile``)."""
    return route(x.shape[0], x.shape[1], w2.shape[2], top_k, x.dtype, w2.shape[0])


def route(tokens: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype, experts: int) -> str:
    """``choice`` from the shape alone (``customop info`` reports it without building tensors):
    ``inter`` is the intermediate size per rank, ``experts`` the experts of this rank."""
    spec_from = SPEC_FROM_SLOTS_PER_EXPERT.get(dtype)
    if spec_from is not None and tokens * top_k >= spec_from * experts:
        return "spec"
    name = CHOICE.get(dtype, "spec")
    if name in ("grouped", "compiled") and not _grouped_fits(hidden, inter, dtype):
        return "per_expert"
    if name == "compiled" and tokens * top_k < COMPILE_FROM_SLOTS:
        return "grouped"
    return name
