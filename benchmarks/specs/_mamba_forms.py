"""The state-space specs' plain-torch baselines: the decode step, the chunked SSD scan (whole
and one chunk at a time) with its matmul FLOPs, and the causal conv, written for equal-length
requests so that ``torch.compile(fullgraph=True)`` and CUDA graphs take them. A helper module of
``mamba`` (the runner's spec collection skips names with a leading underscore).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from customop.benchmarks.specs import Shape
from customop.benchmarks.specs._mamba_inputs import CHUNK

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


def conv_prefill(x, w, b, requests: int):
    """Equal-length requests from zero states: F.conv1d on each, SiLU."""
    xs = x.view(requests, -1, x.shape[1]).transpose(1, 2).float()
    y = F.conv1d(F.pad(xs, (w.shape[1] - 1, 0)), w.float()[:, None, :], b.float(), groups=x.shape[1])
    return F.silu(y).transpose(1, 2).reshape(x.shape).to(x.dtype)


def conv_update(x, state, w, b, slots):
    window = torch.cat([state[slots.long()].transpose(1, 2).float(), x.float()[:, :, None]], dim=2)
    state.index_copy_(0, slots.long(), window[:, :, 1:].transpose(1, 2).to(state.dtype))
    return F.silu((window * w.float()).sum(-1) + b.float()).to(x.dtype)
