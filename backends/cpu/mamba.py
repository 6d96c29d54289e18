"""CPU steps of the state-space ops: the spec's math (``customop/math/mamba.py``) batched.

The spec walks requests and tokens one at a time, about ten small ATen calls per token; here

- the conv runs one ``F.conv1d`` per request (over the cached window followed by its tokens);
- a decode step gathers every request's state, takes one batched step and scatters the states
  back (padding rows computed from zero states, their slots untouched, as in the spec);
- a prefill scan precomputes ``exp(delta * A)`` and ``delta * x * B`` for blocks of tokens, so the
  sequential part is one multiply-add per token, and reads ``y`` out of the stacked states with
  one contraction per block;
- Mamba-2 prefill takes the chunked SSD form (matmuls) once a request reaches
  ``SSD_CHUNKED_FROM`` tokens, where it measured faster than the recurrence, in chunks of
  ``SSD_CPU_CHUNK`` tokens whatever the batch's ``chunk_size`` (a tiling choice: the result is the
  same up to rounding; 32 measured 2-4x faster than 256 on the CPU, whose padded ``L x L`` decay
  matrices dominate).

Same formulas, same dtypes (fp32 accumulation, inputs rounded to the cache dtype where the spec
rounds them); only the summation order differs, so results agree with the spec to fp32 rounding.
Torch only; imports no op class.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from customop.math import mamba as spec

#: tokens per block of the prefill recurrence: the (block, H, P, N) temporaries stay in cache
SCAN_BLOCK = 32
#: Mamba-2 prefill takes the chunked form once a request is this long, with chunks of
#: SSD_CPU_CHUNK tokens (benchmarks/results/cpu_mamba.md, one thread, 8 heads x 32 x 32, fp32: the
#: blocked recurrence against chunks of 32 took 1031 / 1297 us at 16 tokens, 1885 / 1304 us at 32,
#: 76 / 22 ms at 2048; chunks of 256 took 36 ms at 512 tokens, where chunks of 32 took 5.4 ms)
SSD_CHUNKED_FROM = 32
SSD_CPU_CHUNK = 32


def causal_conv1d_varlen(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
                         silu, null_block_id=spec.NULL_BLOCK_ID):
    (C, K), acc = weight.shape, spec.acc_dtype(x)
    w, b = weight.to(acc)[:, None, :], None if bias is None else bias.to(acc)
    xs = x.to(conv_states.dtype).to(acc)  # the kernels read inputs in the cache's dtype
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    for start, end, slot, from_cache, write in spec.iter_requests(query_start_loc, cache_indices,
                                                                  has_initial_state, null_block_id):
        init = conv_states[slot, :, :K - 1].to(acc) if from_cache else xs.new_zeros(C, K - 1)
        window = torch.cat([init, xs[start:end].t()], dim=1)  # (C, K - 1 + L)
        y = F.conv1d(window[None], w, b, groups=C)[0].t()
        out[start:end] = F.silu(y) if silu else y
        if write:
            conv_states[slot, :, :K - 1] = window[:, window.shape[1] - (K - 1):].to(conv_states.dtype)
    return out.to(x.dtype)


def _gather(states: torch.Tensor, slots: torch.Tensor, null_block_id: int, acc: torch.dtype):
    """(each row's state, zero for padding rows; the real rows' mask)."""
    real = (slots >= 0) & (slots != null_block_id)
    got = states[slots.clamp(min=0).long()].to(acc)
    # where, not a multiply by the mask: a padding row's slot may hold anything, NaN included
    return torch.where(real.view(-1, *[1] * (got.dim() - 1)), got, 0.0), real


def _scatter(states: torch.Tensor, slots: torch.Tensor, real: torch.Tensor, new: torch.Tensor) -> None:
    states[slots[real].long()] = new[real].to(states.dtype)


def causal_conv1d_update(x, conv_states, weight, bias, cache_indices, silu, null_block_id=spec.NULL_BLOCK_ID):
    K, acc = weight.shape[1], spec.acc_dtype(x)
    init, real = _gather(conv_states[:, :, :K - 1], cache_indices, null_block_id, acc)
    window = torch.cat([init, x.to(conv_states.dtype).to(acc)[:, :, None]], dim=2)  # (B, C, K)
    y = (window * weight.to(acc)).sum(dim=2) + (0.0 if bias is None else bias.to(acc))
    states = conv_states[:, :, :K - 1]
    states[cache_indices[real].long()] = window[real, :, 1:].to(conv_states.dtype)
    return (F.silu(y) if silu else y).to(x.dtype)


def _delta(dt, dt_bias, dt_softplus, acc):
    delta = dt.to(acc) + (0.0 if dt_bias is None else dt_bias.to(acc))
    return spec.softplus(delta) if dt_softplus else delta


def _heads(t, heads, acc):
    """``(T, G, N)`` -> ``(T, H, 1, N)``: head h reads group h // (H / G)."""
    return t.to(acc).repeat_interleave(heads // t.shape[1], dim=1)[:, :, None, :]


def _finish(y, x, D, z, acc):
    if D is not None:
        y = y + D.to(acc) * x.to(acc)
    return y * F.silu(z.to(acc)) if z is not None else y


def selective_state_update(ssm_states, x, dt, A, B, C, D, z, dt_bias, cache_indices, dt_softplus,
                           null_block_id=spec.NULL_BLOCK_ID):
    acc = spec.acc_dtype(x)
    h, real = _gather(ssm_states, cache_indices, null_block_id, acc)  # (B, H, P, N)
    delta = _delta(dt, dt_bias, dt_softplus, acc)
    h = torch.exp(delta[..., None] * A.to(acc)) * h + (delta * x.to(acc))[..., None] * _heads(B, A.shape[0], acc)
    _scatter(ssm_states, cache_indices, real, h)
    y = (h * _heads(C, A.shape[0], acc)).sum(dim=-1)
    return _finish(y, x, D, z, acc).to(x.dtype)


def selective_scan_varlen(x, dt, A, B, C, D, z, dt_bias, ssm_states, query_start_loc, cache_indices,
                          has_initial_state, dt_softplus, null_block_id=spec.NULL_BLOCK_ID):
    (H, P, N), acc = A.shape, spec.acc_dtype(x)
    delta, Af = _delta(dt, dt_bias, dt_softplus, acc), A.to(acc)
    Bh, Ch, xf = _heads(B, H, acc), _heads(C, H, acc), x.to(acc)
    y = torch.zeros(x.shape, dtype=acc, device=x.device)
    for start, end, slot, from_cache, write in spec.iter_requests(query_start_loc, cache_indices,
                                                                  has_initial_state, null_block_id):
        h = ssm_states[slot].to(acc) if from_cache else Af.new_zeros(H, P, N)
        for t0 in range(start, end, SCAN_BLOCK):
            t1 = min(t0 + SCAN_BLOCK, end)
            decay = torch.exp(delta[t0:t1, ..., None] * Af)  # (L, H, P, N)
            inputs = (delta[t0:t1] * xf[t0:t1])[..., None] * Bh[t0:t1]
            hs = torch.empty_like(decay)
            for i in range(t1 - t0):
                h = hs[i] = decay[i] * h + inputs[i]
            y[t0:t1] = (hs * Ch[t0:t1]).sum(dim=-1)
        if write:
            ssm_states[slot] = h.to(ssm_states.dtype)
    return _finish(y, x, D, z, acc).to(x.dtype)


def ssd_prefill(x, dt, A, B, C, D, dt_bias, ssm_states, query_start_loc, cache_indices, has_initial_state,
                chunk_size, dt_softplus=True, null_block_id=spec.NULL_BLOCK_ID):
    """Mamba-2 prefill: the chunked form (chunks of ``SSD_CPU_CHUNK``) when the longest request
    reaches ``SSD_CHUNKED_FROM`` tokens, else the blocked recurrence in the head form."""
    if int(query_start_loc.diff().max()) >= SSD_CHUNKED_FROM:
        return spec.ssd_chunk_scan(x, dt, A, B, C, D, dt_bias, ssm_states, query_start_loc, cache_indices,
                                   has_initial_state, SSD_CPU_CHUNK, dt_softplus, null_block_id)
    dt4, A4, D4, bias4 = spec.ssd_head_form(dt, A, D, dt_bias, x.shape[2], B.shape[2])
    return selective_scan_varlen(x, dt4, A4, B, C, D4, None, bias4, ssm_states, query_start_loc, cache_indices,
                                 has_initial_state, dt_softplus, null_block_id)
