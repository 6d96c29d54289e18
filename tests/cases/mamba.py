"""Float64 references of the state-space table (``customop/samples/mamba.py``), written from the
formulas and the batch description (``Batch``: Python lists, not the metadata tensors), not from
``customop.math``. The activations are rounded to the op's dtype where the layer stores them (each
projection's output, the conv's input in the cache dtype and its output, the scan's output, the
norm before its weight) and exact everywhere else, so a path is judged only by its own rounding.

``reference(case, op, batch, h, *caches)`` returns ``(output, *expected caches)`` in float64: the
output with zero rows past the batch, the caches as they must be afterwards (every slot: the ones
no request owns, padding's null slot and the spare, unchanged).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from customop.samples.mamba import MIXER_TOLERANCE, Batch, MixerCase
from customop.testing import assert_close
from tests.cases.layernorm import ref_rms_norm


def rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as stored in ``dtype``, back in float64."""
    return t.to(dtype).double()


def silu(v: torch.Tensor) -> torch.Tensor:
    return v / (1 + torch.exp(-v))


def softplus(v: torch.Tensor) -> torch.Tensor:
    return torch.where(v > 20, v, torch.log1p(torch.exp(v.clamp(max=20))))


def linear(layer, x: torch.Tensor) -> torch.Tensor:
    bias = None if layer.bias is None or layer.skip_bias_add else layer.bias.double()
    return F.linear(x, layer.weight.double(), bias)


def requests(batch: Batch):
    """``(rows, slot, starts from its cache, is real)`` per request in token order: decodes, then
    prefills (empty ones yield no rows)."""
    decode_slots, prefill_slots = batch.slots()
    row = 0
    for slot in decode_slots:
        yield range(row, row + 1), slot, slot != 0, slot != 0
        row += 1
    for length, slot, init in zip(batch.prefill_lens, prefill_slots, batch.has_initial_state):
        yield range(row, row + length), slot, bool(init), length > 0
        row += length


def ref_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cache: torch.Tensor, batch: Batch,
             act: bool) -> torch.Tensor:
    """The conv over every request (``x (tokens, C)``, already in the cache's dtype); writes each
    real request's last K - 1 inputs into ``cache`` (float64, ``(slots, width, C)``)."""
    K = weight.shape[1]
    out = torch.zeros_like(x)
    for rows, slot, init, real in requests(batch):
        window = cache[slot, :K - 1].T if init else x.new_zeros(x.shape[1], K - 1)
        xp = torch.cat([window, x[rows.start:rows.stop].T], dim=1)  # (C, K - 1 + L)
        L = len(rows)
        y = sum(weight[:, k, None] * xp[:, k:k + L] for k in range(K)) + (0 if bias is None else bias[:, None])
        out[rows.start:rows.stop] = (silu(y) if act else y).T
        if real and L:
            cache[slot, :K - 1] = xp[:, L:].T
    return out


def ref_scan(x, delta, A, B, C, ssm: torch.Tensor, batch: Batch) -> torch.Tensor:
    """``h <- exp(delta A) h + delta x B``, ``y = sum_n h C`` per request: ``x, delta (T, H, P)``,
    ``A (H, P, N)``, ``B, C (T, H, N)`` (already per head); the final states go to ``ssm``."""
    y = torch.zeros_like(x)
    for rows, slot, init, real in requests(batch):
        h = ssm[slot].clone() if init else x.new_zeros(A.shape)
        for t in rows:
            h = torch.exp(delta[t][..., None] * A) * h + (delta[t] * x[t])[..., None] * B[t][:, None, :]
            y[t] = (h * C[t][:, None, :]).sum(-1)
        if real and len(rows):
            ssm[slot] = h
    return y


def ref_gated_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor | None, eps: float, group_size: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """Mixer2RMSNormGated: ``y * silu(z)``, RMS per group, rounded to ``dtype``, times the weight."""
    g = y.double() * silu(z.double())
    if weight is None:
        return g
    groups = g.unflatten(-1, (-1, group_size))
    n = (groups / torch.sqrt(groups.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    return rounded(n, dtype) * weight.double()


def _mamba1(op, batch, h, conv, ssm, dtype):
    n = batch.tokens - batch.pad_rows
    x, z = rounded(linear(op.in_proj, h[:n].double()), dtype).chunk(2, dim=-1)
    K, D_l = op.conv_kernel_size, op.local_size
    bias = None if op.conv1d.bias is None else op.conv1d.bias.double()
    x = rounded(ref_conv(rounded(x, conv.dtype), op.conv1d.weight.double().view(D_l, K), bias, conv, batch, True),
                dtype)
    dt, B, C = rounded(linear(op.x_proj, x), dtype).split([op.time_step_rank] + [op.ssm_state_size] * 2, dim=-1)
    if op.use_rms_norm:
        dt, B, C = (rounded(ref_rms_norm(t, None if norm.weight is None else norm.weight, norm.eps), dtype)
                    for t, norm in ((dt, op.dt_layernorm), (B, op.b_layernorm), (C, op.c_layernorm)))
    dt = rounded(linear(op.dt_proj, dt), dtype)
    delta = softplus(dt + op.dt_proj.bias.double())
    y = ref_scan(x[:, None], delta[:, None], op.A.double()[None], B[:, None], C[:, None], ssm[:, None], batch)[:, 0]
    y = rounded((y + op.D.double() * x) * silu(z), dtype)
    return linear(op.out_proj, y)


def _mamba2(op, batch, h, conv, ssm, dtype, mup_vector=None):
    n = batch.tokens - batch.pad_rows
    zxbcdt = rounded(linear(op.in_proj, h[:n].double()), dtype)
    if mup_vector is not None:
        zxbcdt = rounded(zxbcdt * mup_vector.double(), dtype)
    H, P, N, G, K = op.local_heads, op.head_dim, op.ssm_state_size, op.local_groups, op.conv_kernel_size
    z, xbc, dt = zxbcdt.split([H * P, op.local_conv_dim, H], dim=-1)
    bias = None if op.conv1d.bias is None else op.conv1d.bias.double()
    xbc = rounded(ref_conv(rounded(xbc, conv.dtype), op.conv1d.weight.double().view(-1, K), bias, conv, batch,
                           True), dtype)
    x, B, C = xbc.split([H * P, G * N, G * N], dim=-1)
    x = x.unflatten(-1, (H, P))
    B, C = (t.unflatten(-1, (G, N)).repeat_interleave(H // G, dim=1) for t in (B, C))  # head h: group h // (H/G)
    delta = softplus(dt + op.dt_bias.double())[..., None].expand(-1, -1, P)
    A = op.A.double()[:, None, None].expand(H, P, N)
    y = ref_scan(x, delta, A, B, C, ssm, batch) + op.D.double()[:, None] * x
    y = rounded(y, dtype).flatten(1)
    norm = op.norm
    group = norm.group_size if norm.n_groups > 1 else y.shape[1]
    y = ref_gated_norm(y, z, norm.weight, norm.variance_epsilon, group, dtype)
    if norm.weight is not None:
        y = rounded(y, torch.promote_types(dtype, norm.weight.dtype))
    return linear(op.out_proj, rounded(y, dtype))


def _short_conv(op, batch, h, conv, dtype):
    n = batch.tokens - batch.pad_rows
    B, C, x = rounded(linear(op.in_proj, h[:n].double()), dtype).chunk(3, dim=-1)
    bias = None if op.conv.bias is None else op.conv.bias.double()
    y = rounded(ref_conv(rounded(rounded(B * x, dtype), conv.dtype), op.conv.weight.double().view(op.local_dim, -1),
                         bias, conv, batch, False), dtype)
    return linear(op.out_proj, rounded(C * y, dtype))


def reference(case: MixerCase, op, batch: Batch, h: torch.Tensor, *caches: torch.Tensor, mup_vector=None):
    """``(output, *caches after the call)``, all float64 (see the module docstring)."""
    dtype = h.dtype
    expected = [c.double() for c in caches]
    # the conv rounds its input to the conv cache's dtype: carry it on the float64 copy
    conv = _Cache(expected[0], caches[0].dtype)
    if case.op == "mamba_mixer":
        out = _mamba1(op, batch, h, conv, expected[1], dtype)
    elif case.op == "mamba_mixer2":
        out = _mamba2(op, batch, h, conv, expected[1], dtype, mup_vector)
    else:
        out = _short_conv(op, batch, h, conv, dtype)
    full = torch.zeros(h.shape, dtype=torch.float64, device=h.device)
    full[:out.shape[0]] = out
    return (full, *expected)


class _Cache:
    """A float64 cache view that remembers the real cache's dtype (``.dtype``) for the rounding."""

    def __init__(self, values: torch.Tensor, dtype: torch.dtype) -> None:
        self.values, self.dtype = values, dtype

    def __getitem__(self, key):
        return self.values[key]

    def __setitem__(self, key, value):
        self.values[key] = rounded(value, self.dtype)


def assert_matches(got, expected, dtype: torch.dtype, what: str = "", close=assert_close) -> None:
    """``(output, *caches)`` of a path against ``reference``'s: the output within
    ``MIXER_TOLERANCE[dtype]`` of it (the absolute part relative to the output's scale), each cache
    within the tolerance of the coarser of its own dtype and ``dtype`` (relative to its scale: a
    state is computed from activations rounded to ``dtype``, so one ulp there moves it by about one
    ulp of ``dtype``), NaN nowhere in the output. ``close`` is ``customop.testing.assert_close``'s
    signature (the GPU tier passes one that compares on the device)."""
    out, *caches = got
    want_out, *want_caches = expected
    assert out.dtype == dtype, f"{what}: output dtype {out.dtype}"
    assert not out.isnan().any(), f"{what}: NaN in the output"
    pairs = [(out, want_out, dtype, "output")]
    for i, (c, w) in enumerate(zip(caches, want_caches)):
        coarse = c.dtype if torch.finfo(c.dtype).eps >= torch.finfo(dtype).eps else dtype
        pairs.append((c, w, coarse, f"cache {i}"))
    for g, w, tol_dtype, name in pairs:
        finite = w[~w.isnan()]
        scale = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
        atol, rtol = MIXER_TOLERANCE[tol_dtype]
        close(g, w, tol_dtype, atol=atol * scale, rtol=rtol, what=f"{what} {name}")


def norm_reference(op, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Mixer2RMSNormGated (built by a ``NormCase``, one rank) on ``x, gate``, float64."""
    group = op.group_size if op.n_groups > 1 else x.shape[-1]
    return ref_gated_norm(x, gate, op.weight, op.variance_epsilon, group, x.dtype)
