"""The state-space family on TPUs (``backends/tpu/mamba.py``, ``xla_mamba.py``), in emulation only:

- main tier (jax): the Pallas kernels (decode state update, chunked SSD scan) in interpret mode,
  and the plain-JAX conv and Mamba-1 scan, against the float64 references of
  ``tests/cases/mamba.py`` (outputs, and every cache slot afterwards: the requests' slots
  updated, padding's, the null slot and the spare untouched), plus their TPU (Mosaic) lowering;
- tpu tier (``bash .ci/tpu.sh``, ``@pytest.mark.xla``): the ``xla`` kernels of the ``customop::``
  ops on the XLA CPU device against the ops' reference bodies on CPU, the fp64 exception, and
  ``MambaMixer`` / ``MambaMixer2`` / ``ShortConv`` built for the TPU platform end to end.

No TPU ran any of this. Shapes are small: interpret mode runs one grid step at a time, and XLA
compiles each kernel shape in seconds (the SSD kernel's took 7.5 s on a busy 2-core machine), so
the extra shapes are marked ``slow``.
"""

from __future__ import annotations

import functools
import importlib.util

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import export as jax_export  # noqa: E402

from customop.backends.tpu import mamba  # noqa: E402
from customop.samples.mamba import Batch  # noqa: E402
from customop.testing import assert_close  # noqa: E402
from tests.cases.mamba import ref_conv, ref_scan, rounded, silu, softplus  # noqa: E402

DTYPES = {"fp32": (jnp.float32, torch.float32), "bf16": (jnp.bfloat16, torch.bfloat16)}
TORCH_OF = {jnp.dtype(j): t for j, t in DTYPES.values()}


def rand(gen, *shape, scale=1.0):
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


def to_jax(t, dtype=jnp.float32):
    return None if t is None else jnp.asarray(t.double().numpy(), dtype)


def to_torch(a) -> torch.Tensor:
    return torch.from_numpy(np.asarray(jnp.asarray(a, jnp.float32), np.float64))


def stored(t: torch.Tensor, dtype) -> torch.Tensor:
    """A float64 tensor as the kernel sees it in ``dtype`` (a JAX dtype), back in float64."""
    return rounded(t, TORCH_OF[jnp.dtype(dtype)])


def prefill_args(batch: Batch):
    """``(query_start_loc, cache_indices, has_initial_state)`` of a prefill-only batch."""
    _, slots = batch.slots()
    qsl = np.cumsum([0, *batch.prefill_lens])
    return (jnp.asarray(qsl, jnp.int32), jnp.asarray(slots, jnp.int32),
            jnp.asarray(batch.has_initial_state, jnp.bool_))


def check_cache(got, want: torch.Tensor, before: torch.Tensor, written: set[int], dtype, what: str) -> None:
    """Written slots within the cache dtype's tolerance (relative to the scale); every other slot
    bit for bit as it was."""
    got = to_torch(got)
    for slot in range(want.shape[0]):
        if slot in written:
            atol = 2e-2 if dtype == jnp.bfloat16 else 2e-5
            assert_close(got[slot], want[slot], TORCH_OF[jnp.dtype(dtype)], atol=atol, what=f"{what}: slot {slot}")
        else:
            assert torch.equal(got[slot], before[slot]), f"{what}: slot {slot} was written"


def check_out(got, want: torch.Tensor, dtype, what: str = "output") -> None:
    scale = max(1.0, float(want.abs().max()))
    tdt = TORCH_OF[jnp.dtype(dtype)]
    atol, rtol = (1.6e-2, 3e-2) if tdt == torch.bfloat16 else (2e-5, 2e-5)
    assert jnp.asarray(got).dtype == dtype, f"{what}: dtype {got.dtype}"
    assert not np.isnan(np.asarray(jnp.asarray(got, jnp.float32))).any(), f"{what}: NaN"
    assert_close(to_torch(got), want, tdt, atol=atol * scale, rtol=rtol, what=what)


# ---- causal conv1d (plain JAX) ------------------------------------------------------------------


PREFILL = Batch("prefill", prefill_lens=(1, 2, 7, 0, 9), has_initial_state=(False, True, False, True, True),
                chunk_size=8)
DECODE = Batch("decode", decodes=3, pad_decodes=2)


@pytest.mark.parametrize("K,bias,act,dtype", [(4, True, True, "bf16"), (2, False, False, "fp32"),
                                               (3, True, False, "fp32")])
def test_causal_conv1d_fn(K, bias, act, dtype):
    jd, _ = DTYPES[dtype]
    gen = torch.Generator().manual_seed(K)
    T, C = sum(PREFILL.prefill_lens), 19
    x, w, b = rand(gen, T, C), rand(gen, C, K, scale=0.5), rand(gen, C, scale=0.2) if bias else None
    cache = stored(rand(gen, PREFILL.n_slots, K, C), jd)  # (slots, width = K - 1 + 1, C): vLLM's layout
    want_cache = cache.clone()
    want = ref_conv(stored(stored(x, jd), jd), stored(w, jd), None if b is None else stored(b, jd), want_cache,
                    PREFILL, act)
    out, new = mamba.causal_conv1d_fn(to_jax(x, jd), to_jax(w, jd), to_jax(b, jd),
                                      jnp.swapaxes(to_jax(cache, jd), 1, 2), *prefill_args(PREFILL), silu=act,
                                      null_block_id=0)
    check_out(out, want, jd)
    written = {s for s, n in zip(PREFILL.slots()[1], PREFILL.prefill_lens) if n}
    check_cache(jnp.swapaxes(new, 1, 2), want_cache, cache, written, jd, "conv cache")


@pytest.mark.parametrize("pad_slot", [0, -1], ids=["null-block", "PAD_SLOT_ID"])
def test_causal_conv1d_update(pad_slot):
    gen = torch.Generator().manual_seed(3)
    K, C = 4, 24
    decode_slots, _ = DECODE.slots()
    x, w = rand(gen, len(decode_slots), C), rand(gen, C, K, scale=0.5)
    cache = rand(gen, DECODE.n_slots, K - 1, C).float().double()
    want_cache = cache.clone()
    want = ref_conv(stored(x, jnp.float32), w, None, want_cache, DECODE, True)
    slots = jnp.asarray([s if s else pad_slot for s in decode_slots], jnp.int32)
    out, new = mamba.causal_conv1d_update(to_jax(x), jnp.swapaxes(to_jax(cache), 1, 2), to_jax(w), None, slots,
                                          silu=True)
    check_out(out, want, jnp.float32)
    check_cache(jnp.swapaxes(new, 1, 2), want_cache, cache, set(decode_slots[:DECODE.decodes]), jnp.float32,
                "conv cache")


# ---- the scans -------------------------------------------------------------------------------------


def scan_inputs(gen, T, H, P, N, G, slots_n):
    """x, dt (per head), A (per head, negative), B, C, D, dt_bias, z, state cache (float64)."""
    return dict(x=rand(gen, T, H, P), dt=rand(gen, T, H, scale=0.5), A=-(0.5 + 3.5 * torch.rand(H, generator=gen,
                                                                                                 dtype=torch.float64)),
                B=rand(gen, T, G, N), C=rand(gen, T, G, N), D=1 + 0.3 * rand(gen, H), bias=rand(gen, H, scale=0.5),
                z=rand(gen, T, H, P), cache=rand(gen, slots_n, H, P, N, scale=0.5))


def per_head(t: torch.Tensor, H: int) -> torch.Tensor:
    """(T, G, N) -> (T, H, N): head h reads group h // (H / G)."""
    return t.repeat_interleave(H // t.shape[1], dim=1)


def ref_mamba2(v, batch, H, P, N, jd, sd, with_z=False):
    """The float64 expectation of Mamba-2's scan from ``v`` as stored in ``jd`` (x) / ``sd`` (state)."""
    x, B, C, z = (stored(v[k], jd) for k in ("x", "B", "C", "z"))
    dt, D, bias = (stored(v[k], jd) for k in ("dt", "D", "bias"))
    cache = stored(v["cache"], sd)
    want_cache = cache.clone()
    delta = softplus(dt + bias)[..., None].expand(-1, -1, P)
    A = v["A"].float().double()[:, None, None].expand(H, P, N)
    y = ref_scan(x, delta, A, per_head(B, H), per_head(C, H), want_cache, batch) + D[:, None] * x
    if with_z:
        y = y * silu(z)
    return y, cache, want_cache


@pytest.mark.parametrize("chunk,dtype,sdtype", [(4, "fp32", "fp32"), pytest.param(8, "bf16", "bf16",
                                                                                   marks=pytest.mark.slow)],
                         ids=["chunk4-fp32", "chunk8-bf16-bf16-state"])
def test_ssd_chunk_scan(chunk, dtype, sdtype):
    """Lengths 1, 2, 7, 0, 9 against chunks of 4 and 8 (chunk - 1, chunk + 1, several chunks, an
    empty request), 2 groups of 3 heads, some requests from the cache."""
    jd, sd = DTYPES[dtype][0], DTYPES[sdtype][0]
    H, P, N, G = 6, 8, 16, 2
    gen = torch.Generator().manual_seed(chunk)
    v = scan_inputs(gen, sum(PREFILL.prefill_lens), H, P, N, G, PREFILL.n_slots)
    want, cache, want_cache = ref_mamba2(v, PREFILL, H, P, N, jd, sd)
    y, new = mamba.ssd_chunk_scan(to_jax(v["x"], jd), to_jax(v["dt"], jd), to_jax(v["A"]), to_jax(v["B"], jd),
                                  to_jax(v["C"], jd), to_jax(v["D"], jd), to_jax(v["bias"], jd), to_jax(cache, sd),
                                  *prefill_args(PREFILL), chunk_size=chunk, interpret=True)
    check_out(y, want, jd)
    written = {s for s, n in zip(PREFILL.slots()[1], PREFILL.prefill_lens) if n}
    check_cache(new, want_cache, cache, written, sd, "ssm cache")


@pytest.mark.slow  # interpret mode: an XLA compile of several seconds per kernel shape
def test_ssd_padding_request_and_one_chunk_per_token():
    """A padding request (PAD_SLOT_ID) is computed from zeros and writes nothing; chunk 1 (every
    token its own chunk) equals the recurrence; no D, no dt_bias, no softplus."""
    from customop.math import mamba as spec

    H, P, N, G = 4, 8, 8, 1
    gen = torch.Generator().manual_seed(7)
    lens = [3, 2, 4]
    v = scan_inputs(gen, sum(lens), H, P, N, G, 4)
    v["cache"] = v["cache"].float().double()
    qsl, slots, init = torch.tensor([0, 3, 5, 9]), torch.tensor([2, -1, 1]), torch.tensor([True, True, True])
    want_cache = v["cache"].clone()
    want = spec.ssd_recurrent(v["x"], v["dt"].abs(), v["A"], v["B"], v["C"], None, None, want_cache, qsl, slots, init,
                              dt_softplus=False)
    y, new = mamba.ssd_chunk_scan(to_jax(v["x"]), to_jax(v["dt"].abs()), to_jax(v["A"]), to_jax(v["B"]),
                                  to_jax(v["C"]), None, None, to_jax(v["cache"]), jnp.asarray(qsl.numpy(), jnp.int32),
                                  jnp.asarray(slots.numpy(), jnp.int32), jnp.asarray(init.numpy()), chunk_size=1,
                                  dt_softplus=False, interpret=True)
    check_out(y, want, jnp.float32)
    check_cache(new, want_cache, v["cache"], {1, 2}, jnp.float32, "ssm cache")


@pytest.mark.parametrize("dtype,sdtype", [("fp32", "fp32"), ("bf16", "bf16")], ids=["fp32", "bf16-bf16-state"])
def test_state_update_mamba2(dtype, sdtype):
    """Mamba-2's decode form (per-head dt, A, D, dt_bias expanded over P), 3 groups of 2 heads,
    z given; two padding rows (the null block and PAD_SLOT_ID)."""
    jd, sd = DTYPES[dtype][0], DTYPES[sdtype][0]
    H, P, N, G = 6, 8, 16, 3
    gen = torch.Generator().manual_seed(11)
    decode_slots, _ = DECODE.slots()
    v = scan_inputs(gen, len(decode_slots), H, P, N, G, DECODE.n_slots)
    want, cache, want_cache = ref_mamba2(v, DECODE, H, P, N, jd, sd, with_z=True)
    slots = jnp.asarray([s if s or i % 2 else -1 for i, s in enumerate(decode_slots)], jnp.int32)
    expand = lambda t: t[..., None].expand(*t.shape, P)  # noqa: E731
    y, new = mamba.selective_state_update(
        to_jax(cache, sd), to_jax(v["x"], jd), to_jax(expand(v["dt"]), jd),
        to_jax(v["A"][:, None, None].expand(H, P, N)),
        to_jax(v["B"], jd), to_jax(v["C"], jd), to_jax(expand(v["D"]), jd), to_jax(v["z"], jd),
        to_jax(expand(v["bias"]), jd), slots, dt_softplus=True, interpret=True)
    check_out(y, want, jd)
    check_cache(new, want_cache, cache, set(decode_slots[:DECODE.decodes]), sd, "ssm cache")


@pytest.mark.parametrize("dtype", ["bf16"])
def test_state_update_mamba1(dtype):
    """Mamba-1's decode form: one head of D = 24 rows, A per (row, state), D, dt_bias per row,
    z given; N = 8 (fewer than 128 lanes: the block's last dim is the whole state)."""
    jd = DTYPES[dtype][0]
    Dm, N = 24, 8
    gen = torch.Generator().manual_seed(5)
    decode_slots, _ = DECODE.slots()
    Bt = len(decode_slots)
    x, dt, z = (stored(rand(gen, Bt, 1, Dm), jd) for _ in range(3))
    A = -(0.5 + 3.5 * torch.rand(1, Dm, N, generator=gen, dtype=torch.float64))
    B, C = stored(rand(gen, Bt, 1, N), jd), stored(rand(gen, Bt, 1, N), jd)
    D, bias = stored(1 + 0.3 * rand(gen, 1, Dm), jd), stored(rand(gen, 1, Dm, scale=0.5), jd)
    cache = rand(gen, DECODE.n_slots, 1, Dm, N, scale=0.5).float().double()
    want_cache = cache.clone()
    y = ref_scan(x, softplus(dt + bias), A.float().double(), B, C, want_cache, DECODE)
    want = (y + D * x) * silu(z)
    y, new = mamba.selective_state_update(to_jax(cache), to_jax(x, jd), to_jax(dt, jd), to_jax(A), to_jax(B, jd),
                                          to_jax(C, jd), to_jax(D, jd), to_jax(z, jd), to_jax(bias, jd),
                                          jnp.asarray(decode_slots, jnp.int32), dt_softplus=True, interpret=True)
    check_out(y, want, jd)
    check_cache(new, want_cache, cache, set(decode_slots[:DECODE.decodes]), jnp.float32, "ssm cache")


@pytest.mark.slow  # interpret mode: an XLA compile of several seconds per kernel shape
def test_state_update_several_blocks(monkeypatch):
    """Several head blocks and row blocks per request (a small VMEM budget forces them): each block
    writes its own part of the slot."""
    from customop.backends.tpu import tiling

    monkeypatch.setattr(tiling, "VMEM_BLOCK_BUDGET", 16 * 9 * 1024)
    assert mamba._decode_blocks(4, 32, 16, 4) == (1, 16)
    H, P, N, G = 4, 32, 16, 1
    gen = torch.Generator().manual_seed(2)
    decode_slots, _ = DECODE.slots()
    v = scan_inputs(gen, len(decode_slots), H, P, N, G, DECODE.n_slots)
    want, cache, want_cache = ref_mamba2(v, DECODE, H, P, N, jnp.float32, jnp.float32)
    expand = lambda t: t[..., None].expand(*t.shape, P)  # noqa: E731
    jax.clear_caches()  # the block choice is made at trace time
    y, new = mamba.selective_state_update(
        to_jax(cache), to_jax(v["x"]), to_jax(expand(v["dt"])), to_jax(v["A"][:, None, None].expand(H, P, N)),
        to_jax(v["B"]), to_jax(v["C"]), to_jax(expand(v["D"])), None, to_jax(expand(v["bias"])),
        jnp.asarray(decode_slots, jnp.int32), dt_softplus=True, interpret=True)
    jax.clear_caches()
    check_out(y, want, jnp.float32)
    check_cache(new, want_cache, cache, set(decode_slots[:DECODE.decodes]), jnp.float32, "ssm cache")


@pytest.mark.parametrize("dtype", DTYPES)
def test_selective_scan_mamba1(dtype):
    """Mamba-1 prefill (plain JAX, ``lax.scan``): one head of 16 rows, the prefill batch."""
    jd = DTYPES[dtype][0]
    Dm, N = 16, 8
    gen = torch.Generator().manual_seed(9)
    T = sum(PREFILL.prefill_lens)
    x, dt, z = (stored(rand(gen, T, 1, Dm), jd) for _ in range(3))
    A = -(0.5 + 3.5 * torch.rand(1, Dm, N, generator=gen, dtype=torch.float64))
    B, C = stored(rand(gen, T, 1, N), jd), stored(rand(gen, T, 1, N), jd)
    D, bias = stored(1 + 0.3 * rand(gen, 1, Dm), jd), stored(rand(gen, 1, Dm, scale=0.5), jd)
    cache = rand(gen, PREFILL.n_slots, 1, Dm, N, scale=0.5).float().double()
    want_cache = cache.clone()
    want = (ref_scan(x, softplus(dt + bias), A.float().double(), B, C, want_cache, PREFILL) + D * x) * silu(z)
    y, new = mamba.selective_scan(to_jax(x, jd), to_jax(dt, jd), to_jax(A), to_jax(B, jd), to_jax(C, jd),
                                  to_jax(D, jd), to_jax(z, jd), to_jax(bias, jd), to_jax(cache),
                                  *prefill_args(PREFILL), dt_softplus=True)
    check_out(y, want, jd)
    written = {s for s, n in zip(PREFILL.slots()[1], PREFILL.prefill_lens) if n}
    check_cache(new, want_cache, cache, written, jnp.float32, "ssm cache")


def test_bad_arguments_name_the_kernel():
    x = jnp.ones((3, 4, 8))
    with pytest.raises(ValueError, match="ssd_chunk_scan: chunk_size=6"):
        mamba.ssd_chunk_scan(x, jnp.ones((3, 4)), jnp.ones(4), jnp.ones((3, 1, 8)), jnp.ones((3, 1, 8)), None, None,
                             jnp.ones((2, 4, 8, 8)), jnp.array([0, 3]), jnp.array([1]), jnp.array([True]), chunk_size=6)
    with pytest.raises(ValueError, match="selective_state_update: shapes"):
        mamba.selective_state_update(jnp.ones((2, 4, 8, 8)), x, x, jnp.ones((4, 8, 8)), jnp.ones((3, 3, 8)),
                                     jnp.ones((3, 3, 8)))


# ---- TPU lowering (Mosaic), no TPU needed ------------------------------------------------------------


def S(shape, dtype=jnp.float32):  # noqa: N802
    return jax.ShapeDtypeStruct(shape, dtype)


bf16, i32 = jnp.bfloat16, jnp.int32
LOWERING = {
    # Mamba-2 2.7B's decode layer per rank (80 heads x 64, N = 128, one group), bf16 activations
    "state_update-mamba2-2.7b": (
        lambda s, x, dt, A, B, C, D, z, b, i, **kw: mamba.selective_state_update(s, x, dt, A, B, C, D, z, b, i,
                                                                                 dt_softplus=True, **kw),
        (S((9, 80, 64, 128)), S((8, 80, 64), bf16), S((8, 80, 64), bf16), S((80, 64, 128)), S((8, 1, 128), bf16),
         S((8, 1, 128), bf16), S((80, 64), bf16), S((8, 80, 64), bf16), S((80, 64), bf16), S((8,), i32))),
    # Nemotron-H-like: 8 groups, bf16 state, no z
    "state_update-8-groups-bf16-state": (
        lambda s, x, dt, A, B, C, **kw: mamba.selective_state_update(s, x, dt, A, B, C, **kw),
        (S((5, 128, 64, 128), bf16), S((4, 128, 64), bf16), S((4, 128, 64), bf16), S((128, 64, 128)),
         S((4, 8, 128), bf16), S((4, 8, 128), bf16))),
    # Mamba-1 (Jamba's 8192 rows, N = 16): row blocks
    "state_update-mamba1": (
        lambda s, x, dt, A, B, C, D, z, b, **kw: mamba.selective_state_update(s, x, dt, A, B, C, D, z, b, **kw),
        (S((3, 1, 8192, 16)), S((2, 1, 8192), bf16), S((2, 1, 8192), bf16), S((1, 8192, 16)), S((2, 1, 16), bf16),
         S((2, 1, 16), bf16), S((1, 8192)), S((2, 1, 8192), bf16), S((1, 8192)))),
    "ssd-chunk-256-2-groups": (
        lambda x, dt, A, B, C, D, b, s, q, i, h, **kw: mamba.ssd_chunk_scan(x, dt, A, B, C, D, b, s, q, i, h,
                                                                             chunk_size=256, **kw),
        (S((600, 8, 64), bf16), S((600, 8), bf16), S((8,)), S((600, 2, 128), bf16), S((600, 2, 128), bf16), S((8,)),
         S((8,)), S((4, 8, 64, 128)), S((4,), i32), S((3,), i32), S((3,), jnp.bool_))),
    "ssd-chunk-8-odd-dims": (
        lambda x, dt, A, B, C, s, q, i, h, **kw: mamba.ssd_chunk_scan(x, dt, A, B, C, None, None, s, q, i, h,
                                                                       chunk_size=8, dt_softplus=False, **kw),
        (S((13, 3, 16)), S((13, 3)), S((3,)), S((13, 3, 8)), S((13, 3, 8)), S((4, 3, 16, 8)), S((3,), i32),
         S((2,), i32), S((2,), jnp.bool_))),
}


@pytest.mark.parametrize("name", LOWERING)
def test_lowers_to_mosaic(name):
    fn, args = LOWERING[name]
    exported = jax_export.export(jax.jit(functools.partial(fn, interpret=False)), platforms=["tpu"])(*args)
    assert "tpu_custom_call" in exported.mlir_module(), f"{name}: no Mosaic call in the TPU lowering"


@pytest.mark.tpu_hw
def test_runs_on_a_real_tpu():
    """Compiled by Mosaic and run against interpret mode, on a TPU only (never run so far: no TPU
    was available). The first TPU run should also time them."""
    if jax.default_backend() != "tpu":
        pytest.skip("needs a real TPU")
    gen = torch.Generator().manual_seed(0)
    H, P, N, G = 8, 64, 128, 1
    v = scan_inputs(gen, 300, H, P, N, G, 6)
    expand = lambda t: t[..., None].expand(*t.shape, P)  # noqa: E731
    slots = jnp.asarray([3, 0, 5, -1], jnp.int32)
    decode = [to_jax(a) for a in (v["cache"], v["x"][:4], expand(v["dt"][:4]), v["A"][:, None, None].expand(H, P, N),
                                  v["B"][:4], v["C"][:4], expand(v["D"]), v["z"][:4], expand(v["bias"]))]
    prefill = [to_jax(a) for a in (v["x"], v["dt"], v["A"], v["B"], v["C"], v["D"], v["bias"], v["cache"])]
    meta = (jnp.asarray([0, 100, 300], jnp.int32), jnp.asarray([2, 4], jnp.int32), jnp.asarray([True, False]))
    for interpret in (False, True):
        got = (mamba.selective_state_update(*decode, slots, dt_softplus=True, interpret=interpret),
               mamba.ssd_chunk_scan(*prefill, *meta, chunk_size=64, interpret=interpret))
        if not interpret:
            on_tpu = got
    for a, b in zip(jax.tree_util.tree_leaves(on_tpu), jax.tree_util.tree_leaves(got)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


# ---- torch_xla: the xla kernels and the op classes (tpu tier) -----------------------------------------

needs_xla = pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None or
                               importlib.util.find_spec("torchax") is None,
                               reason="torch_xla and torchax: the tpu tier (bash .ci/tpu.sh)")


@pytest.fixture(scope="module")
def dev():
    import torch_xla

    return torch_xla.device()


@pytest.fixture
def calls(monkeypatch):
    """The JAX functions (``_jax``, under ``_pallas`` too) and specs (``_spec``) the kernels ran."""
    from customop.backends.tpu import xla_kernels

    seen: list[str] = []
    jax_call, spec_call = xla_kernels._jax, xla_kernels._spec

    def counted_jax(fn, *args, **statics):
        seen.append(fn.__name__)
        return jax_call(fn, *args, **statics)

    def counted_spec(fn, *args):
        seen.append("spec:" + fn.__name__)
        return spec_call(fn, *args)

    monkeypatch.setattr(xla_kernels, "_jax", counted_jax)
    monkeypatch.setattr(xla_kernels, "_spec", counted_spec)
    return seen


def _op_cases(dtype):
    """name -> (op, args, the JAX function its xla kernel must run); float32 caches."""
    from customop.math import mamba as spec

    gen = torch.Generator().manual_seed(0)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    qsl = torch.tensor([0, 3, 3, 9], dtype=torch.int32)
    slots, init = torch.tensor([2, 1, -1]), torch.tensor([True, False, True])
    conv = torch.randn(4, 5, 24, generator=gen).transpose(1, 2)  # (slots, C, width): vLLM's cache, transposed
    H, P, N = 4, 8, 16
    A1 = -(0.5 + torch.rand(H, P, N, generator=gen))
    dt4, A4, D4, b4 = spec.ssd_head_form(r(3, H, scale=0.5), -(0.5 + torch.rand(H, generator=gen)), r(H), r(H), P, N)
    return {
        "conv": ("causal_conv1d_fn", (r(9, 24), r(24, 4), r(24), conv, qsl, slots, init, True, 0), "causal_conv1d_fn"),
        "conv-update": ("causal_conv1d_update", (r(3, 24), conv, r(24, 4), None, torch.tensor([3, 0, 1]), False, 0),
                        "causal_conv1d_update"),
        "selective_scan": ("selective_scan", (r(9, H, P), r(9, H, P, scale=0.5), A1, r(9, 1, N), r(9, 1, N), r(H, P),
                                              r(9, H, P), r(H, P), torch.randn(4, H, P, N, generator=gen), qsl, slots,
                                              init, True, 0), "selective_scan"),
        "state_update": ("selective_state_update", (torch.randn(4, H, P, N, generator=gen), r(3, H, P), dt4, A4,
                                                    r(3, 2, N), r(3, 2, N), D4, r(3, H, P), b4,
                                                    torch.tensor([1, -1, 3]), True, 0), "selective_state_update"),
        "ssd": ("ssd_chunk_scan", (r(9, H, P), r(9, H, scale=0.5), -(0.5 + torch.rand(H, generator=gen)), r(9, 2, N),
                                   r(9, 2, N), r(H), r(H), torch.randn(4, H, P, N, generator=gen), qsl, slots, init, 4,
                                   True, 0), "ssd_chunk_scan"),
    }


def _run_both(name, args, dev):
    """``customop::<name>`` on CPU clones (the reference body) and on XLA copies: (xla, cpu), each
    (output, written cache) as CPU tensors."""
    op = getattr(torch.ops.customop, name).default
    cache = next(i for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write)
    results = []
    for device in (dev, "cpu"):
        call = [a.clone().to(device) if isinstance(a, torch.Tensor) else a for a in args]
        out = op(*call)
        results.append((out.cpu(), call[cache].cpu()))
    return results


@needs_xla
@pytest.mark.xla
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(_op_cases(torch.float32)))
def test_xla_kernel_vs_reference(case, dtype, dev, calls, poison_empty):
    name, args, jax_fn = _op_cases(dtype)[case]
    (out, cache), (want, want_cache) = _run_both(name, args, dev)
    assert out.dtype == dtype and not out.isnan().any()
    assert_close(out, want, dtype, atol=2e-2 if dtype == torch.bfloat16 else 2e-5, what=f"{case} output")
    assert_close(cache, want_cache, dtype, atol=2e-2 if dtype == torch.bfloat16 else 2e-5, what=f"{case} cache")
    assert jax_fn in calls, f"{case}: the xla kernel did not run {jax_fn} (ran {calls})"


@needs_xla
@pytest.mark.xla
@pytest.mark.parametrize("case", ["conv", "state_update", "ssd"])
def test_xla_fp64_runs_the_spec(case, dev, calls, monkeypatch):
    """The per-argument exception: float64 inputs run the spec (on CPU copies: see
    ``xla_mamba._reference``) and the results land on the XLA device."""
    from customop.backends.tpu import xla_mamba

    reference = xla_mamba._reference
    monkeypatch.setattr(xla_mamba, "_reference",
                        lambda fn, *a: calls.append("spec:" + fn.__name__) or reference(fn, *a))
    name, args, _ = _op_cases(torch.float32)[case]
    args = tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    (out, cache), (want, want_cache) = _run_both(name, args, dev)
    assert_close((out, cache), (want, want_cache), torch.float64, atol=1e-9, rtol=1e-9, what=case)
    assert calls and all(c.startswith("spec:") for c in calls)


@needs_xla
@pytest.mark.xla
def test_xla_gated_norm_runs_its_reference(dev, calls):
    """``mixer2_gated_rms_norm`` has no xla kernel: its reference body runs on the XLA device
    (no CPU fallback) and gives the CPU's values."""
    import torch_xla.debug.metrics as xla_metrics

    assert not torch._C._dispatch_has_kernel_for_dispatch_key("customop::mixer2_gated_rms_norm", "XLA")
    gen = torch.Generator().manual_seed(1)
    x, gate, w = (torch.randn(*s, generator=gen) for s in ((7, 96), (7, 96), (96,)))
    import torch_xla

    xla_metrics.clear_all()
    out = torch.ops.customop.mixer2_gated_rms_norm(x.to(dev), gate.to(dev), w.to(dev), 1e-5, 24)
    assert "gather" not in torch_xla._XLAC._get_xla_tensors_hlo([out])
    assert not xla_metrics.executed_fallback_ops() and calls == []
    assert_close(out.cpu(), torch.ops.customop.mixer2_gated_rms_norm(x, gate, w, 1e-5, 24), torch.float32)


def _mixer_params():
    """Every layer once, every batch kind (decode, prefill, mixed with padding) and both dtypes
    at least once: the tier must stay fast (each layer is a few XLA graphs)."""
    from customop.samples.mamba import BATCHES, BY_LABEL

    decode, prefill, mixed = BATCHES["small"]
    picks = [("mamba_mixer", mixed, torch.float32), ("mamba_mixer2", mixed, torch.bfloat16),
             ("mamba_mixer2[no norm, no conv bias, x-dtype state]", prefill, torch.float32),
             ("short_conv", decode, torch.bfloat16)]
    return [pytest.param(BY_LABEL[label], batch, dtype, id=f"{label}-{batch.label}-{str(dtype)[6:]}")
            for label, batch, dtype in picks]


@needs_xla
@pytest.mark.xla
@pytest.mark.parametrize("case,batch,dtype", _mixer_params())
def test_op_classes_end_to_end(case, batch, dtype, dev, calls):
    """The mixers built for the TPU platform (``forward_tpu``: the ``customop::`` ops on XLA
    tensors) against the float64 reference: outputs and every cache slot afterwards."""
    import customop
    from customop.testing import forced_platform
    from tests.cases.mamba import assert_matches, reference

    with forced_platform("tpu"), customop.use_config(customop.Config(custom_ops=["all"])):
        op = case.build("small", dtype, torch.Generator().manual_seed(0))
    assert op.forward_method_name == "forward_tpu"
    h, *caches, meta = case.inputs(op, batch, dtype, torch.Generator().manual_seed(1))
    expected = reference(case, op, batch, h, *caches)
    op = op.to(dev)
    xla_caches = [c.to(dev) for c in caches]
    meta_xla = batch.metadata(dev)
    with torch.no_grad():
        out = op(h.to(dev), *xla_caches, meta_xla)
    assert_matches((out.cpu(), *(c.cpu() for c in xla_caches)), expected, dtype, what=f"{case.label} {batch.label}")
    scans = {"mamba_mixer": ("selective_scan", "selective_state_update"),
             "mamba_mixer2": ("ssd_chunk_scan", "selective_state_update")}.get(case.op)
    wanted = set()
    if batch.decodes:
        wanted |= {"causal_conv1d_update", *(scans[1:] if scans else ())}
    if batch.prefill_lens:
        wanted |= {"causal_conv1d_fn", *(scans[:1] if scans else ())}
    assert wanted <= set(calls), f"expected {sorted(wanted)}, ran {calls}"


@needs_xla
@pytest.mark.xla
def test_xla_openxla_fullgraph_compile(dev, calls):
    """The decode conv, the state update and the chunked prefill in one openxla graph (the cache
    writes become auto_functionalized nodes): same outputs and caches as the ops' reference
    bodies on CPU."""
    cases = _op_cases(torch.float32)
    names = ("conv-update", "state_update", "ssd")

    def step(conv_args, update_args, ssd_args):
        ops = torch.ops.customop
        return (ops.causal_conv1d_update(*conv_args), ops.selective_state_update(*update_args),
                ops.ssd_chunk_scan(*ssd_args))

    def copies(device):
        return [[a.clone().to(device) if isinstance(a, torch.Tensor) else a for a in cases[n][1]] for n in names]

    want_args, got_args = copies("cpu"), copies(dev)
    want = step(*want_args)
    got = torch.compile(step, backend="openxla", fullgraph=True)(*got_args)
    for g, w, name in zip(got, want, names):
        assert_close(g.cpu(), w, torch.float32, what=name)
    for g_args, w_args, name, cache in zip(got_args, want_args, names, (1, 0, 7)):
        assert_close(g_args[cache].cpu(), w_args[cache], torch.float32, what=f"{name} cache")
    assert {"causal_conv1d_update", "selective_state_update", "ssd_chunk_scan"} <= set(calls)


@needs_xla
@pytest.mark.xla
@pytest.mark.parametrize("case", ["conv", "selective_scan", "state_update", "ssd"])
def test_xla_opcheck(case, dev):
    """Schema (the written caches included), fake and AOT dispatch on XLA tensors."""
    name, args, _ = _op_cases(torch.float32)[case]
    args = tuple(a.to(dev) if isinstance(a, torch.Tensor) else a for a in args)
    torch.library.opcheck(getattr(torch.ops.customop, name).default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
