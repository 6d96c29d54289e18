"""The state-space family's math: the spec of ``mamba_mixer``, ``mamba_mixer2``,
``mixer2_gated_rms_norm`` and ``short_conv`` as pure functions (vLLM 0.33's semantics).

Batch and cache contract (docs/mamba.md has the user's version):

- Tokens are token-major, ``[decode tokens | prefill tokens]``; a decode request has one token.
  Prefill request ``i`` owns tokens ``query_start_loc[i]:query_start_loc[i + 1]`` of the prefill
  part (offsets relative to the first prefill token).
- Each request owns one cache slot (``cache_indices[i]``). The conv state of a slot is
  ``(C, width)`` with ``width >= K - 1``; its first ``K - 1`` columns are the last ``K - 1``
  inputs, oldest first (the rest is never read or written). The SSM state is ``(H, P, N)``.
- A request starts from its slot's states when ``has_initial_state[i]`` (decode requests always
  do), else from zeros; afterwards its slot holds its final states, in the cache's dtype.
- A negative slot (``PAD_SLOT_ID`` is -1) or the reserved null block (``null_block_id``, 0 in
  vLLM) marks padding (CUDA-graph padding rows): the request is computed from zero states and
  nothing is read from or written to any cache slot. A request with no tokens is skipped entirely.

Rounding follows vLLM's kernels: the conv casts its input to the conv state's dtype and
accumulates in fp32; the scans run in fp32; outputs are cast to the input's dtype once.

The functions that take a cache write it in place (as the kernels do); they read slot numbers
and offsets on the host (``tolist``), which is fine for a spec and is what the kernels avoid.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

PAD_SLOT_ID = -1
NULL_BLOCK_ID = 0


def is_padding(slot: int, null_block_id: int = NULL_BLOCK_ID) -> bool:
    return slot < 0 or slot == null_block_id


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """The accumulation dtype: fp32 as in the kernels (fp64 for fp64 inputs, for the tests)."""
    return torch.promote_types(t.dtype, torch.float32)


def softplus(v: torch.Tensor) -> torch.Tensor:
    """``log(1 + e^v)``, and ``v`` itself above 20 (the kernels' threshold, torch's default)."""
    return F.softplus(v, beta=1.0, threshold=20.0)


@dataclasses.dataclass(frozen=True)
class MambaMetadata:
    """One step's batch, as vLLM's Mamba metadata builders describe it (their field names).

    Tokens ``[0, num_decodes)`` are decodes (one token each, request ``j`` in
    ``state_indices_tensor_d[j]``), the next ``num_prefill_tokens`` are prefills split by
    ``query_start_loc_p``; rows past both are padding and are left zero in the output. The
    prefill tensors are None when there are no prefills, ``state_indices_tensor_d`` when there are
    no decodes. ``chunk_size`` is the Mamba-2 scan's chunk (a power of two). Speculative decoding
    (several tokens per decode request) is not supported.
    """

    num_decodes: int = 0
    num_prefills: int = 0
    num_prefill_tokens: int = 0
    query_start_loc_p: torch.Tensor | None = None  # (num_prefills + 1,) int
    state_indices_tensor_p: torch.Tensor | None = None  # (num_prefills,) int
    has_initial_states_p: torch.Tensor | None = None  # (num_prefills,) bool
    state_indices_tensor_d: torch.Tensor | None = None  # (num_decodes,) or (num_decodes, 1) int
    chunk_size: int = 256

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes

    @property
    def num_actual_tokens(self) -> int:
        return self.num_decodes + self.num_prefill_tokens

    @property
    def decode_slots(self) -> torch.Tensor | None:
        """The decode requests' slots as a 1-D tensor (column 0 of a 2-D index tensor)."""
        d = self.state_indices_tensor_d
        return None if d is None else (d[:, 0] if d.dim() == 2 else d)

    @classmethod
    def build(cls, decode_slots=(), prefill_lens=(), prefill_slots=(), has_initial_state=(),
              chunk_size: int = 256, device: str | torch.device = "cpu") -> MambaMetadata:
        """The metadata of ``len(decode_slots)`` decodes followed by prefills of ``prefill_lens``
        tokens in ``prefill_slots`` (``has_initial_state``: continue from the cached states)."""
        if not (len(prefill_lens) == len(prefill_slots) == len(has_initial_state)):
            raise ValueError("MambaMetadata.build: prefill_lens, prefill_slots and has_initial_state "
                             "need one entry per prefill request")
        ints = dict(dtype=torch.int32, device=device)
        decodes = torch.tensor(list(decode_slots), **ints) if len(decode_slots) else None
        if not len(prefill_lens):
            return cls(num_decodes=len(decode_slots), state_indices_tensor_d=decodes, chunk_size=chunk_size)
        return cls(num_decodes=len(decode_slots), num_prefills=len(prefill_lens),
                   num_prefill_tokens=int(sum(prefill_lens)),
                   query_start_loc_p=torch.tensor([0, *prefill_lens], **ints).cumsum(0, dtype=torch.int32),
                   state_indices_tensor_p=torch.tensor(list(prefill_slots), **ints),
                   has_initial_states_p=torch.tensor(list(has_initial_state), dtype=torch.bool, device=device),
                   state_indices_tensor_d=decodes, chunk_size=chunk_size)


def iter_requests(query_start_loc: torch.Tensor, cache_indices: torch.Tensor, has_initial_state: torch.Tensor,
              null_block_id: int):
    """(start, end, slot, start from the cache, write the cache) per request with tokens."""
    qsl = query_start_loc.tolist()
    for i, (slot, init) in enumerate(zip(cache_indices.tolist(), has_initial_state.tolist())):
        if qsl[i + 1] > qsl[i]:
            pad = is_padding(slot, null_block_id)
            yield qsl[i], qsl[i + 1], slot, bool(init) and not pad, not pad


# ---- causal depthwise conv1d --------------------------------------------------------------------


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_states: torch.Tensor, query_start_loc: torch.Tensor, cache_indices: torch.Tensor,
                         has_initial_state: torch.Tensor, silu: bool,
                         null_block_id: int = NULL_BLOCK_ID) -> torch.Tensor:
    """Causal depthwise conv1d over varlen requests, continuing from and updating the conv states.

    ``x``: ``(T, C)``; ``weight``: ``(C, K)`` (``weight[:, K - 1]`` multiplies the current token);
    ``conv_states``: ``(slots, C, width >= K - 1)``, any strides. Per request the window is the
    last ``K - 1`` inputs (from the cache or zeros) followed by its tokens; each output is
    ``bias + sum_k weight[:, k] * window[:, t + k]``, then SiLU when ``silu``. Returns ``(T, C)``
    in x's dtype (rows of skipped requests are zero).
    """
    K, acc = weight.shape[1], acc_dtype(x)
    w = weight.to(acc)
    b = bias.to(acc) if bias is not None else torch.zeros_like(w[:, 0])
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    for start, end, slot, from_cache, write in iter_requests(query_start_loc, cache_indices, has_initial_state,
                                                         null_block_id):
        window = conv_states[slot, :, :K - 1].to(acc) if from_cache else w.new_zeros(w.shape[0], K - 1)
        for t in range(start, end):
            # the kernels store and read inputs in the cache's dtype
            window = torch.cat([window, x[t].to(conv_states.dtype).to(acc)[:, None]], dim=1)
            y = (window * w).sum(dim=1) + b
            out[t] = F.silu(y) if silu else y
            window = window[:, 1:]
        if write:
            conv_states[slot, :, :K - 1] = window.to(conv_states.dtype)
    return out.to(x.dtype)


def causal_conv1d_update(x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None, cache_indices: torch.Tensor, silu: bool,
                         null_block_id: int = NULL_BLOCK_ID) -> torch.Tensor:
    """One decode step per request: ``x`` is ``(B, C)``, request ``b`` in ``cache_indices[b]``,
    always continuing from its cached state. The varlen conv with one token per request."""
    ones = torch.arange(x.shape[0] + 1, device=x.device)
    return causal_conv1d_varlen(x, weight, bias, conv_states, ones, cache_indices,
                                torch.ones(x.shape[0], dtype=torch.bool, device=x.device), silu, null_block_id)


# ---- the selective scan (Mamba-1; Mamba-2's recurrence in the head form) ------------------------


def selective_scan_varlen(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                          D: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None,
                          ssm_states: torch.Tensor, query_start_loc: torch.Tensor, cache_indices: torch.Tensor,
                          has_initial_state: torch.Tensor, dt_softplus: bool,
                          null_block_id: int = NULL_BLOCK_ID) -> torch.Tensor:
    """The selective-scan recurrence, token by token, in vLLM's head form (all fp32).

    ``x, dt, z``: ``(T, H, P)``; ``A``: ``(H, P, N)``; ``B, C``: ``(T, G, N)``, head ``h`` reading
    group ``h // (H / G)``; ``D, dt_bias``: ``(H, P)``; ``ssm_states``: ``(slots, H, P, N)``.
    Mamba-1 is ``H = G = 1, P = D``; Mamba-2 passes per-head ``dt, A, D, dt_bias`` expanded over
    ``P`` (and ``N``). Per token::

        delta = softplus(dt + dt_bias)                 (softplus only when dt_softplus)
        h     = exp(delta * A) * h + (delta * x) * B
        y     = sum_n h * C + D * x,   then y * silu(z) when z is given

    Returns ``(T, H, P)`` in x's dtype.
    """
    (H, P, N), acc = A.shape, acc_dtype(x)
    heads_per_group = H // B.shape[1]
    A, out = A.to(acc), torch.zeros(x.shape, dtype=acc, device=x.device)
    for start, end, slot, from_cache, write in iter_requests(query_start_loc, cache_indices, has_initial_state,
                                                         null_block_id):
        h = ssm_states[slot].to(acc) if from_cache else A.new_zeros(H, P, N)
        for t in range(start, end):
            delta = dt[t].to(acc) + (dt_bias.to(acc) if dt_bias is not None else 0.0)
            delta = softplus(delta) if dt_softplus else delta
            Bt = B[t].to(acc).repeat_interleave(heads_per_group, dim=0)[:, None, :]  # (H, 1, N)
            Ct = C[t].to(acc).repeat_interleave(heads_per_group, dim=0)[:, None, :]
            xt = x[t].to(acc)
            h = torch.exp(delta[..., None] * A) * h + (delta * xt)[..., None] * Bt
            y = (h * Ct).sum(dim=-1)
            if D is not None:
                y = y + D.to(acc) * xt
            if z is not None:
                y = y * F.silu(z[t].to(acc))
            out[t] = y
        if write:
            ssm_states[slot] = h.to(ssm_states.dtype)
    return out.to(x.dtype)


def selective_state_update(ssm_states: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                           B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None,
                           dt_bias: torch.Tensor | None, cache_indices: torch.Tensor, dt_softplus: bool,
                           null_block_id: int = NULL_BLOCK_ID) -> torch.Tensor:
    """One decode step per request (``x``: ``(B, H, P)``), continuing from the cached state: the
    varlen scan with one token per request. A padding row is computed from a zero state."""
    ones = torch.arange(x.shape[0] + 1, device=x.device)
    return selective_scan_varlen(x, dt, A, B, C, D, z, dt_bias, ssm_states, ones, cache_indices,
                                 torch.ones(x.shape[0], dtype=torch.bool, device=x.device), dt_softplus,
                                 null_block_id)


def ssd_head_form(dt: torch.Tensor, A: torch.Tensor, D: torch.Tensor | None, dt_bias: torch.Tensor | None,
                  head_dim: int, state_size: int):
    """Mamba-2's per-head ``dt (T, H)``, ``A, D, dt_bias (H,)`` expanded (stride 0, no copy) to
    the scan's head form ``(T, H, P)``, ``(H, P, N)``, ``(H, P)``."""
    H = A.shape[0]
    return (dt[:, :, None].expand(-1, -1, head_dim), A[:, None, None].expand(H, head_dim, state_size),
            None if D is None else D[:, None].expand(H, head_dim),
            None if dt_bias is None else dt_bias[:, None].expand(H, head_dim))


def ssd_recurrent(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                  D: torch.Tensor | None, dt_bias: torch.Tensor | None, ssm_states: torch.Tensor,
                  query_start_loc: torch.Tensor, cache_indices: torch.Tensor, has_initial_state: torch.Tensor,
                  dt_softplus: bool = True, null_block_id: int = NULL_BLOCK_ID) -> torch.Tensor:
    """Mamba-2's SSD recurrence with groups, token by token: ``x (T, H, P)``, ``dt (T, H)``,
    ``A, D, dt_bias (H,)``, ``B, C (T, G, N)``, ``ssm_states (slots, H, P, N)``; no gate (the
    norm applies it). Returns ``(T, H, P)`` in x's dtype."""
    dt4, A4, D4, bias4 = ssd_head_form(dt, A, D, dt_bias, x.shape[2], B.shape[2])
    return selective_scan_varlen(x, dt4, A4, B, C, D4, None, bias4, ssm_states, query_start_loc, cache_indices,
                                 has_initial_state, dt_softplus, null_block_id)


# ---- the grouped gated RMSNorm ------------------------------------------------------------------


def mixer2_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None, eps: float,
                          group_size: int) -> torch.Tensor:
    """``g = x * silu(fp32 gate)`` (an fp32 product); without a weight (``use_rms_norm=False``)
    returns ``g`` in x's dtype. Else each group of ``group_size`` lanes is normalised by its own
    RMS, cast to x's dtype, and only then multiplied by the weight (so the result has the
    promoted dtype of x and the weight)."""
    g = x * F.silu(gate.float())
    if weight is None:
        return g.to(x.dtype)
    groups = g.unflatten(-1, (-1, group_size))
    g = (groups * torch.rsqrt(groups.pow(2).mean(dim=-1, keepdim=True) + eps)).flatten(-2)
    return weight * g.to(x.dtype)


# ---- Mamba-2's chunked SSD form -----------------------------------------------------------------


def ssd_chunks(query_start_loc: torch.Tensor, chunk_size: int) -> list[tuple[int, int, int]]:
    """``(request, start, end)`` of every chunk: each request's tokens cut every ``chunk_size``
    tokens from its first one (chunks never cross requests)."""
    qsl = query_start_loc.tolist()
    return [(i, s, min(s + chunk_size, qsl[i + 1])) for i in range(len(qsl) - 1)
            for s in range(qsl[i], qsl[i + 1], chunk_size)]


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                D: torch.Tensor | None, dt_bias: torch.Tensor | None, initial_states: torch.Tensor,
                query_start_loc: torch.Tensor, chunk_size: int,
                dt_softplus: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD recurrence (``ssd_recurrent``'s math) computed chunk by chunk, in fp32.

    ``initial_states``: ``(requests, H, P, N)`` (zeros for a fresh request). Returns ``(y, final
    states)``: ``y (T, H, P)`` and ``(requests, H, P, N)``, both fp32 (a request without tokens
    keeps its initial state). Within a chunk of ``L`` tokens, with ``a_t`` the running sum of
    ``delta * A`` from the chunk's start:

    1. chunk cumsum: ``a_t``;
    2. chunk state: the state each chunk reaches from zero, ``sum_s exp(a_L - a_s) delta_s x_s B_s``;
    3. state passing: ``h_in(c + 1) = exp(a_L(c)) * h_in(c) + state(c)``, restarting at each
       request's initial state;
    4. chunk scan: ``y_t = exp(a_t) C_t h_in + sum_{s <= t} (C_t . B_s) exp(a_t - a_s) delta_s x_s
       + D x_t``.
    """
    (T, H, P), (G, N), acc = x.shape, B.shape[1:], acc_dtype(x)
    delta = dt.to(acc) + (dt_bias.to(acc) if dt_bias is not None else 0.0)
    delta = softplus(delta) if dt_softplus else delta  # (T, H)
    chunks = ssd_chunks(query_start_loc, chunk_size)
    n, L = len(chunks), chunk_size
    # Gather the tokens into zero-padded chunks: a padded row has delta = 0, x = B = 0, so it
    # changes no running sum and adds to no state.
    index = torch.full((n, L), T, dtype=torch.long, device=x.device)
    for c, (_, start, end) in enumerate(chunks):
        index[c, :end - start] = torch.arange(start, end, device=x.device)

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t.to(acc), t.new_zeros(1, *t.shape[1:], dtype=acc)])[index]

    xc, dtc = padded(x), padded(delta)  # (n, L, H, P), (n, L, H)
    Bc = padded(B).repeat_interleave(H // G, dim=2)  # (n, L, H, N): head h reads group h // (H/G)
    Cc = padded(C).repeat_interleave(H // G, dim=2)

    a = torch.cumsum(dtc * A.to(acc), dim=1)  # 1. (n, L, H)
    states = torch.einsum("clhn,clh,clhp->chpn", Bc, torch.exp(a[:, -1:] - a) * dtc, xc)  # 2.

    h_in = torch.empty(n, H, P, N, dtype=acc, device=x.device)  # 3.
    final = initial_states.to(acc).clone()
    starts = query_start_loc.tolist()
    for c, (request, start, end) in enumerate(chunks):
        h = final[request] if start == starts[request] else h
        h_in[c] = h
        h = torch.exp(a[c, -1])[:, None, None] * h + states[c]
        final[request] = h

    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()  # 4.
    decay = torch.exp((a[:, :, None, :] - a[:, None, :, :]).masked_fill(~causal[None, :, :, None], float("-inf")))
    scores = torch.einsum("clhn,cshn->clsh", Cc, Bc) * decay * dtc[:, None, :, :]  # (n, t, s, H)
    y = torch.einsum("clsh,cshp->clhp", scores, xc)
    y = y + torch.einsum("clhn,chpn->clhp", Cc, h_in) * torch.exp(a)[..., None]
    if D is not None:
        y = y + D.to(acc)[:, None] * xc
    out = torch.zeros(T, H, P, dtype=acc, device=x.device)
    valid = index < T
    out[index[valid]] = y[valid]
    return out, final


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor | None, dt_bias: torch.Tensor | None, ssm_states: torch.Tensor,
                   query_start_loc: torch.Tensor, cache_indices: torch.Tensor, has_initial_state: torch.Tensor,
                   chunk_size: int, dt_softplus: bool = True, null_block_id: int = NULL_BLOCK_ID) -> torch.Tensor:
    """``ssd_recurrent``'s contract computed by ``ssd_chunked``: initial states gathered from the
    cache, final states written back (same padding and empty-request rules)."""
    S, (H, P, N) = cache_indices.shape[0], ssm_states.shape[1:]
    slots, inits, lens = cache_indices.tolist(), has_initial_state.tolist(), query_start_loc.diff().tolist()
    initial = torch.zeros(S, H, P, N, dtype=acc_dtype(x), device=x.device)
    for i, slot in enumerate(slots):
        if inits[i] and not is_padding(slot, null_block_id):
            initial[i] = ssm_states[slot]
    y, final = ssd_chunked(x, dt, A, B, C, D, dt_bias, initial, query_start_loc, chunk_size, dt_softplus)
    for i, slot in enumerate(slots):
        if lens[i] > 0 and not is_padding(slot, null_block_id):
            ssm_states[slot] = final[i].to(ssm_states.dtype)
    return y.to(x.dtype)
