"""``customop::mm_encoder_attn`` on XPU tensors through IPEX's ``varlen_attention``
(``backends/xpu/ipex_attention.py``): the mapping against the float64 reference on CPU tensors,
with a plain-torch stand-in (main tier) and the real CPU build of IPEX 2.8.0 (xpu tier, marker
``ipex``); the chain's choice and its fallback; ``MMEncoderAttention.forward_xpu`` end to end with
the op's XPU kernel (CPU tensors redispatched to the XPU key). Never run on an Intel GPU."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import customop
from customop.backends.xpu import chain, ipex_attention
from customop.samples.attention import BY_LABEL, Packing
from customop.testing import assert_close, forced_platform, randn
from tests.backends.xpu import fake_ipex
from tests.backends.xpu.conftest import env, real_ipex, xpu_kernel
from tests.cases.attention import ref_packed, reference

_MANY = tuple(1 + i % 3 for i in range(64))


def fake_varlen_attention(calls: list[str]):
    """IPEX's ``varlen_attention`` as documented (its CPU build's signature), in plain torch."""

    def varlen_attention(query, key, value, out, seqlen_q, seqlen_k, alibi_slopes, max_seqlen_q, max_seqlen_k,
                         pdropout, softmax_scale, zero_tensors, is_causal, return_softmax, gen_,
                         window_size_left=-1, window_size_right=-1, softcap=-1.0):
        calls.append("varlen_attention")
        assert alibi_slopes is None and pdropout == 0.0 and not is_causal and not return_softmax
        assert (window_size_left, window_size_right) == (-1, -1) and softcap <= 0
        cu = seqlen_q.tolist()
        assert seqlen_k.tolist() == cu and max(b - a for a, b in zip(cu[:-1], cu[1:])) <= max_seqlen_q
        for a, b in zip(cu[:-1], cu[1:]):
            q, k, v = (t[a:b].transpose(0, 1).float() for t in (query, key, value))
            o = F.scaled_dot_product_attention(q, k, v, scale=softmax_scale, enable_gqa=True)
            out[a:b] = o.transpose(0, 1).to(out.dtype)
        return out

    return varlen_attention


@pytest.fixture(params=[pytest.param("fake", id="stand-in"), pytest.param("real", id="real-cpu-build",
                                                                          marks=pytest.mark.ipex)])
def functional(request):
    if request.param == "real":
        return real_ipex()[0].llm.functional
    calls: list[str] = []
    return SimpleNamespace(calls=calls, varlen_attention=fake_varlen_attention(calls))


def packed(lengths, heads, kv_heads, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = randn(total, heads, head_dim, dtype=dtype, scale=2.0, generator=g)
    k = randn(total, kv_heads, head_dim, dtype=dtype, scale=2.0, generator=g)
    v = randn(total, kv_heads, head_dim, dtype=dtype, generator=g)
    return q, k, v, torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32)


CASES = {
    "mha d64 mixed with empty": ((1, 7, 0, 33, 20), 4, 4, 64),
    "gqa d72": ((5, 1, 9), 4, 2, 72),
    "mqa d80 64 segments": (_MANY, 4, 1, 80),
    "gqa d96": ((17,), 6, 2, 96),
    "mha d128 one token": ((1,), 2, 2, 128),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_varlen_attention_vs_float64(functional, case, dtype):
    lengths, heads, kv_heads, head_dim = CASES[case]
    q, k, v, cu = packed(lengths, heads, kv_heads, head_dim, dtype)
    kernel, scale = ipex_attention.bind(functional), head_dim ** -0.5
    assert kernel.supports(q, k, v, cu, max(lengths), scale)
    for max_seqlen in (max(lengths), 0):  # given; unknown (read from cu_seqlens)
        out = kernel.run(q, k, v, cu, max_seqlen, scale)
        assert out.dtype == dtype and out.shape == q.shape
        assert_close(out, ref_packed(q, k, v, list(lengths), scale), dtype, what=f"{case} max_seqlen={max_seqlen}")


@pytest.mark.ipex
def test_cpu_build_ignores_softmax_scale():
    """Measured limit of IPEX 2.8.0+cpu: ``softmax_scale`` has no effect (it scales by
    ``head_size ** -0.5``), which is why ``supports`` takes the default scale only."""
    q, k, v, cu = packed((5, 9), 2, 2, 64, torch.float32)
    out = ipex_attention.bind(real_ipex()[0].llm.functional).run(q, k, v, cu, 9, 0.1)
    assert_close(out, ref_packed(q, k, v, [5, 9], 64 ** -0.5), torch.float32)
    assert (out.double() - ref_packed(q, k, v, [5, 9], 0.1)).abs().max() > 0.1


def test_bad_cu_seqlens_raises_like_the_reference(functional):
    q, k, v, _ = packed((8,), 2, 2, 64, torch.float32)
    bad = torch.tensor([0, 5, 3, 8], dtype=torch.int32)
    kernel = ipex_attention.bind(functional)
    for run in (kernel.run, torch.ops.customop.mm_encoder_attn):
        with pytest.raises(ValueError, match="cu_seqlens must not decrease"):
            run(q, k, v, bad, 0, 0.125)


def test_empty_sequence(functional):
    q = torch.zeros(0, 2, 64)
    assert ipex_attention.bind(functional).run(q, q, q, torch.zeros(2, dtype=torch.int32), 0, 0.1).shape == (0, 2, 64)


def test_hands_on_what_it_does_not_take():
    q, k, v, cu = packed((4, 4), 2, 2, 64, torch.float32)
    supports, scale = ipex_attention.supports, 0.125
    assert supports(q, k, v, cu, 4, scale)
    assert not supports(q, k, v, cu, 4, 0.1)  # the CPU build ignores the scale
    assert not supports(q.double(), k.double(), v.double(), cu, 4, scale)
    assert not supports(q, k, v, cu.long(), 4, scale)
    big = torch.zeros(8, 2, 288)
    assert not supports(big, big, big, cu, 4, 288 ** -0.5)
    assert ipex_attention.bind(SimpleNamespace()) is None  # a build without the function


# ---- the chain and forward_xpu -------------------------------------------------------------------


@pytest.fixture
def xpu_build_with_attention(monkeypatch, restore_chain):
    build = fake_ipex.xpu_build()
    build.llm.functional.varlen_attention = fake_varlen_attention(build.llm.functional.calls)
    monkeypatch.setattr(chain, "import_ipex", lambda: build)
    return build


class RunOnXpu(TorchDispatchMode):
    """Sends the named ``customop::`` ops on CPU tensors to their XPU kernel, as XPU tensors would."""

    def __init__(self, *names: str) -> None:
        super().__init__()
        self.names = names

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "customop" and func.__name__.split(".")[0] in self.names:
            return func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.XPU), *args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def test_chain_chooses_ipex(xpu_build_with_attention):
    resolution = chain.install(env())
    choice = resolution.choices["customop::mm_encoder_attn"]
    assert (choice.provider, choice.fallback) == ("ipex", "eager")
    assert "varlen_attention(" in chain.describe()
    calls = xpu_build_with_attention.llm.functional.calls
    q, k, v, cu = packed((3, 9, 4), 4, 2, 80, torch.bfloat16)
    scale = 80 ** -0.5
    assert_close(xpu_kernel("mm_encoder_attn", q, k, v, cu, 9, scale), ref_packed(q, k, v, [3, 9, 4], scale),
                 torch.bfloat16)
    assert calls == ["varlen_attention"]
    # what IPEX does not take goes to the next provider (here the reference): another scale, fp64
    assert_close(xpu_kernel("mm_encoder_attn", q, k, v, cu, 9, 0.1), ref_packed(q, k, v, [3, 9, 4], 0.1),
                 torch.bfloat16)
    q64, k64, v64 = q.double(), k.double(), v.double()
    assert_close(xpu_kernel("mm_encoder_attn", q64, k64, v64, cu, 9, scale),
                 ref_packed(q64, k64, v64, [3, 9, 4], scale))
    assert calls == ["varlen_attention"]


@pytest.mark.parametrize("packing", [Packing(1, (1, 7, 0, 33, 20)), Packing(2, None, 9)], ids=lambda p: p.label)
def test_forward_xpu_end_to_end(xpu_build_with_attention, packing):
    """MMEncoderAttention built on the XPU platform: forward_xpu packs the rows and calls the op,
    whose XPU kernel is IPEX's (the stand-in here)."""
    chain.install(env())
    case = BY_LABEL["gqa d72"]
    with forced_platform("xpu"), customop.use_config(customop.Config(custom_ops=["all"])):
        op = case.build()
    assert op.forward_method_name == "forward_xpu"
    q, k, v = case.inputs(packing, torch.float16, generator=torch.Generator().manual_seed(4))
    kwargs = {} if packing.lengths is None else {"cu_seqlens": packing.cu_seqlens(), "max_seqlen": packing.max_seqlen}
    with RunOnXpu("mm_encoder_attn"), torch.no_grad():
        out = op(q, k, v, **kwargs)
    assert xpu_build_with_attention.llm.functional.calls == ["varlen_attention"]
    assert_close(out, reference(case, op, packing, q, k, v), torch.float16)



def test_triton_takes_what_ipex_cannot(xpu_build_with_attention, monkeypatch):
    """With Triton on XPU, calls varlen_attention cannot take (here another scale) go to the
    shared Triton launcher (recording stand-ins here)."""
    seen: list[str] = []
    bodies = chain.library_bodies()

    def launcher(op):
        return lambda *args: seen.append(op) or bodies[op](*args)

    monkeypatch.setattr(chain, "triton_kernels", lambda: {op: launcher(op) for op in bodies})
    choice = chain.install(env(triton_xpu=True, triton_reason="test")).choices["customop::mm_encoder_attn"]
    assert (choice.provider, choice.fallback) == ("ipex", "triton")
    q, k, v, cu = packed((3, 9), 2, 1, 64, torch.float32)
    for scale in (0.125, 0.1):
        assert_close(xpu_kernel("mm_encoder_attn", q, k, v, cu, 9, scale), ref_packed(q, k, v, [3, 9], scale))
    assert seen == ["customop::mm_encoder_attn"]
    assert xpu_build_with_attention.llm.functional.calls == ["varlen_attention"]
