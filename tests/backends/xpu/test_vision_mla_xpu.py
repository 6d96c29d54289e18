"""``forward_xpu`` end to end for ``multi_head_latent_attention``, ``conv2d``/``conv3d`` and
``rel_pos_attention``: the op classes built with XPU forced as the platform, their ``customop::``
calls (``mla_decode``, ``varlen_attn``, ``conv2d``, ``conv3d``) sent to the op's XPU kernel (CPU
tensors redispatched to the XPU key, as XPU tensors would go), judged by the float64 references of
``tests/cases`` on one or two rows of each case table. ``rel_pos_attention``'s ``forward_kernel``
is plain torch (no ``customop::`` op). IPEX maps none of these ops, so the chain gives them the
shared Triton launcher where Triton drives an XPU, else the reference body (here: the reference).
Nothing here ran on an Intel GPU.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import customop
from customop.backends.xpu import chain
from customop.ops.mla import MultiHeadLatentAttentionWrapper
from customop.samples import attention as attention_table
from customop.samples import conv as conv_table
from customop.samples.mla import BATCHES, build_modules, init_kwargs
from customop.testing import assert_close, forced_platform, randn
from tests.backends.xpu import fake_ipex
from tests.backends.xpu.conftest import env
from tests.cases.attention import ref_rel_pos_attention
from tests.cases.conv import reference as conv_reference
from tests.cases.mla import reference as mla_reference

OPS = {f"customop::{name}" for name in ("conv2d", "conv3d", "mla_decode", "varlen_attn")}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
#: bf16 judged normwise for MLA, at most four unit roundoffs, as tests/ops/test_mla.py does
NORMWISE = {torch.bfloat16: 4 * 2.0 ** -8}


@pytest.fixture
def no_ipex(monkeypatch, restore_chain):
    """The chain of a machine with an XPU and neither IPEX nor Triton: every op's reference body."""
    def never():
        raise AssertionError("IPEX must not be imported here")

    monkeypatch.setattr(chain, "import_ipex", never)
    chain.install(env(ipex_version=None))


class RunOnXpu(TorchDispatchMode):
    """Sends the named ``customop::`` ops on CPU tensors to their XPU kernel and records them."""

    def __init__(self, *names: str) -> None:
        super().__init__()
        self.names, self.seen = names, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace == "customop" and name in self.names:
            self.seen.append(name)
            return func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.XPU), *args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def build_xpu(make):
    with forced_platform("xpu"), customop.use_config(customop.Config(custom_ops=["all"])):
        op = make()
    assert op.forward_method_name == "forward_xpu"
    return op


def test_chain_serves_them(monkeypatch, restore_chain):
    """Every one gets an XPU kernel; with IPEX's XPU build and Triton on an XPU, the Triton
    launchers (stand-ins here), never IPEX; without Triton, the reference body."""
    monkeypatch.setattr(chain, "import_ipex", fake_ipex.xpu_build)
    launchers = {op: (lambda *a: None) for op in OPS}
    monkeypatch.setattr(chain, "triton_kernels", lambda: launchers)
    resolution = chain.install(env(triton_xpu=True, triton_reason="test"))
    assert {op: resolution.choices[op].provider for op in OPS} == dict.fromkeys(OPS, "triton")
    assert all(resolution.choices[op].kernel is launchers[op] for op in OPS)
    resolution = chain.install(env())
    assert {op: resolution.choices[op].provider for op in OPS} == dict.fromkeys(OPS, "eager")
    for op in OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "XPU"), op


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("label", ["patch14", "k4 s2 p1 groups2", "qwen2-vl (2,14,14)", "k3 p1"])
def test_conv_forward_xpu(label, dtype, no_ipex):
    """Patch projections (the linear form) and plain convolutions, 2-D and 3-D."""
    case = conv_table.BY_LABEL[label]
    op = build_xpu(lambda: case.build(dtype, generator=torch.Generator().manual_seed(0)))
    x = case.input(case.shapes["small"][-1], dtype, generator=torch.Generator().manual_seed(1))
    with RunOnXpu(case.op) as mode, torch.no_grad():
        out = op(x)
    assert mode.seen == [case.op]
    assert out.dtype == dtype
    assert_close(out, conv_reference(op, x), dtype, what=label)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("label", ["rel_pos 7x5", "rel_pos interpolated"])
def test_rel_pos_attention_forward_xpu(label, dtype, no_ipex):
    """forward_xpu = forward_kernel: the blocked spec (plain torch; no customop:: op to send)."""
    case = next(c for c in attention_table.REL_POS_CASES if c.label == label)
    op = build_xpu(lambda: case.build(dtype, generator=torch.Generator().manual_seed(0)))
    x = randn(*case.shapes["small"][-1], dtype=dtype, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = op(x)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, ref_rel_pos_attention(op, x), dtype, what=label)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_lora", [True, False], ids=["q_lora", "q_proj"])
def test_mla_forward_xpu(q_lora, dtype, no_ipex):
    """One batch with every route: two decodes (customop::mla_decode), a chunked prefill (the
    spec) and a fresh prefill (customop::varlen_attn); the output and the cache rows written."""
    batch = BATCHES[0]
    op = build_xpu(lambda: MultiHeadLatentAttentionWrapper(**init_kwargs(build_modules(q_lora, dtype), q_lora)))
    positions, hidden, cache, meta = batch.build(dtype)
    before = cache.clone()
    expected, rows = mla_reference(op, positions, hidden, before, meta)
    with RunOnXpu("mla_decode", "varlen_attn") as mode, torch.no_grad():
        out = op(positions, hidden, cache, meta)
    assert mode.seen == ["mla_decode", "varlen_attn"]
    assert out.dtype == dtype and out.shape == hidden.shape
    flat = cache.view(-1, cache.shape[-1])
    for what, got, want in (("output", out, expected), ("cache rows", flat[meta.slot_mapping], rows)):
        if dtype == torch.float32:
            assert_close(got, want, dtype, what=what)
        else:
            err = float((got.double() - want).norm() / want.norm())
            assert err <= NORMWISE[dtype], f"{what}: normwise relative error {err:.2e} > {NORMWISE[dtype]:.2e}"
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[meta.slot_mapping] = False
    assert torch.allclose(flat[untouched], before.view(-1, cache.shape[-1])[untouched], rtol=0, atol=0,
                          equal_nan=True), "a cache row outside slot_mapping was written"
