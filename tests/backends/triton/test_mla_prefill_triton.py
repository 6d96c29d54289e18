"""MLA prefill through the varlen attention route, under the Triton interpreter: the causal flag of
``customop::varlen_attn`` (backends/triton/attention.py: the kernel's ``CAUSAL`` mask and the
launcher) against a float64 reference written here from the formula, in fp32/bf16/fp16 with odd
segments, length-1 and empty segments, several key tiles and GQA, MLA's layout scaled down (q/k of
24 lanes, v of 16 zero-padded to 24, as DeepSeek's 192 and 128); the op's reference body; the
non-causal launcher unchanged; then the MLA layer's ``forward_kernel`` with the Triton launchers
as the CPU kernels of ``varlen_attn`` and ``mla_decode``: against the float64 layer reference
(tests/cases/mla.py) and against the spec (``forward_native``), fresh prefills packed (contiguous
and not) while a chunked prefill keeps the spec's path, decode == prefill through both kernels,
``packed_prefill`` with a value wider than q/k, and bad input."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools

import pytest
import torch

from customop.backends.triton import attention as attn
from customop.backends.triton import mla as decode_kernel
from customop.math import mla as mla_math
from customop.math.mla import MLADims
from customop.ops.mla import MultiHeadLatentAttentionWrapper
from customop.samples.mla import BATCHES, Batch, OneRequest, build_modules, init_kwargs
from customop.testing import FLOAT_DTYPES, assert_close, randn
from tests.backends.triton.conftest import as_cpu_kernel
from tests.cases.mla import reference as layer_reference
from tests.ops.test_mla import close as layer_close

pytestmark = pytest.mark.interpret

LENGTHS = (1, 7, 40, 0, 33, 1)  # odd, length 1 (first and last), empty, several 16-key tiles


def causal_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths, scale: float) -> torch.Tensor:
    """float64: per segment and head, token ``i`` attends to the segment's tokens ``0..i``; query
    head ``h`` reads key/value head ``h // (Hq // Hkv)``."""
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    start = 0
    for length in lengths:
        for i in range(length):
            t = start + i
            for h in range(q.shape[1]):
                keys, vals = k[start:t + 1, h // group].double(), v[start:t + 1, h // group].double()
                p = (keys @ q[t, h].double() * scale).softmax(0)
                out[t, h] = p @ vals
        start += length
    return out


def packed(lengths, hq, hkv, d, dtype, v_width=None, seed=0):
    """q/k of ``d`` lanes; v of ``v_width`` lanes zero-padded to ``d`` (MLA's layout) when given."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q = randn(t, hq, d, dtype=dtype, scale=2.0, generator=gen)
    k = randn(t, hkv, d, dtype=dtype, scale=2.0, generator=gen)
    v = randn(t, hkv, d, dtype=dtype, generator=gen)
    if v_width is not None:
        v[..., v_width:] = 0
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    return q, k, v, cu


KERNEL_SHAPES = [  # (hq, hkv, d, v_width)
    (4, 2, 80, None),   # GQA, a padded head tile (80 -> 128 lanes)
    (2, 2, 24, 16),     # MLA-like (the case table's P + R = 24, V = 16), v padded to 24
]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("hq,hkv,d,v_width", KERNEL_SHAPES, ids=lambda x: str(x))
def test_causal_kernel_matches_float64(hq, hkv, d, v_width, dtype, poison_empty):
    """16 x 16 tiles: a 40-token segment takes three query tiles, each stopping its key loop after
    its own last row, and key tiles partly above the diagonal."""
    q, k, v, cu = packed(LENGTHS, hq, hkv, d, dtype, v_width)
    expected = causal_ref(q, k, v, LENGTHS, 0.1)
    got = attn.triton_varlen_attention(q, k, v, cu, 40, 0.1, block_m=16, block_n=16, causal=True)
    assert_close(got, expected, dtype, what="causal kernel")
    if v_width is not None:
        assert torch.equal(got[..., v_width:], torch.zeros_like(got[..., v_width:]))  # zero v lanes stay zero
    # the launcher with the table's tiles (one key tile per segment) and max_seqlen unknown
    assert_close(attn.varlen_attn(q, k, v, cu, 0, 0.1, True), expected, dtype, what="launcher")


def test_causal_differs_from_bidirectional_and_noncausal_is_unchanged(poison_empty):
    """The flag matters (a causal result is not the bidirectional one), and ``causal=False`` is
    ``mm_encoder_attn`` bit for bit (the encoder path is untouched)."""
    q, k, v, cu = packed((5, 11), 2, 2, 64, torch.float32)
    causal = attn.varlen_attn(q, k, v, cu, 11, 0.125, True)
    plain = attn.varlen_attn(q, k, v, cu, 11, 0.125, False)
    assert torch.equal(plain, attn.mm_encoder_attn(q, k, v, cu, 11, 0.125))
    assert not torch.allclose(causal[[0, 5]], plain[[0, 5]], atol=1e-2)  # first tokens see one key, not all
    assert torch.equal(causal[[0, 5]], v[[0, 5]])  # ... and return its value
    assert torch.allclose(causal[[4, 15]], plain[[4, 15]], atol=1e-6)  # last tokens see every key


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_library_reference_body_is_causal(dtype):
    """Without a registered CPU kernel, ``torch.ops.customop.varlen_attn`` runs the spec's segment
    loop (what devices without a kernel run)."""
    q, k, v, cu = packed(LENGTHS, 4, 2, 24, dtype, 16)
    got = torch.ops.customop.varlen_attn(q, k, v, cu, 40, 0.1, True)
    assert_close(got, causal_ref(q, k, v, LENGTHS, 0.1), dtype, what="reference body")


def test_opcheck_and_compile_with_the_kernel():
    q, k, v, cu = packed((1, 7), 2, 1, 24, torch.bfloat16, 16)
    with as_cpu_kernel("varlen_attn", attn.varlen_attn) as calls:
        torch.library.opcheck(torch.ops.customop.varlen_attn.default, (q, k, v, cu, 7, 0.1, True))
        got = torch.compile(lambda *a: torch.ops.customop.varlen_attn(*a, cu, 7, 0.1, True), fullgraph=True)(q, k, v)
    assert calls, "the kernel did not run"
    assert_close(got, causal_ref(q, k, v, (1, 7), 0.1), torch.bfloat16)


def test_bad_input_names_the_op():
    q, k, v, cu = packed((4, 5), 2, 2, 24, torch.float32)
    with pytest.raises(ValueError, match=r"customop::varlen_attn: query \[T, Hq, D\] and key/value \[T, Hkv, D\]"):
        attn.varlen_attn(q, k, v[..., :16], cu, 5, 0.1, True)  # an unpadded MLA value
    with pytest.raises(ValueError, match="customop.varlen_attn: cu_seqlens ends at 9, but the sequence has 10 tokens"):
        attn.varlen_attn(torch.cat((q, q[:1])), torch.cat((k, k[:1])), torch.cat((v, v[:1])), cu, 0, 0.1, True)
    with pytest.raises(ValueError, match="customop.varlen_attn: max_seqlen=4 but a segment has 5 tokens"):
        torch.ops.customop.varlen_attn(q, k, v, cu, 4, 0.1, True)
    with pytest.raises(ValueError, match="customop::varlen_attn: cu_seqlens must be 1-D int32"):
        attn.varlen_attn(q, k, v, cu.long(), 5, 0.1, True)


# ---- the MLA layer -------------------------------------------------------------------------------


@contextlib.contextmanager
def both_kernels():
    """The Triton launchers as the CPU kernels of ``varlen_attn`` and ``mla_decode``; yields the
    two call lists."""
    with as_cpu_kernel("varlen_attn", attn.varlen_attn) as prefill, \
            as_cpu_kernel("mla_decode", decode_kernel.mla_decode) as decode:
        yield prefill, decode


#: the case table's batches, plus fresh prefills on both sides of a chunked one (packed tokens that
#: are not contiguous in the batch) after a decode
LAYER_BATCHES = BATCHES + (Batch("decode + prefill, chunked prefill, prefills of 1 and 6", ((9, 1), (0, 5), (3, 4), (0, 1), (0, 6)), 1),)


def _fresh(batch: Batch) -> int:
    return sum(1 for r, (cached, new) in enumerate(batch.requests) if r >= batch.num_decodes and cached == 0 and new)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("batch", LAYER_BATCHES, ids=lambda b: b.label)
def test_layer_prefill_through_the_varlen_route(batch, dtype, poison_empty):
    op = MultiHeadLatentAttentionWrapper(**init_kwargs(build_modules(True, dtype), True))
    positions, hidden, cache, meta = batch.build(dtype)
    expected, rows = layer_reference(op, positions, hidden, cache.clone(), meta)
    spec_cache = cache.clone()
    with torch.no_grad():  # as forward_kernel runs (the submodules pick their paths by autograd too)
        spec = op.forward_native(positions, hidden, spec_cache, meta)
    with torch.no_grad(), both_kernels() as (prefill, decode):
        got = op.forward_kernel(positions, hidden, cache, meta)
    assert len(prefill) == (1 if _fresh(batch) else 0), "one varlen call for all the fresh prefills"
    assert len(decode) == (1 if batch.num_decodes else 0)
    assert got.dtype == dtype and got.shape == hidden.shape
    layer_close(got, expected, dtype, f"{batch.label} forward_kernel vs float64")
    layer_close(got, spec.double(), dtype, f"{batch.label} forward_kernel vs the spec")
    assert torch.equal(cache.isnan(), spec_cache.isnan()) and torch.equal(cache.nan_to_num(), spec_cache.nan_to_num())


def test_fresh_prefills_never_reach_the_per_request_spec(monkeypatch):
    """Only the chunked prefill (cached context) takes the spec's per-request path."""
    seen = []
    real = mla_math.prefill_attention
    monkeypatch.setattr(mla_math, "prefill_attention", lambda q, history, *a: seen.append(history.shape[0]) or real(q, history, *a))
    batch = LAYER_BATCHES[-1]
    op = MultiHeadLatentAttentionWrapper(**init_kwargs(build_modules(False, torch.float32), False))
    positions, hidden, cache, meta = batch.build(torch.float32)
    expected, _ = layer_reference(op, positions, hidden, cache.clone(), meta)
    with torch.no_grad(), both_kernels():
        got = op.forward_kernel(positions, hidden, cache, meta)
    assert seen == [7]  # the (3 cached + 4 new) request
    assert_close(got, expected, torch.float32)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_decode_equals_prefill_through_both_kernels(dtype):
    """One 9-token sequence: prefilled at once (the varlen route), or 5 tokens prefilled (the varlen
    route) then 4 decode steps (the decode kernel), or 5 prefilled, 3 as a chunked prefill (the
    spec's path) and 1 decode."""
    seq = OneRequest(dtype)
    with torch.no_grad(), both_kernels() as (prefill, decode):
        whole = seq.step(seq.fresh(), 0, 9, decode=False)
        cache = seq.fresh()
        parts = [seq.step(cache, 0, 5, decode=False)] + [seq.step(cache, t, 1, decode=True) for t in range(5, 9)]
        cache = seq.fresh()
        chunked = [seq.step(cache, 0, 5, decode=False), seq.step(cache, 5, 3, decode=False),
                   seq.step(cache, 8, 1, decode=True)]
    assert len(prefill) == 3 and len(decode) == 5
    layer_close(torch.cat(parts).double(), whole.double(), dtype, "decode vs prefill")
    layer_close(torch.cat(chunked).double(), whole.double(), dtype, "chunked prefill vs prefill")


def test_packed_prefill_with_a_value_wider_than_q_and_k():
    """V > P + R: q and k are zero-padded instead of v; against the spec's per-request SDPA."""
    d = MLADims(num_heads=3, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=20, kv_lora_rank=10, scale=0.3)
    gen = torch.Generator().manual_seed(2)
    spans, t = [(0, 1), (1, 6), (6, 13)], 13
    q = randn(t, 3, 12, generator=gen)
    kv_c, k_pe = randn(t, 10, generator=gen), randn(t, 4, generator=gen)
    w = randn(3 * 28, 10, generator=gen, scale=10 ** -0.5)
    with both_kernels() as (prefill, _):
        got = mla_math.packed_prefill(q, kv_c, k_pe, torch.float32, spans, w, d, torch.ops.customop.varlen_attn)
    assert len(prefill) == 1 and got.shape == (t, 3, 20)
    for a, b in spans:
        want = mla_math.prefill_attention(q[a:b], torch.cat((kv_c, k_pe), -1)[a:b], w, d)
        assert_close(got[a:b], want, torch.float32, what=f"span {a}:{b}")


def test_bad_metadata_raises_the_same_error_through_forward_kernel():
    op = MultiHeadLatentAttentionWrapper(**init_kwargs(build_modules(True, torch.float32), True))
    positions, hidden, cache, meta = BATCHES[2].build(torch.float32)
    bad = dataclasses.replace(meta, seq_lens=torch.tensor([1, 4, 2]))
    for path in (op.forward_native, op.forward_kernel):
        with both_kernels() as (prefill, _), torch.no_grad(), \
                pytest.raises(ValueError, match="multi_head_latent_attention: request 2 has 13 new tokens in a context of 2"):
            path(positions, hidden, cache, bad)
        assert not prefill


# ---- compiled for the GPUs (no GPU needed) --------------------------------------------------------
# The causal variant at MLA's head dim (192 lanes in a 256-lane tile, the table's tiles for each
# dtype) for the H200 (sm_90: no spills) and MI300, in a subprocess without the interpreter.


def _aot_cases():
    from customop.backends.triton import attention as kernels

    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16"), (torch.float32, "fp32")):
        bm, bn, warps, _ = kernels._config(dtype, 256, "cuda", causal=True)
        ptr = "*" + name
        yield (f"causal {name} d192", kernels._varlen_attention_kernel,
               {"Q": ptr, "K": ptr, "V": ptr, "O": ptr, "CU": "*i32", "qk_scale": "fp32"},
               {"GROUP": 1, "HEAD_DIM": 192, "BLOCK_D": 256, "BLOCK_M": bm, "BLOCK_N": bn,
                "PRECISION": "ieee" if dtype == torch.float32 else "tf32", "UPCAST": False, "CAUSAL": True}, warps)


@pytest.mark.parametrize("target", ["cuda:90", "hip:gfx942"])
def test_causal_kernel_compiles_for_the_gpus(target):
    from tests.backends.triton.aot_subprocess import assert_compiles_for

    assert_compiles_for("tests.backends.triton.test_mla_prefill_triton", target, 3)


if __name__ == "__main__":
    from tests.backends.triton.aot_subprocess import main

    main(_aot_cases())
