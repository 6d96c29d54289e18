"""Encoder attention on the GPU (``customop::mm_encoder_attn``): the real-size packings of the table
(``customop/samples/attention.py``: 16384 tokens in 4 / 16 / 64 segments, 1024 and 4096 tokens,
an uneven mix, rows without ``cu_seqlens``) with ViT head layouts (``REAL_CASES``) and every
small case, through ``forward_kernel`` and through each implementation the launcher chooses
between (torch's varlen flash attention, the Triton kernel), against float64 references computed
on the device; the routing; CUDA-graph capture and replay; strided qkv views; conformance."""

from __future__ import annotations

import pytest
import torch

from customop.samples.attention import CASES, DTYPES, REAL_CASES, SIZES, Packing
from tests.gpu.conftest import assert_close_on_device

pytestmark = pytest.mark.cuda

#: fp16 and fp32 (covered by the interpreter tier too) on fewer packings: the 16-segment one and
#: the uneven mix
FEWER = (SIZES["real"][1], SIZES["real"][5])
#: fp32 outputs sum up to 4096 keys' terms in fp32, in 32-key tiles rescaled by exp2: measured on
#: the H200 (2026-12-01) up to 1.5e-5 from the float64 reference on unit-variance inputs, one
#: element in ~10^5 beyond the 1e-5 that elementwise ops are held to. The 16-bit tolerances hold.
FP32_ATOL = 5e-5


@pytest.fixture(scope="module")
def attn():
    """The launcher module, compiled (not interpreted) and registered as the CUDA kernel."""
    import triton

    from customop.backend_loader import load_backend
    from customop.backends.triton import attention as module

    load_backend("cuda")
    if not isinstance(module._varlen_attention_kernel, triton.runtime.jit.JITFunction):
        pytest.fail("backends/triton/attention.py was imported under TRITON_INTERPRET=1")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("customop::mm_encoder_attn", "CUDA")
    return module


def ref_on_device(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths, scale: float) -> torch.Tensor:
    """float64 ``softmax(q k^T scale) v`` per segment of packed ``[T, H, D]`` tensors, four query
    heads at a time (a 4096-token segment's scores are 0.5 GB per head in float64)."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    start = 0
    for length in lengths:
        rows = slice(start, start + length)
        for h0 in range(0, q.shape[1], 4):
            heads = range(h0, min(h0 + 4, q.shape[1]))
            qh = q[rows, h0:heads.stop].double()
            kh = k[rows, [h // group for h in heads]].double()
            vh = v[rows, [h // group for h in heads]].double()
            scores = torch.einsum("qhd,khd->hqk", qh, kh) * scale
            out[rows, h0:heads.stop] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vh)
        start += length
    return out


def _inputs(case, packing: Packing, dtype):
    q, k, v = case.inputs(packing, dtype, device="cuda", generator=torch.Generator().manual_seed(0))
    return q, k, v


def _packed_reference(case, op, packing, q, k, v):
    lengths = list(packing.lengths) if packing.lengths is not None else [packing.tokens]
    rows = [ref_on_device(q[b].reshape(packing.tokens, op.num_heads, op.head_size),
                          k[b].reshape(packing.tokens, op.num_kv_heads, op.head_size),
                          v[b].reshape(packing.tokens, op.num_kv_heads, op.head_size), lengths, op.scale)
            for b in range(packing.batch)]
    return torch.stack(rows).reshape(q.shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", REAL_CASES + CASES, ids=lambda c: c.label)
def test_real_sizes(attn, case, dtype, poison_empty):
    packings = SIZES["real"] if dtype == torch.bfloat16 else FEWER
    for packing in packings:
        op = case.build()
        q, k, v = _inputs(case, packing, dtype)
        cu = packing.cu_seqlens("cuda")
        expected = _packed_reference(case, op, packing, q, k, v)
        # vLLM's calling convention: cu_seqlens on the device, max_seqlen a CPU tensor
        max_seqlen = None if cu is None else torch.tensor(packing.max_seqlen)
        got = op.forward_kernel(q, k, v, cu, max_seqlen)
        torch.cuda.synchronize()
        assert got.dtype == dtype and got.shape == q.shape
        assert_close_on_device(got.reshape(-1, q.shape[-1]), expected.reshape(-1, q.shape[-1]).to(dtype),
                               f"{case.label} {packing.label}", atol=FP32_ATOL if dtype == torch.float32 else None)
        del q, k, v, got, expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", REAL_CASES, ids=lambda c: c.label)
def test_the_triton_kernel_at_real_sizes(attn, case, dtype, poison_empty):
    """16-bit inputs go to torch's kernel by default; the Triton kernel must be right on them too
    (AMD and Intel GPUs run it, and the benchmark's ``triton`` column times it)."""
    for packing in (SIZES["real"][0], SIZES["real"][2], SIZES["real"][5]):
        op = case.build()
        q, k, v = _inputs(case, packing, dtype)
        t = packing.tokens
        qp, kp, vp = (x.reshape(t, -1, op.head_size) for x in (q, k, v))
        got = attn.triton_varlen_attention(qp, kp, vp, packing.cu_seqlens("cuda"), packing.max_seqlen, op.scale)
        expected = ref_on_device(qp, kp, vp, list(packing.lengths), op.scale)
        torch.cuda.synchronize()
        assert_close_on_device(got.reshape(t, -1), expected.reshape(t, -1).to(dtype), f"triton {case.label} {packing.label}")


def test_routing_on_this_gpu(attn):
    """bf16/fp16 with a head size torch's flash kernel takes go to it (sm80+); fp32 to Triton."""
    q = torch.randn(64, 16, 80, device="cuda")
    assert not attn.torch_flash_serves(q, q)
    if torch.cuda.get_device_capability() >= (8, 0) and attn._torch_varlen() is not None:
        for head in (64, 72, 80, 96, 128):
            x = torch.randn(64, 16, head, device="cuda", dtype=torch.bfloat16)
            assert attn.torch_flash_serves(x, x)
            assert attn.torch_flash_serves(x, x[:, :4]) == attn._torch_varlen_groups_heads()


def test_equal_segments_take_one_sdpa_batch(attn, monkeypatch):
    """T == segments * max_seqlen (equal segments, known on the host) goes to one batched SDPA
    call; an uneven packing, or a looser max_seqlen, to the varlen kernel. Both against float64."""
    calls = []
    real = attn.equal_segments_sdpa
    monkeypatch.setattr(attn, "equal_segments_sdpa", lambda *a: calls.append(a[3]) or real(*a))
    case = REAL_CASES[0]
    for lengths, max_seqlen, routed in (((1024,) * 4, 1024, True), ((4096,), 4096, True), ((1024,) * 4, 2048, False),
                                        ((1000, 1048, 1024, 1024), 1048, False)):
        packing = Packing(1, lengths)
        op = case.build()
        q, k, v = _inputs(case, packing, torch.bfloat16)
        calls.clear()
        got = op.forward_kernel(q, k, v, packing.cu_seqlens("cuda"), torch.tensor(max_seqlen))
        assert bool(calls) == routed, (lengths, max_seqlen)
        expected = _packed_reference(case, op, packing, q, k, v)
        assert_close_on_device(got.reshape(-1, q.shape[-1]), expected.reshape(-1, q.shape[-1]).bfloat16(), str(lengths))


@pytest.mark.parametrize("max_seqlen", [4096, None], ids=["given", "unknown"])
def test_cuda_graph_replay_matches_eager(attn, max_seqlen):
    """Captured with max_seqlen given (no host read) and without (the launcher bounds the grid by
    the whole sequence inside a capture instead of reading cu_seqlens)."""
    case, packing = REAL_CASES[0], Packing(1, (1024, 4096, 7, 1))
    op = case.build()
    q, k, v = _inputs(case, packing, torch.bfloat16)
    cu = packing.cu_seqlens("cuda")
    for impl in ("torch", "triton"):
        if impl == "triton":  # the fp32 path goes to the Triton kernel
            q, k, v = q.float(), k.float(), v.float()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            op.forward_kernel(q, k, v, cu, max_seqlen)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = op.forward_kernel(q, k, v, cu, max_seqlen)
        for x in (q, k, v):
            x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        eager = op.forward_kernel(q, k, v, cu, 4096)
        if max_seqlen is not None:
            assert torch.equal(captured, eager), impl
        else:  # captured with the whole sequence as the bound: another grid, the same values
            assert_close_on_device(captured.reshape(-1, q.shape[-1]), eager.reshape(-1, q.shape[-1]), impl)


def test_strided_qkv_views(attn):
    """q, k and v as slices of one fused [B, S, 3 * H * D] projection output, as ViTs produce them."""
    case, packing = REAL_CASES[0], Packing(1, (1000, 24, 3000))
    op = case.build()
    width = op.num_heads * op.head_size
    qkv = torch.randn(1, packing.tokens, 3 * width, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.split(width, dim=-1)
    got = op.forward_kernel(q, k, v, packing.cu_seqlens("cuda"))
    expected = _packed_reference(case, op, packing, q, k, v)
    assert_close_on_device(got.reshape(-1, width), expected.reshape(-1, width).bfloat16(), "strided")


def test_conforms_on_the_gpu(attn):
    from customop.ops.attention import MMEncoderAttention
    from customop.testing import assert_conforms

    assert_conforms(MMEncoderAttention, platform="cuda", device="cuda")


# ---- causal: customop::varlen_attn, MLA's prefill route (docs/mla.md) ------------------------------
#: DeepSeek-V3 at tensor parallel 8: 16 heads, q/k of 128 + 64 = 192 lanes, v of 128 zero-padded to 192
MLA_HEADS, MLA_QK, MLA_V = 16, 192, 128
CAUSAL_PACKINGS = ((1, 100, 1023, 4096, 7), (2048, 2048))  # uneven (flash / Triton); equal (one SDPA batch)


def causal_ref_on_device(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths, scale: float) -> torch.Tensor:
    """``ref_on_device`` with each query seeing its segment's keys up to its own position."""
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    start = 0
    for length in lengths:
        rows = slice(start, start + length)
        above = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
        for h0 in range(0, q.shape[1], 4):
            h1 = min(h0 + 4, q.shape[1])
            scores = torch.einsum("qhd,khd->hqk", q[rows, h0:h1].double(), k[rows, h0:h1].double()) * scale
            out[rows, h0:h1] = torch.einsum("hqk,khd->qhd", scores.masked_fill(above, float("-inf")).softmax(-1),
                                            v[rows, h0:h1].double())
        start += length
    return out


def _mla_packed(lengths, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    t = sum(lengths)
    q, k, v = (torch.randn(t, MLA_HEADS, MLA_QK, device="cuda", generator=gen).to(dtype) for _ in range(3))
    v[..., MLA_V:] = 0
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return q, k, v, cu


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lengths", CAUSAL_PACKINGS, ids=["uneven", "equal"])
def test_causal_varlen_attn_at_mla_sizes(attn, lengths, dtype, poison_empty):
    """Through the registered CUDA kernel (torch's flash or SDPA for 16-bit, Triton for fp32)."""
    assert torch._C._dispatch_has_kernel_for_dispatch_key("customop::varlen_attn", "CUDA")
    q, k, v, cu = _mla_packed(lengths, dtype)
    scale = MLA_QK ** -0.5
    got = torch.ops.customop.varlen_attn(q, k, v, cu, max(lengths), scale, True)
    expected = causal_ref_on_device(q, k, v, lengths, scale)
    torch.cuda.synchronize()
    assert_close_on_device(got.reshape(-1, MLA_QK), expected.reshape(-1, MLA_QK).to(dtype), f"causal {lengths}",
                           atol=FP32_ATOL if dtype == torch.float32 else None)
    assert not got[..., MLA_V:].any(), "the zero-padded value lanes must stay zero"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_causal_triton_kernel_at_mla_sizes(attn, dtype, poison_empty):
    lengths = CAUSAL_PACKINGS[0]
    q, k, v, cu = _mla_packed(lengths, dtype, seed=1)
    got = attn.triton_varlen_attention(q, k, v, cu, max(lengths), MLA_QK ** -0.5, causal=True)
    expected = causal_ref_on_device(q, k, v, lengths, MLA_QK ** -0.5)
    torch.cuda.synchronize()
    assert_close_on_device(got.reshape(-1, MLA_QK), expected.reshape(-1, MLA_QK).to(dtype), "triton causal")


def test_causal_routing_and_graph_replay(attn):
    """16-bit causal calls go to torch's flash kernel where its varlen_attn has a causal keyword
    (``is_causal`` or ``window_size``); a captured causal call replays as it runs eagerly."""
    q, k, v, cu = _mla_packed(CAUSAL_PACKINGS[0], torch.bfloat16)
    print(f"torch {torch.__version__}: varlen_attn causal keywords {attn._torch_varlen_causal()}")
    assert attn.torch_flash_serves(q, k, causal=True) == (attn._torch_varlen() is not None
                                                          and attn._torch_varlen_causal() is not None)
    for dtype in (torch.bfloat16, torch.float32):
        x, y, z = q.to(dtype), k.to(dtype), v.to(dtype)
        call = lambda: torch.ops.customop.varlen_attn(x, y, z, cu, 4096, 0.07, True)  # noqa: E731
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            call()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = call()
        for t in (x, y):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, call()), dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_mla_packed_prefill_at_deepseek_sizes(attn, dtype):
    """``packed_prefill`` (MLA's prefill route) with DeepSeek-V3's per-GPU dims (16 heads, P 128,
    R 64, V 128, L 512) against the spec's per-request up-projection in float64."""
    from customop.math import mla as mla_math

    d = mla_math.MLADims(MLA_HEADS, 128, 64, MLA_V, 512, MLA_QK ** -0.5)
    spans, gen = [(0, 1), (1, 301), (301, 2349), (2349, 2366)], torch.Generator(device="cuda").manual_seed(2)
    t = spans[-1][1]
    q = torch.randn(t, MLA_HEADS, MLA_QK, device="cuda", generator=gen).to(dtype)
    kv_c = torch.randn(t, 512, device="cuda", generator=gen).to(dtype)
    k_pe = torch.randn(t, 64, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(MLA_HEADS * 256, 512, device="cuda", generator=gen) * 512 ** -0.5).to(dtype)
    got = mla_math.packed_prefill(q, kv_c, k_pe, dtype, spans, w, d, torch.ops.customop.varlen_attn)
    rows = torch.cat((kv_c, k_pe), -1).double()
    expected = torch.cat([mla_math.prefill_attention(q[a:b].double(), rows[a:b], w.double(), d) for a, b in spans])
    torch.cuda.synchronize()
    err = float((got.double() - expected).norm() / expected.norm())
    assert err <= (1e-5 if dtype == torch.float32 else 4 * 2.0 ** -8), f"normwise {err:.2e}"
