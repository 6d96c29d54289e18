"""The state-space family on TPUs (pure JAX): the decode state update and Mamba-2's chunked SSD
scan as Pallas kernels; the causal conv1d and Mamba-1's varlen prefill scan as plain JAX that XLA
compiles. The math and the batch/cache contract are ``customop/math/mamba.py``'s (vLLM 0.33's).

**Emulation only.** Nothing here has run on a TPU. The Pallas kernels are tested in interpret
mode on the CPU and lowered for TPU (Mosaic) without a TPU (tests/backends/tpu); their speed on a
TPU is unmeasured, and so are the block sizes below.

Every function takes the caches and returns ``(output, new cache)``: JAX is functional. The
torch side (``xla_mamba.py``) copies the new cache into the caller's tensor.

- ``selective_state_update`` (decode, Mamba-1 and Mamba-2 head forms): one grid step per
  (head block, state-row block, request). The state block is read through a scalar-prefetched
  slot (pipelined by Pallas) and written back with a DMA into the cache itself
  (``input_output_aliases``), only for real requests: a padding request (negative slot or the
  null block) is computed from zeros and writes nothing, so the state is read once and written
  once. The request is the innermost grid axis, so ``A`` (one block per head block) is fetched
  once per head block, not once per request.
- ``ssd_chunk_scan`` (Mamba-2 prefill): the wrapper gathers the tokens into zero-padded chunks
  (chunks never cross a request; the chunk table is built on the device with a static bound of
  ``T // chunk + requests`` chunks, as the Triton kernel does) and computes ``delta`` and its
  running sum per chunk. One kernel then walks each head's chunks in order (the chunk axis is
  sequential) with the passed state in VMEM: at a request's first chunk it loads the initial
  state; per chunk it computes the outputs (``C h_in`` plus the causal intra-chunk matmuls) and
  the next state. The four steps of ``customop/math/mamba.py``'s ``ssd_chunked`` are one pass.
  Final states go to the cache by a scatter in the wrapper (per request, not per token).
- ``causal_conv1d_fn`` / ``causal_conv1d_update``: K shifted gathers (a tap before a request's
  first token reads its cached window), fused by XLA; the new windows are scattered into the
  slots.
- ``selective_scan`` (Mamba-1 prefill): a ``lax.scan`` over the tokens with the state in the
  loop carry (reset at each request's first token); XLA compiles it to one loop.

All math is fp32; outputs are in x's dtype, caches keep theirs. Matmuls use
``Precision.HIGHEST`` (fp32 accuracy against the spec; a TPU tuning could try bf16 passes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from customop.backends.tpu import tiling

f32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST


def _softplus(v):
    """``log(1 + e^v)``, ``v`` itself above 20 (torch's threshold), ``e^v`` where ``1 + e^v``
    rounds to 1 (no log1p: it keeps the Mosaic lowering to exp and log)."""
    e = jnp.exp(jnp.minimum(v, 20.0))
    return jnp.where(v > 20.0, v, jnp.where(v < -15.0, e, jnp.log(1.0 + e)))


def _silu(v):
    return v / (1.0 + jnp.exp(-v))


def _requests(cache_indices, n_slots: int, null_block_id: int):
    """(real, slot clipped into the cache) per request: a negative slot or the null block is
    padding (computed from zeros, never read or written)."""
    slots = cache_indices.astype(jnp.int32)
    real = (slots >= 0) & (slots != null_block_id)
    return real, jnp.clip(slots, 0, n_slots - 1)


def _scatter_slots(cache, values, slots, write):
    """``cache[slots[i]] = values[i]`` where ``write[i]``; other rows are dropped (an index past
    the end)."""
    index = jnp.where(write, slots, cache.shape[0])
    return cache.at[index].set(values.astype(cache.dtype), mode="drop")


def _token_requests(qsl, n_tokens: int):
    """The request of each token and whether the token belongs to any request."""
    t = jnp.arange(n_tokens, dtype=jnp.int32)
    n_req = qsl.shape[0] - 1
    seq = jnp.clip(jnp.searchsorted(qsl[1:], t, side="right"), 0, n_req - 1).astype(jnp.int32)
    return seq, (t >= qsl[0]) & (t < qsl[-1])


# ---- causal depthwise conv1d (plain JAX) -----------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("silu", "null_block_id"))
def causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, *,
                     silu: bool, null_block_id: int = 0):
    """Varlen causal depthwise conv1d continuing from the cached windows. ``x (T, C)``,
    ``weight (C, K)``, ``conv_states (slots, C, width >= K - 1)``; returns ``(out (T, C) in x's
    dtype, new conv_states)``."""
    T, C = x.shape
    K = weight.shape[1]
    if T == 0 or cache_indices.shape[0] == 0:
        return jnp.zeros(x.shape, x.dtype), conv_states
    qsl = query_start_loc.astype(jnp.int32)
    real, slots = _requests(cache_indices, conv_states.shape[0], null_block_id)
    from_cache = (has_initial_state != 0) & real
    # the kernels store and read inputs in the cache's dtype
    xs = x.astype(conv_states.dtype).astype(f32)
    window = jnp.where(from_cache[:, None, None], conv_states[slots, :, :K - 1].astype(f32), 0.0)  # (S, C, K-1)
    seq, in_batch = _token_requests(qsl, T)
    t = jnp.arange(T, dtype=jnp.int32)
    start = qsl[seq]
    w = weight.astype(f32)
    acc = jnp.zeros((T, C), f32) if bias is None else jnp.broadcast_to(bias.astype(f32), (T, C))
    for k in range(K):
        src = t - (K - 1) + k  # the input this tap reads; before `start` it is in the cached window
        col = jnp.clip((K - 1) + src - start, 0, K - 2)
        tap = jnp.where((src >= start)[:, None], xs[jnp.clip(src, 0, T - 1)], window[seq, :, col])
        acc = acc + tap * w[:, k]
    out = jnp.where(in_batch[:, None], _silu(acc) if silu else acc, 0.0).astype(x.dtype)
    # column j of a request's new window is input n + j of [old window (K-1) | its n tokens]
    n = qsl[1:] - qsl[:-1]
    j = jnp.arange(K - 1, dtype=jnp.int32)
    p = n[:, None] + j[None, :] - (K - 1)  # (S, K-1): the token within the request, < 0: the old window
    from_x = xs[jnp.clip(qsl[:-1, None] + p, 0, T - 1)]  # (S, K-1, C)
    from_window = jnp.take_along_axis(window, jnp.clip(n[:, None] + j[None, :], 0, K - 2)[:, None, :], axis=2)
    new = jnp.where((p >= 0)[:, None, :], jnp.swapaxes(from_x, 1, 2), from_window)  # (S, C, K-1)
    index = jnp.where(real & (n > 0), slots, conv_states.shape[0])
    conv_states = conv_states.at[index, :, :K - 1].set(new.astype(conv_states.dtype), mode="drop")
    return out, conv_states


def causal_conv1d_update(x, conv_states, weight, bias, cache_indices, *, silu: bool, null_block_id: int = 0):
    """One decode token per request (``x (B, C)``), always from the cached window: the varlen
    conv with one token per request."""
    B = x.shape[0]
    return causal_conv1d_fn(x, weight, bias, conv_states, jnp.arange(B + 1, dtype=jnp.int32), cache_indices,
                            jnp.ones((B,), jnp.int32), silu=silu, null_block_id=null_block_id)


# ---- Mamba-1 prefill: the recurrence as one XLA loop -------------------------------------------------


@functools.partial(jax.jit, static_argnames=("dt_softplus", "null_block_id"))
def selective_scan(x, dt, A, B, C, D, z, dt_bias, ssm_states, query_start_loc, cache_indices, has_initial_state,
                   *, dt_softplus: bool, null_block_id: int = 0):
    """The varlen selective scan in vLLM's head form (``customop/math/mamba.py``:
    ``selective_scan_varlen``); returns ``(y (T, H, P) in x's dtype, new ssm_states)``."""
    T, H, P = x.shape
    S = cache_indices.shape[0]
    if T == 0 or S == 0:
        return jnp.zeros(x.shape, x.dtype), ssm_states
    qsl = query_start_loc.astype(jnp.int32)
    real, slots = _requests(cache_indices, ssm_states.shape[0], null_block_id)
    from_cache = (has_initial_state != 0) & real
    initial = jnp.where(from_cache[:, None, None, None], ssm_states[slots].astype(f32), 0.0)
    seq, in_batch = _token_requests(qsl, T)
    t = jnp.arange(T, dtype=jnp.int32)
    delta = dt.astype(f32) + (0.0 if dt_bias is None else dt_bias.astype(f32))
    delta = _softplus(delta) if dt_softplus else delta
    hpg = H // B.shape[1]
    Bh = jnp.repeat(B.astype(f32), hpg, axis=1)  # (T, H, N): head h reads group h // (H / G)
    Ch = jnp.repeat(C.astype(f32), hpg, axis=1)
    xf, Af = x.astype(f32), A.astype(f32)

    def step(carry, inputs):
        h, final = carry
        r, first, last, ok, xt, dt_, bt, ct = inputs
        h = jnp.where(first, initial[r], h)
        h = jnp.exp(dt_[..., None] * Af) * h + (dt_ * xt)[..., None] * bt[:, None, :]
        y = jnp.sum(h * ct[:, None, :], axis=-1)
        final = final.at[r].set(jnp.where(last & ok, h, final[r]))
        return (h, final), y

    starts, ends = qsl[seq], qsl[seq + 1]
    inputs = (seq, t == starts, t == ends - 1, in_batch, xf, delta, Bh, Ch)
    (_, final), y = lax.scan(step, (jnp.zeros((H, P, A.shape[2]), f32), initial), inputs)
    if D is not None:
        y = y + D.astype(f32) * xf
    if z is not None:
        y = y * _silu(z.astype(f32))
    y = jnp.where(in_batch[:, None, None], y, 0.0).astype(x.dtype)
    return y, _scatter_slots(ssm_states, final, slots, real & (qsl[1:] > qsl[:-1]))


# ---- decode: the selective state update (Pallas) -------------------------------------------------------


def _state_update_kernel(slot_ref, real_ref, x_ref, dt_ref, a_ref, b_ref, c_ref, *refs, has_d: bool, has_z: bool,
                         has_bias: bool, softplus: bool):
    refs = list(refs)
    d_ref = refs.pop(0) if has_d else None
    z_ref = refs.pop(0) if has_z else None
    bias_ref = refs.pop(0) if has_bias else None
    state_ref, y_ref, state_out_ref, new_ref, sem = refs
    # program ids are read here: Pallas' interpret mode cannot lower them inside pl.when
    hi, pi, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    real = real_ref[b] != 0
    x = x_ref[...].astype(f32)  # (1, hb, pb, 1): one column per state row
    delta = dt_ref[...].astype(f32)
    if has_bias:
        delta = delta + bias_ref[...].astype(f32)
    if softplus:
        delta = _softplus(delta)
    h = jnp.where(real, state_ref[...].astype(f32), 0.0)  # (1, hb, pb, N); padding: from zeros
    h = jnp.exp(delta * a_ref[...].astype(f32)) * h + (delta * x) * b_ref[...].astype(f32)
    y = jnp.sum(h * c_ref[...].astype(f32), axis=-1, keepdims=True)
    if has_d:
        y = y + d_ref[...].astype(f32) * x
    if has_z:
        y = y * _silu(z_ref[...].astype(f32))
    y_ref[...] = y.astype(y_ref.dtype)
    new_ref[...] = h.astype(new_ref.dtype)
    _, hb, pb, _ = new_ref.shape

    @pl.when(real)
    def _write():
        target = state_out_ref.at[pl.ds(slot_ref[b], 1), pl.ds(hi * hb, hb), pl.ds(pi * pb, pb)]
        copy = pltpu.make_async_copy(new_ref, target, sem)
        copy.start()
        copy.wait()


def _div(a, b: int):
    """``a // b`` for the non-negative grid indices of an index map: truncating division (jnp's
    ``//`` lowers through ``sign``, whose Mosaic rule asks for the TPU generation)."""
    return lax.div(a, jnp.asarray(b, a.dtype))


def _largest_divisor(n: int, at_most: int, step: int = 1) -> int:
    """The largest divisor of ``n`` that is a multiple of ``step`` and at most ``at_most`` (0: none)."""
    return max((d for d in range(step, min(n, at_most) + 1, step) if n % d == 0), default=0)


def _decode_blocks(H: int, P: int, N: int, heads_per_group: int) -> tuple[int, int]:
    """(heads, state rows) per grid step. A block's heads share one group (so one B/C row serves
    them); the rows of a block divide P (a partial block would DMA past the head); VMEM per state
    row: the state block (two pipeline buffers and the write-back copy) and A's (two), padded to
    128 lanes, plus six one-lane columns (x, dt, z, D, dt_bias, y: double-buffered, a 128-lane
    tile each). A starting point; not measured on a TPU."""
    lanes = max(128, -(-N // 128) * 128)
    per_row = 4 * lanes * 5 + 6 * 2 * 128 * 4
    rows = max(8, tiling.VMEM_BLOCK_BUDGET // per_row)
    pb = P if P <= rows else (_largest_divisor(P, rows, 8) or P)
    hb = _largest_divisor(heads_per_group, max(1, rows // pb)) or 1
    return hb, pb


@functools.partial(jax.jit, static_argnames=("dt_softplus", "null_block_id", "interpret"))
def _state_update_jit(ssm_states, x, dt, A, B, C, D, z, dt_bias, cache_indices, *, dt_softplus, null_block_id,
                      interpret):
    Bt, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    if Bt == 0:
        return jnp.zeros(x.shape, x.dtype), ssm_states
    real, slots = _requests(cache_indices, ssm_states.shape[0], null_block_id)
    hb, pb = _decode_blocks(H, P, N, H // G)
    hpg = H // G

    def col(t):  # (B, H, P) -> (B, H, P, 1): a state row's value on its sublane, no relayout
        return t.reshape(*t.shape, 1)

    row_spec = pl.BlockSpec((1, hb, pb, 1), lambda h, p, b, *_: (b, h, p, 0))
    head_spec = pl.BlockSpec((1, hb, pb, 1), lambda h, p, b, *_: (0, h, p, 0))
    group_spec = pl.BlockSpec((1, 1, 1, N), lambda h, p, b, *_: (b, _div(h * hb, hpg), 0, 0))
    arrays = [col(x), col(dt), A.reshape(1, H, P, N), B.reshape(Bt, G, 1, N), C.reshape(Bt, G, 1, N)]
    specs = [row_spec, row_spec, pl.BlockSpec((1, hb, pb, N), lambda h, p, b, *_: (0, h, p, 0)), group_spec,
             group_spec]
    for t, spec in ((D, head_spec), (z, row_spec), (dt_bias, head_spec)):
        if t is not None:
            arrays.append(col(t.reshape(1, H, P)) if spec is head_spec else col(t))
            specs.append(spec)
    arrays.append(ssm_states)
    specs.append(pl.BlockSpec((1, hb, pb, N), lambda h, p, b, slot, real: (slot[b], h, p, 0)))
    kernel = functools.partial(_state_update_kernel, has_d=D is not None, has_z=z is not None,
                               has_bias=dt_bias is not None, softplus=dt_softplus)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(H // hb, P // pb, Bt), in_specs=specs,
        out_specs=[row_spec, pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((1, hb, pb, N), ssm_states.dtype), pltpu.SemaphoreType.DMA])
    state_index = 2 + len(arrays) - 1  # operands: the two prefetched scalars, then the arrays
    y, states = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((Bt, H, P, 1), x.dtype), jax.ShapeDtypeStruct(ssm_states.shape,
                                                                                       ssm_states.dtype)],
        input_output_aliases={state_index: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="customop_selective_state_update",
    )(slots, real.astype(jnp.int32), *arrays)
    return y.reshape(Bt, H, P), states


def selective_state_update(ssm_states, x, dt, A, B, C, D=None, z=None, dt_bias=None, cache_indices=None, *,
                           dt_softplus: bool = False, null_block_id: int = 0, interpret: bool | None = None):
    """One decode token per request, from and into the cached state: ``ssm_states (slots, H, P,
    N)``, ``x, dt, z (B, H, P)``, ``A (H, P, N)``, ``B, C (B, G, N)``, ``D, dt_bias (H, P)``,
    ``cache_indices (B,)`` (Mamba-1: ``H = G = 1``; Mamba-2: per-head values expanded over P).
    Returns ``(y (B, H, P) in x's dtype, new ssm_states)``; a padding request's row is computed
    from a zero state and its slot is not written."""
    Bt, H, P = x.shape
    if B.ndim != 3 or H % B.shape[1] or A.shape != (H, P, B.shape[2]) or ssm_states.shape[1:] != A.shape:
        raise ValueError(f"customop.backends.tpu.selective_state_update: shapes x {tuple(x.shape)}, A "
                         f"{tuple(A.shape)}, B {tuple(B.shape)}, ssm_states {tuple(ssm_states.shape)} do not fit "
                         "(B, H, P), (H, P, N), (B, G, N) with G dividing H, (slots, H, P, N)")
    if cache_indices is None:
        cache_indices = jnp.arange(Bt, dtype=jnp.int32)
    return _state_update_jit(ssm_states, x, dt, A, B, C, D, z, dt_bias, cache_indices.astype(jnp.int32),
                             dt_softplus=bool(dt_softplus), null_block_id=int(null_block_id),
                             interpret=tiling.resolve_interpret(interpret))


# ---- Mamba-2 prefill: the chunked SSD scan (Pallas) -------------------------------------------------


def _ssd_kernel(req_ref, first_ref, x_ref, xt_ref, b_ref, c_ref, acol_ref, arow_ref, drow_ref, wcol_ref,
                decay_ref, *refs, has_d: bool):
    refs = list(refs)
    d_ref = refs.pop(0) if has_d else None
    init_ref, y_ref, final_ref, h_ref = refs
    c = pl.program_id(1)

    @pl.when(first_ref[c] != 0)
    def _start():  # a request's first chunk: its initial state (the cache's, or zeros)
        h_ref[...] = init_ref[0, 0].astype(f32)

    h = h_ref[...]  # (P, N): the state entering this chunk
    x = x_ref[0, 0].astype(f32)  # (L, P)
    Bm, Cm = b_ref[0, 0].astype(f32), c_ref[0, 0].astype(f32)  # (L, N)
    a_col, a_row = acol_ref[0, 0], arow_ref[0, 0]  # (L, 1), (1, L): the running sum of delta * A
    nt = (((1,), (1,)), ((), ()))  # contract the last dims: a @ b^T
    y = jnp.exp(a_col) * lax.dot_general(Cm, h, nt, precision=HIGHEST, preferred_element_type=f32)
    L = x.shape[0]
    causal = lax.broadcasted_iota(jnp.int32, (L, L), 0) >= lax.broadcasted_iota(jnp.int32, (L, L), 1)
    decay = jnp.exp(jnp.where(causal, a_col - a_row, -jnp.inf))
    scores = lax.dot_general(Cm, Bm, nt, precision=HIGHEST, preferred_element_type=f32) * decay * drow_ref[0, 0]
    y = y + jnp.dot(scores, x, precision=HIGHEST, preferred_element_type=f32)
    if has_d:
        y = y + d_ref[0] * x
    y_ref[0, 0] = y.astype(y_ref.dtype)
    # the state leaving the chunk: exp(a_last) h + x^T (B exp(a_last - a) delta)
    h = decay_ref[0, 0] * h + jnp.dot(xt_ref[0, 0].astype(f32), Bm * wcol_ref[0, 0], precision=HIGHEST,
                                      preferred_element_type=f32)
    h_ref[...] = h
    final_ref[0, 0] = h


def chunk_table(query_start_loc, n_tokens: int, chunk_size: int):
    """(start, end, request, is its request's first chunk) of ``n_tokens // chunk_size +
    requests`` chunk rows, on the device: every request cut every ``chunk_size`` tokens from its
    first one; rows past the real count are empty (start == end) and belong to the last request."""
    qsl = query_start_loc.astype(jnp.int32)
    n_req = qsl.shape[0] - 1
    lens = qsl[1:] - qsl[:-1]
    count = (lens + chunk_size - 1) // chunk_size
    last = jnp.cumsum(count)
    first = last - count
    rows = jnp.arange(n_tokens // chunk_size + n_req, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(last, rows, side="right"), 0, n_req - 1).astype(jnp.int32)
    start = qsl[seq] + (rows - first[seq]) * chunk_size
    real = rows < last[-1]
    end = jnp.where(real, jnp.minimum(start + chunk_size, qsl[seq + 1]), start)
    return start, end, seq, real & (rows == first[seq])


@functools.partial(jax.jit, static_argnames=("chunk_size", "dt_softplus", "null_block_id", "interpret"))
def _ssd_jit(x, dt, A, B, C, D, dt_bias, ssm_states, query_start_loc, cache_indices, has_initial_state, *,
             chunk_size, dt_softplus, null_block_id, interpret):
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    S, L = cache_indices.shape[0], chunk_size
    if T == 0 or S == 0:
        return jnp.zeros(x.shape, x.dtype), ssm_states
    real, slots = _requests(cache_indices, ssm_states.shape[0], null_block_id)
    from_cache = (has_initial_state != 0) & real
    initial = jnp.where(from_cache[:, None, None, None], ssm_states[slots].astype(f32), 0.0)  # (S, H, P, N)
    start, end, seq, is_first = chunk_table(query_start_loc, T, L)
    n = start.shape[0]
    # The tokens in zero-padded chunks: a padded row has delta = 0 and x = B = 0, so it changes
    # no running sum and adds to no state (as in the spec).
    index = start[:, None] + jnp.arange(L, dtype=jnp.int32)[None, :]
    index = jnp.where(index < end[:, None], index, T)  # (n, L); T: the zero row

    def chunked(t):  # (T, K, M) -> (K, n, L, M)
        padded = jnp.concatenate([t, jnp.zeros((1, *t.shape[1:]), t.dtype)])
        return jnp.moveaxis(padded[index], 2, 0)

    delta = dt.astype(f32) + (0.0 if dt_bias is None else dt_bias.astype(f32))
    delta = _softplus(delta) if dt_softplus else delta  # (T, H)
    delta = chunked(delta[..., None])[..., 0]  # (H, n, L)
    a = jnp.cumsum(delta * A.astype(f32)[:, None, None], axis=-1)
    a_last = a[..., -1:]
    xc = chunked(x)  # (H, n, L, P)
    arrays = [xc, jnp.swapaxes(xc, 2, 3), chunked(B), chunked(C), a[..., None], a[..., None, :],
              delta[..., None, :], (jnp.exp(a_last - a) * delta)[..., None], jnp.exp(a_last)[..., None]]
    hpg = H // G

    def spec(*block):
        return pl.BlockSpec((1, 1, *block), lambda h, c, *_: (h, c, 0, 0))

    group = pl.BlockSpec((1, 1, L, N), lambda h, c, *_: (_div(h, hpg), c, 0, 0))
    specs = [spec(L, P), spec(P, L), group, group, spec(L, 1), spec(1, L), spec(1, L), spec(L, 1), spec(1, 1)]
    if D is not None:
        arrays.append(D.astype(f32).reshape(H, 1, 1))
        specs.append(pl.BlockSpec((1, 1, 1), lambda h, c, *_: (h, 0, 0)))
    state = pl.BlockSpec((1, 1, P, N), lambda h, c, req, first: (req[c], h, 0, 0))
    arrays.append(initial)
    specs.append(state)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(H, n), in_specs=specs, out_specs=[spec(L, P), state],
        scratch_shapes=[pltpu.VMEM((P, N), f32)])
    y, final = pl.pallas_call(
        functools.partial(_ssd_kernel, has_d=D is not None),
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((H, n, L, P), f32), jax.ShapeDtypeStruct((S, H, P, N), f32)],
        # heads are independent; a head's chunks carry the state in order
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="customop_ssd_chunk_scan",
    )(seq, is_first.astype(jnp.int32), *arrays)
    y = jnp.moveaxis(y, 0, 2).reshape(n * L, H, P)  # chunk rows back to tokens (the zero row is dropped)
    out = jnp.zeros((T, H, P), f32).at[index.reshape(-1)].set(y, mode="drop")
    qsl = query_start_loc.astype(jnp.int32)
    return out.astype(x.dtype), _scatter_slots(ssm_states, final, slots, real & (qsl[1:] > qsl[:-1]))


def ssd_chunk_scan(x, dt, A, B, C, D, dt_bias, ssm_states, query_start_loc, cache_indices, has_initial_state, *,
                   chunk_size: int, dt_softplus: bool = True, null_block_id: int = 0,
                   interpret: bool | None = None):
    """Mamba-2's SSD scan over varlen requests, chunk by chunk: ``x (T, H, P)``, ``dt (T, H)``,
    ``A, D, dt_bias (H,)``, ``B, C (T, G, N)``, ``ssm_states (slots, H, P, N)``; request ``i``
    owns tokens ``query_start_loc[i]:query_start_loc[i + 1]`` and slot ``cache_indices[i]``.
    Returns ``(y (T, H, P) in x's dtype, new ssm_states)``."""
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"customop.backends.tpu.ssd_chunk_scan: chunk_size={chunk_size} must be a power of two")
    T, H, P = x.shape
    if B.ndim != 3 or H % B.shape[1] or ssm_states.shape[1:] != (H, P, B.shape[2]):
        raise ValueError(f"customop.backends.tpu.ssd_chunk_scan: shapes x {tuple(x.shape)}, B {tuple(B.shape)}, "
                         f"ssm_states {tuple(ssm_states.shape)} do not fit (T, H, P), (T, G, N) with G dividing H, "
                         "(slots, H, P, N)")
    return _ssd_jit(x, dt, A, B, C, D, dt_bias, ssm_states, query_start_loc, cache_indices.astype(jnp.int32),
                    has_initial_state.astype(jnp.int32), chunk_size=int(chunk_size), dt_softplus=bool(dt_softplus),
                    null_block_id=int(null_block_id), interpret=tiling.resolve_interpret(interpret))
