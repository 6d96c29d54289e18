"""Benchmark specs of the state-space family (issue 14's plan: bf16 activations, fp32 state):

- ``selective_state_update``: Mamba-2's decode step at batch 1 / 16 / 64 / 256, on Mamba-2-2.7B's
  SSM (80 heads x 64, state 128, 1 group) and a Nemotron-H-like one (128 heads x 64, 8 groups).
  The floor is the state read and written once per request (``bytes_moved``).
  ``python -m customop.benchmarks.specs.mamba --sweep-decode`` (GPU) times the decode kernel's
  candidate launch configs (``mamba_scan.decode_candidates``) and prints a table.
- ``ssd_chunk_scan``: Mamba-2 prefill of 1k / 4k / 16k tokens in 1 and 8 requests (chunk 256),
  fresh states; timed against the chunked form in plain torch (the minimal SSD of equal-length
  requests, eager and compiled) and ``compile_chunks``: the same chunked math one chunk at a time,
  ``torch.compile`` of one chunk's step (a small graph, compiled once per model and request count)
  looped over the chunks in Python. Both write their running sums as triangular products
  (``running_sum``: Inductor of torch 2.11 fails on ``torch.cumsum`` there).
  ``--sweep-prefill`` (GPU) times the scan's candidate launch configs
  (``mamba_ssd.ssd_candidates``) and, for the default, each of its kernels.
  ``--tflops RESULTS_JSON`` prints each implementation's rate over the scan's matmul FLOPs
  (``ssd_flops``), to set against the dense bf16 matmul rate.
- ``causal_conv1d_fn`` / ``causal_conv1d_update``: the conv over Mamba-2-2.7B's ``xBC``
  (5376 channels, K = 4) in prefill and decode.
- ``mixer2_gated_rms_norm``: tokens x 5120 (1 group) and x 8192 (8 groups).

The eager and compiled baselines are the same math written without the batch's host-side layout
(equal-length requests, every slot real), so that ``torch.compile(fullgraph=True)`` and CUDA
graphs take them; the runner checks the kernel's outputs against them first.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F

from customop.benchmarks.specs import OpSpec, Shape, compiled
from customop.math import mamba as spec

#: (label, heads, head_dim, state, groups)
MODELS = (("mamba2-2.7b", 80, 64, 128, 1), ("nemotron-h", 128, 64, 128, 8))
CHUNK = 256


def _shape(tokens: int, model, requests: int = 1, quick: bool = False) -> Shape:
    label, H, P, N, G = model
    return Shape(tokens, H * P, f"{label} {tokens}" + (f"/{requests}" if requests > 1 else ""),
                 {"heads": H, "head_dim": P, "state": N, "groups": G, "requests": requests}, quick)


def _ints(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


# ---- decode: the SSM state update ----------------------------------------------------------------


def _decode_inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    e, B = shape.extra, shape.tokens
    H, P, N, G = e["heads"], e["head_dim"], e["state"], e["groups"]

    def r(*s):
        return torch.randn(*s, device=device).to(dtype)

    return {"state": torch.randn(B + 1, H, P, N, device=device), "x": r(B, H, P), "dt": r(B, H),
            "A": -(0.5 + torch.rand(H, device=device)), "B": r(B, G, N), "C": r(B, G, N), "D": r(H),
            "dt_bias": r(H), "slots": torch.arange(1, B + 1, dtype=torch.int32, device=device)}


def decode_update(state, x, dt, A, B, C, D, dt_bias, slots):
    """The decode step on gathered states, written back by index (every slot real): fp32 math."""
    H = A.shape[0]
    h = state[slots.long()]
    delta = F.softplus(dt.float() + dt_bias.float())[..., None, None]  # (B, H, 1, 1)
    Bh = B.float().repeat_interleave(H // B.shape[1], dim=1)[:, :, None, :]
    Ch = C.float().repeat_interleave(H // C.shape[1], dim=1)[:, :, None, :]
    h = torch.exp(delta * A[:, None, None]) * h + delta * x.float()[..., None] * Bh
    state.index_copy_(0, slots.long(), h)
    return ((h * Ch).sum(-1) + D.float()[:, None] * x.float()).to(x.dtype)


def _decode_args(i):
    dt4, A4, D4, b4 = spec.ssd_head_form(i["dt"], i["A"], i["D"], i["dt_bias"], i["x"].shape[2], i["B"].shape[2])
    return i["state"], i["x"], dt4, A4, i["B"], i["C"], D4, None, b4, i["slots"], True, spec.NULL_BLOCK_ID


def _decode_bytes(shape: Shape, dtype: torch.dtype) -> int:
    e = shape.extra
    state = shape.tokens * e["heads"] * e["head_dim"] * e["state"] * 4
    return 2 * state + shape.tokens * (2 * shape.hidden + e["heads"] + 2 * e["groups"] * e["state"]) * dtype.itemsize


def _decode_impls():
    def customop(i):
        args = _decode_args(i)
        return lambda: torch.ops.customop.selective_state_update(*args)

    def eager(i):
        return lambda: decode_update(*(i[k] for k in ("state", "x", "dt", "A", "B", "C", "D", "dt_bias", "slots")))

    def compile_(i):
        f = compiled(decode_update)
        return lambda: f(*(i[k] for k in ("state", "x", "dt", "A", "B", "C", "D", "dt_bias", "slots")))

    return {"customop": customop, "eager": eager, "compile": compile_}


# ---- prefill: the chunked SSD scan ----------------------------------------------------------------


def _prefill_inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    i = _decode_inputs(Shape(shape.tokens, shape.hidden, extra=shape.extra), dtype, device)
    S = min(shape.extra["requests"], shape.tokens)
    if shape.tokens % S:
        raise ValueError(f"ssd_chunk_scan spec: {shape.tokens} tokens do not split into {S} equal requests")
    lens = [shape.tokens // S] * S
    i["state"] = torch.zeros(S + 1, *i["state"].shape[1:], device=device)
    i["qsl"] = _ints([0, *lens], device).cumsum(0, dtype=torch.int32)
    i["slots"], i["init"] = i["slots"][:S], torch.zeros(S, dtype=torch.bool, device=device)
    return i


def running_sum(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch.cumsum(t, dim)`` as a product with a lower-triangular matrix of ones (fp32; the
    same sums, in another order). Inductor of torch 2.11 fails to generate code for the cumsums of
    the chunked form (its split scan: ``TypeError: list indices must be integers or slices, not
    NoneType``, H200 2026-12-02); the product compiles and costs the baselines little (a chunk's
    running sum is an ``(L, L) @ (L, H)`` product)."""
    n = t.shape[dim]
    ones = torch.ones(n, n, dtype=t.dtype, device=t.device).tril()
    return torch.movedim(torch.matmul(ones, torch.movedim(t, dim, -2).contiguous()), -2, dim) if t.dim() > 1 \
        else ones @ t


def ssd_minimal(x, dt, A, B, C, D, dt_bias, requests: int, chunk: int = CHUNK):
    """The chunked SSD form of ``requests`` equal-length requests from zero states, in fp32 and
    plain torch (each request padded to whole chunks with dt = 0): y in x's dtype."""
    T, H, P = x.shape
    n = T // requests
    L = -(-n // chunk) * chunk

    def split(t):
        t = t.float().view(requests, n, *t.shape[1:])
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, L - n))
        return t.view(requests, L // chunk, chunk, *t.shape[2:])

    delta = F.softplus(dt.float() + dt_bias.float())
    valid = split(torch.ones(T, 1, device=x.device))[..., 0, None]
    xc, dtc = split(x), split(delta) * valid
    Bc = split(B).repeat_interleave(H // B.shape[1], dim=3)
    Cc = split(C).repeat_interleave(H // C.shape[1], dim=3)
    a = running_sum(dtc * A, dim=2)  # (r, c, l, H)
    states = torch.einsum("rclhn,rclh,rclhp->rchpn", Bc, torch.exp(a[:, :, -1:] - a) * dtc, xc)
    total = a[:, :, -1]  # (r, c, H)
    seg = running_sum(F.pad(total, (0, 0, 1, 0))[:, :-1], dim=1)  # decay from each chunk's start
    decay = torch.exp((seg[:, :, None] - seg[:, None, :] - total[:, None, :]).masked_fill(
        ~torch.ones(L // chunk, L // chunk, dtype=torch.bool, device=x.device).tril(-1)[None, :, :, None], -torch.inf))
    h_in = torch.einsum("rzch,rchpn->rzhpn", decay, states)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    scores = torch.einsum("rclhn,rcshn->rclsh", Cc, Bc) * torch.exp(
        (a[:, :, :, None] - a[:, :, None, :]).masked_fill(~causal[None, None, :, :, None], -torch.inf)) \
        * dtc[:, :, None, :, :]
    y = torch.einsum("rclsh,rcshp->rclhp", scores, xc) + torch.einsum("rclhn,rchpn->rclhp", Cc, h_in) \
        * torch.exp(a)[..., None] + D.float()[:, None] * xc
    return y.reshape(requests, L, H, P)[:, :n].reshape(T, H, P).to(x.dtype)


def _ssd_chunk_step(xc, dtc, Bc, Cc, A, h):
    """One chunk of every request (``xc (r, l, H, P)``, ``dtc (r, l, H)`` softplus'd and zero on
    padding, ``Bc, Cc (r, l, H, N)`` per head) from states ``h (r, H, P, N)``: the chunked SSD
    form's intra-chunk terms plus the chunk's state, fp32. Returns (y (r, l, H, P), next h)."""
    a = running_sum(dtc * A, dim=1)  # (r, l, H)
    l = a.shape[1]
    causal = torch.ones(l, l, dtype=torch.bool, device=xc.device).tril()
    seg = torch.where(causal[None, :, :, None], a[:, :, None, :] - a[:, None, :, :], -torch.inf)
    scores = torch.einsum("rlhn,rshn->rlsh", Cc, Bc) * torch.exp(seg) * dtc[:, None, :, :]
    y = torch.einsum("rlsh,rshp->rlhp", scores, xc) + torch.einsum("rlhn,rhpn->rlhp", Cc, h) * torch.exp(a)[..., None]
    last = a[:, -1:]  # (r, 1, H)
    h = h * torch.exp(last[:, 0])[..., None, None] + torch.einsum(
        "rlhn,rlh,rlhp->rhpn", Bc, torch.exp(last - a) * dtc, xc)
    return y, h


def ssd_chunk_loop(x, dt, A, B, C, D, dt_bias, requests: int, chunk: int = CHUNK, step=_ssd_chunk_step):
    """``ssd_minimal``'s math chunk by chunk: ``step`` (one chunk of every request, compiled by
    the ``compile_chunks`` baseline) in a Python loop carrying the states, so the compiled graph
    is one chunk's, whatever the length. y in x's dtype."""
    T, H, P = x.shape
    n = T // requests
    L = -(-n // chunk) * chunk

    def split(t):
        t = t.float().view(requests, n, *t.shape[1:])
        return F.pad(t, (0, 0) * (t.dim() - 2) + (0, L - n))

    delta = F.softplus(dt.float() + dt_bias.float())
    xs, dts = split(x), split(delta) * split(torch.ones(T, 1, device=x.device))
    Bs = split(B).repeat_interleave(H // B.shape[1], dim=2)
    Cs = split(C).repeat_interleave(H // C.shape[1], dim=2)
    h = torch.zeros(requests, H, P, B.shape[2], device=x.device)
    ys = []
    for c in range(0, L, chunk):
        y, h = step(xs[:, c:c + chunk], dts[:, c:c + chunk], Bs[:, c:c + chunk], Cs[:, c:c + chunk], A.float(), h)
        ys.append(y)
    y = torch.cat(ys, dim=1) + D.float()[:, None] * xs
    return y[:, :n].reshape(T, H, P).to(x.dtype)


def ssd_flops(shape: Shape, chunk: int = CHUNK) -> float:
    """The chunked scan's matmul FLOPs (what the tensor cores do), per token: ``C B^T`` per group
    and chunk (``2 Q N G``), the intra-chunk ``(L * C B^T) X`` per head (``2 Q P H``), and the
    chunk states ``B^T X`` plus their readout ``C h`` per head (``4 N P H``). Elementwise work
    (the decay cumsums, ``exp``, the state passing) is not counted."""
    H, P, N, G = (shape.extra[k] for k in ("heads", "head_dim", "state", "groups"))
    return float(shape.tokens * (2 * chunk * N * G + 2 * chunk * P * H + 4 * N * P * H))


def tflops_table(rows: list[dict]) -> str:
    """TFLOP/s (``ssd_flops``) per implementation for the ``ssd_chunk_scan`` rows of a runner's
    results.json."""
    by_label = {s.label: s for spec_ in SPECS if spec_.name == "ssd_chunk_scan" for s in spec_.shapes}
    rows = [r for r in rows if r["op"] == "ssd_chunk_scan" and r["shape"].removesuffix("[dry]") in by_label]
    names = sorted({n for r in rows for n in r["impls"]})
    lines = ["| shape | GFLOP | " + " | ".join(names) + " |", "|---" * (len(names) + 2) + "|"]
    for r in rows:
        f = ssd_flops(by_label[r["shape"].removesuffix("[dry]")])
        cells = [f"{f / (r['impls'][n]['us'] * 1e6):.1f}" if "us" in r["impls"].get(n, {}) else "-" for n in names]
        lines.append(f"| {r['shape']} | {f / 1e9:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _prefill_bytes(shape: Shape, dtype: torch.dtype) -> int:
    e = shape.extra
    per_token = 2 * shape.hidden + e["heads"] + 2 * e["groups"] * e["state"]
    return shape.tokens * per_token * dtype.itemsize + e["requests"] * shape.hidden * e["state"] * 4


def _prefill_impls():
    def customop(i):
        args = (i["x"], i["dt"], i["A"], i["B"], i["C"], i["D"], i["dt_bias"], i["state"], i["qsl"], i["slots"],
                i["init"], CHUNK, True, spec.NULL_BLOCK_ID)
        return lambda: torch.ops.customop.ssd_chunk_scan(*args)

    def baseline(fn):
        def factory(i):
            return lambda: fn(i["x"], i["dt"], i["A"], i["B"], i["C"], i["D"], i["dt_bias"], i["slots"].shape[0])

        return factory

    def compile_(i):
        return baseline(compiled(ssd_minimal))(i)

    def compile_chunks(i):  # one chunk's graph compiled (seconds), looped over the chunks in Python
        step = compiled(_ssd_chunk_step)
        return lambda: ssd_chunk_loop(i["x"], i["dt"], i["A"], i["B"], i["C"], i["D"], i["dt_bias"],
                                      i["slots"].shape[0], step=step)

    return {"customop": customop, "eager": baseline(ssd_minimal), "compile": compile_,
            "compile_chunks": compile_chunks}


# ---- the conv and the norm --------------------------------------------------------------------------

CONV_DIM, K = 5376, 4  # Mamba-2-2.7B's xBC: 5120 + 2 x 128


def _conv_inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    T, S = shape.tokens, min(shape.extra["requests"], shape.tokens)
    return {"x": torch.randn(T, CONV_DIM, device=device).to(dtype), "w": torch.randn(CONV_DIM, K, device=device)
            .to(dtype), "b": torch.randn(CONV_DIM, device=device).to(dtype),
            "state": torch.randn(T + 1, K - 1, CONV_DIM, device=device).to(dtype),
            "qsl": torch.arange(0, T + 1, T // S, dtype=torch.int32, device=device)[:S + 1].clamp(max=T),
            "slots": torch.arange(1, T + 1, dtype=torch.int32, device=device)}


def conv_prefill(x, w, b, requests: int):
    """Equal-length requests from zero states: F.conv1d on each, SiLU."""
    xs = x.view(requests, -1, x.shape[1]).transpose(1, 2).float()
    y = F.conv1d(F.pad(xs, (w.shape[1] - 1, 0)), w.float()[:, None, :], b.float(), groups=x.shape[1])
    return F.silu(y).transpose(1, 2).reshape(x.shape).to(x.dtype)


def conv_update(x, state, w, b, slots):
    window = torch.cat([state[slots.long()].transpose(1, 2).float(), x.float()[:, :, None]], dim=2)
    state.index_copy_(0, slots.long(), window[:, :, 1:].transpose(1, 2).to(state.dtype))
    return F.silu((window * w.float()).sum(-1) + b.float()).to(x.dtype)


def _conv_specs():
    def prefill_custom(i):
        S = i["qsl"].shape[0] - 1
        init = torch.zeros(S, dtype=torch.bool, device=i["x"].device)
        args = (i["x"], i["w"], i["b"], i["state"].transpose(1, 2), i["qsl"], i["slots"][:S], init, True, 0)
        return lambda: torch.ops.customop.causal_conv1d_fn(*args)

    def prefill_base(fn):
        return lambda i: (lambda: fn(i["x"], i["w"], i["b"], i["qsl"].shape[0] - 1))

    def update_custom(i):
        args = (i["x"], i["state"].transpose(1, 2), i["w"], i["b"], i["slots"], True, 0)
        return lambda: torch.ops.customop.causal_conv1d_update(*args)

    def update_base(fn):
        return lambda i: (lambda: fn(i["x"], i["state"], i["w"], i["b"], i["slots"]))

    prefill = tuple(Shape(t, CONV_DIM, f"{t}/{s}", {"requests": s}, quick=(t == 4096 and s == 1))
                    for t in (1024, 4096, 16384) for s in (1, 8))
    decode = tuple(Shape(b, CONV_DIM, f"decode {b}", {"requests": b}, quick=b in (1, 256)) for b in (1, 16, 64, 256))
    return [
        OpSpec("causal_conv1d_fn", "mamba", prefill, _conv_inputs,
               lambda s, d: 2 * s.tokens * CONV_DIM * d.itemsize,
               {"customop": prefill_custom, "eager": prefill_base(conv_prefill),
                "compile": lambda i: prefill_base(compiled(conv_prefill))(i)}, mutates=("state",)),
        OpSpec("causal_conv1d_update", "mamba", decode, _conv_inputs,
               lambda s, d: 4 * s.tokens * CONV_DIM * d.itemsize,
               {"customop": update_custom, "eager": update_base(conv_update),
                "compile": lambda i: update_base(compiled(conv_update))(i)}, mutates=("state",)),
    ]


def _norm_inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    return {"x": torch.randn(shape.tokens, shape.hidden, device=device).to(dtype),
            "gate": torch.randn(shape.tokens, shape.hidden, device=device).to(dtype),
            "w": (1 + 0.1 * torch.randn(shape.hidden, device=device)).to(dtype)}


def _norm_spec():
    def args(i, shape_groups):
        return i["x"], i["gate"], i["w"], 1e-5, i["x"].shape[1] // shape_groups

    def groups(i):
        return 8 if i["x"].shape[1] == 8192 else 1

    shapes = tuple(Shape(t, h, quick=(t in (1, 4096) and h == 8192)) for h in (5120, 8192)
                   for t in (1, 16, 256, 4096, 32768))
    return OpSpec("mixer2_gated_rms_norm", "mamba", shapes, _norm_inputs,
                  lambda s, d: 3 * s.tokens * s.hidden * d.itemsize,
                  {"customop": lambda i: (lambda a=args(i, groups(i)): torch.ops.customop.mixer2_gated_rms_norm(*a)),
                   "eager": lambda i: (lambda a=args(i, groups(i)): spec.mixer2_gated_rms_norm(*a)),
                   "compile": lambda i: (lambda f=compiled(spec.mixer2_gated_rms_norm), a=args(i, groups(i)): f(*a))})


# ---- the decode launch sweep ------------------------------------------------------------------------


def _checked_times(label: str, candidates, once, timed, tol: float):
    """Each candidate config's outputs (``once(cfg)``: a tuple of tensors) against the first
    candidate's (the default: the largest normwise relative error, "ok" below ``tol``) and its
    time (``timed(cfg)``, us). Yields (cfg, us, check); a config that fails to compile or launch
    is printed with ``label``, not fatal."""
    reference = None
    for cfg in candidates:
        try:
            got = once(cfg)
            reference = reference or got
            err = max(float((g - r).norm() / r.norm()) for g, r in zip(got, reference))
            check = "ok" if err < tol else f"WRONG {err:.1e}"
            us = timed(cfg)
        except Exception as e:  # reported, not fatal
            print(f"{label}  {cfg.label()} {type(e).__name__}: {str(e)[:80]}", flush=True)
            continue
        yield cfg, us, check


def sweep_decode(batches=(1, 16, 64, 256), dtype: torch.dtype = torch.bfloat16, device: str = "cuda") -> None:
    """Times every ``mamba_scan.decode_candidates()`` config of the decode kernel (the launcher
    itself under ``override_decode_config``, the runner's CUDA-graph timer) on both models at each
    batch, after checking its output and new state against the default config's on the same
    inputs. Prints one row per (model, batch, config): us, the state's GB/s (read + written), that
    as % of a same-size fp32 copy timed the same way and of a 1 GiB copy, the speedup over the
    default, the check; then the best config per row. About a minute on an H200."""
    from customop.backends.triton import mamba_scan
    from customop.benchmarks.runner_timing import time_graph

    dev = torch.device(device)
    src = torch.empty(1 << 28, device=dev)
    dst = torch.empty_like(src)
    big_copy_gbps = 2 * src.numel() * 4 / (time_graph([lambda: dst.copy_(src)]) * 1e-6) / 1e9
    del src, dst
    print(f"copy 1 GiB: {big_copy_gbps:.0f} GB/s", flush=True)
    print(f"{'model':12s} {'batch':>5s}  {'config':20s} {'us':>8s} {'GB/s':>6s} {'%copy':>6s} {'%1GiB':>6s} "
          f"{'vs dflt':>7s}  check", flush=True)
    best = []
    for model in MODELS:
        for b in batches:
            shape = _shape(b, model)
            i = _decode_inputs(shape, dtype, dev)
            args = _decode_args(i)
            numel = b * shape.extra["heads"] * shape.extra["head_dim"] * shape.extra["state"]
            nbytes = 2 * numel * 4
            csrc, cdst = torch.randn(numel, device=dev), torch.empty(numel, device=dev)
            copy_gbps = nbytes / (time_graph([lambda: cdst.copy_(csrc)]) * 1e-6) / 1e9
            del csrc, cdst
            state0 = args[0].clone()

            def once(cfg):
                state = state0.clone()
                with mamba_scan.override_decode_config(cfg):
                    out = mamba_scan.selective_state_update(state, *args[1:])
                return out.float(), state

            def timed(cfg):
                with mamba_scan.override_decode_config(cfg):
                    return time_graph([lambda: mamba_scan.selective_state_update(*args)])

            rows, base_us = [], None  # the first candidate is the default
            for cfg, us, check in _checked_times(f"{model[0]:12s} {b:5d}", mamba_scan.decode_candidates(), once, timed,
                                                 5e-3):
                base_us = base_us or us
                gbps = nbytes / (us * 1e-6) / 1e9
                print(f"{model[0]:12s} {b:5d}  {cfg.label():20s} {us:8.1f} {gbps:6.0f} {100 * gbps / copy_gbps:5.0f}% "
                      f"{100 * gbps / big_copy_gbps:5.0f}% {base_us / us:6.2f}x  {check}", flush=True)
                if check == "ok":
                    rows.append((us, cfg, gbps))
            if rows:
                us, cfg, gbps = min(rows, key=lambda r: r[0])
                best.append(f"{model[0]:12s} {b:5d}  best {cfg.label():20s} {us:8.1f} us  {100 * gbps / copy_gbps:5.0f}% "
                            f"same-size copy  {100 * gbps / big_copy_gbps:5.0f}% 1 GiB copy  {cfg!r}")
    print("\n".join(best), flush=True)


def sweep_prefill(tokens=(4096,), requests=(1,), dtype: torch.dtype = torch.bfloat16,
                  device: str = "cuda", out_json: str | None = None) -> None:
    """Times every ``mamba_ssd.ssd_candidates()`` config of the chunked scan (the launcher under
    ``override_ssd_config``, CUDA-graph timer) on both models, after checking its output and
    final states against the default's; prints us, TFLOP/s over ``ssd_flops``, the speedup over
    the default, then the best config per shape, the best over all shapes (geometric mean of the
    time relative to each shape's best; ``out_json`` gets its fields) and the default's time per
    kernel (profiler)."""
    from customop.backends.triton import mamba_ssd
    from customop.benchmarks.runner_timing import time_graph

    dev = torch.device(device)
    best, times = [], {}
    for model in MODELS:
        for T in tokens:
            for S in requests:
                shape = _shape(T, model, S)
                i = _prefill_inputs(shape, dtype, dev)
                state0 = i["state"].clone()
                flops = ssd_flops(shape)

                def once(cfg, i=i, state0=state0):
                    state = state0.clone()
                    with mamba_ssd.override_ssd_config(cfg):
                        out = mamba_ssd.ssd_chunk_scan(i["x"], i["dt"], i["A"], i["B"], i["C"], i["D"], i["dt_bias"],
                                                       state, i["qsl"], i["slots"], i["init"], CHUNK, True,
                                                       spec.NULL_BLOCK_ID)
                    return out.float(), state

                def timed(cfg, i=i, state0=state0):
                    args = (i["x"], i["dt"], i["A"], i["B"], i["C"], i["D"], i["dt_bias"], state0.clone(), i["qsl"],
                            i["slots"], i["init"], CHUNK, True, spec.NULL_BLOCK_ID)
                    with mamba_ssd.override_ssd_config(cfg):
                        return time_graph([lambda: mamba_ssd.ssd_chunk_scan(*args)])

                rows, base_us = [], None  # the first candidate is the default
                for cfg, us, check in _checked_times(f"{shape.label:20s}", mamba_ssd.ssd_candidates(), once, timed,
                                                     1e-2):
                    base_us = base_us or us
                    print(f"{shape.label:20s} {cfg.label():52s} {us:8.1f} us {flops / us / 1e6:6.1f} TFLOP/s "
                          f"{base_us / us:5.2f}x  {check}", flush=True)
                    if check == "ok":
                        rows.append((us, cfg))
                        times.setdefault(cfg, []).append(us)
                if rows:
                    us, cfg = min(rows, key=lambda r: r[0])
                    best.append(f"{shape.label:20s} best {us:8.1f} us ({base_us / us:.2f}x the default)  {cfg!r}")
                if T == tokens[0] and S == requests[0]:
                    _profile_kernels(once, mamba_ssd.SSDConfig())
    print("\n".join(best), flush=True)
    n_shapes = max(len(v) for v in times.values())
    floor = [min(v[k] for v in times.values() if len(v) == n_shapes) for k in range(n_shapes)]
    score = {cfg: math.prod(us / f for us, f in zip(v, floor)) ** (1 / n_shapes)
             for cfg, v in times.items() if len(v) == n_shapes}
    overall = min(score, key=score.get)
    print(f"best over all shapes ({score[overall]:.3f}x the per-shape bests): {overall!r}", flush=True)
    if out_json:
        import json

        with open(out_json, "w") as f:
            json.dump(dataclasses.asdict(overall), f)


def _profile_kernels(once, cfg) -> None:
    """The CUDA time of each kernel of one call under ``cfg`` (torch.profiler, 5 calls)."""
    from torch.profiler import ProfilerActivity, profile

    once(cfg)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            once(cfg)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12), flush=True)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="state-space benchmark helpers (the timing itself: customop bench)")
    parser.add_argument("--sweep-decode", action="store_true", help="time the decode kernel's candidate configs")
    parser.add_argument("--batches", default="1,16,64,256", help="decode batches of the sweep")
    parser.add_argument("--sweep-prefill", action="store_true", help="time the chunked scan's candidate configs")
    parser.add_argument("--sweep-out", default=None, help="--sweep-prefill: JSON file for the best config's fields")
    parser.add_argument("--tflops", metavar="RESULTS_JSON", help="print the chunked scan's TFLOP/s from a runner's results")
    args = parser.parse_args(argv)
    if args.tflops:
        import json

        with open(args.tflops) as f:
            data = json.load(f)
        print(tflops_table(data["results"] if isinstance(data, dict) else data))
    if args.sweep_decode:
        from customop.backend_loader import load_backend

        load_backend("cuda")
        sweep_decode(tuple(int(b) for b in args.batches.split(",")))
    if args.sweep_prefill:
        from customop.backend_loader import load_backend

        load_backend("cuda")
        sweep_prefill(out_json=args.sweep_out)
    return 0


SPECS = [
    OpSpec("selective_state_update", "mamba", tuple(_shape(b, m, quick=b in (1, 256)) for m in MODELS
                                                   for b in (1, 16, 64, 256)),
           _decode_inputs, _decode_bytes, _decode_impls(), mutates=("state",)),
    OpSpec("ssd_chunk_scan", "mamba", tuple(_shape(t, m, r, quick=(t == 4096 and r == 1)) for m in MODELS
                                            for t in (1024, 4096, 16384) for r in (1, 8)),
           _prefill_inputs, _prefill_bytes, _prefill_impls(), mutates=("state",)),
    *_conv_specs(),
    _norm_spec(),
]


if __name__ == "__main__":
    import sys

    sys.exit(main())
