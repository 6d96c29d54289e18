"""The state-space ops on the XPU backend (backends/xpu/chain.py registers every ``customop::`` op
generically; nothing in the backend is specific to them):

- every ``customop::`` mamba op gets an ``xpu`` kernel: the shared Triton launcher where Triton
  can drive an XPU, else the reference; never IPEX (no mapping: see the last test);
- the real Triton launchers as the XPU kernels, run by the Triton interpreter on CPU tensors
  through the dispatcher's redispatch to the XPU key, against the reference on CPU clones
  (outputs and the caches they write);
- the mixers built with XPU forced as the platform run ``forward_xpu``;
- xpu tier (IPEX 2.8.0's CPU build): the facts behind "no IPEX mapping".

Nothing here ran on an Intel GPU.
"""

from __future__ import annotations

import pytest
import torch

import customop
from customop.backends.xpu import chain, ipex_ops
from customop.testing import assert_close, forced_platform
from tests.backends.xpu.conftest import env, real_ipex, xpu_kernel

MAMBA_OPS = {f"customop::{name}" for name in ("causal_conv1d_fn", "causal_conv1d_update", "selective_scan",
                                              "selective_state_update", "ssd_chunk_scan", "mixer2_gated_rms_norm")}


@pytest.fixture
def no_ipex_import(monkeypatch, restore_chain):
    def never():
        raise AssertionError("IPEX must not be imported here")

    monkeypatch.setattr(chain, "import_ipex", never)


def _samples():
    """op -> schema arguments (small shapes; the conv cache is the transposed view of vLLM's
    layout; padding slots and an empty request included)."""
    from customop.math import mamba as spec

    g = torch.Generator().manual_seed(0)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    qsl = torch.tensor([0, 3, 3, 9], dtype=torch.int32)
    slots, init = torch.tensor([2, 1, -1], dtype=torch.int32), torch.tensor([True, False, True])
    conv = r(4, 5, 24).transpose(1, 2)
    H, P, N = 4, 8, 16
    dt4, A4, D4, b4 = spec.ssd_head_form(r(3, H, scale=0.5), -(0.5 + torch.rand(H, generator=g)), r(H), r(H), P, N)
    return {
        "causal_conv1d_fn": (r(9, 24), r(24, 4), r(24), conv, qsl, slots, init, True, 0),
        "causal_conv1d_update": (r(3, 24), conv, r(24, 4), None, torch.tensor([3, 0, 1], dtype=torch.int32), False,
                                 0),
        "selective_scan": (r(9, 1, 16), r(9, 1, 16, scale=0.5), -(0.5 + torch.rand(1, 16, N, generator=g)),
                           r(9, 1, N), r(9, 1, N), r(1, 16), r(9, 1, 16), r(1, 16), r(4, 1, 16, N), qsl, slots, init,
                           True, 0),
        "selective_state_update": (r(4, H, P, N), r(3, H, P), dt4, A4, r(3, 2, N), r(3, 2, N), D4, r(3, H, P), b4,
                                   torch.tensor([1, -1, 3], dtype=torch.int32), True, 0),
        "ssd_chunk_scan": (r(9, H, P), r(9, H, scale=0.5), -(0.5 + torch.rand(H, generator=g)), r(9, 2, N), r(9, 2, N),
                           r(H), r(H), r(4, H, P, N), qsl, slots, init, 4, True, 0),
        "mixer2_gated_rms_norm": (r(5, 96), r(5, 96), r(96), 1e-5, 24),
    }


def test_every_mamba_op_gets_an_xpu_kernel(no_ipex_import):
    resolution = chain.install(env(ipex_version=None))
    assert MAMBA_OPS <= set(resolution.choices)
    assert {resolution.choices[op].provider for op in MAMBA_OPS} == {"eager"}
    for op in MAMBA_OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "XPU"), op


def test_triton_serves_the_mamba_ops_even_with_ipex(monkeypatch, restore_chain):
    """With Triton on an XPU the shared launchers serve every mamba op, IPEX's XPU build present
    or not: ``ipex_ops`` maps none of them."""
    from tests.backends.xpu import fake_ipex

    assert not MAMBA_OPS & set(ipex_ops.BINDERS)
    monkeypatch.setattr(chain, "import_ipex", fake_ipex.xpu_build)
    launchers = {op: (lambda *a: None) for op in MAMBA_OPS}
    monkeypatch.setattr(chain, "triton_kernels", lambda: launchers)
    resolution = chain.install(env(triton_xpu=True, triton_reason="test"))
    assert {resolution.choices[op].provider for op in MAMBA_OPS} == {"triton"}
    assert all(resolution.choices[op].kernel is launchers[op] for op in MAMBA_OPS)


@pytest.mark.interpret
@pytest.mark.parametrize("name", sorted(op.removeprefix("customop::") for op in MAMBA_OPS))
def test_real_triton_launchers_as_xpu_kernels(name, no_ipex_import):
    """The shared launcher as the XPU kernel (Triton interpreter, CPU tensors) against the
    reference body on clones: the output and the cache it writes in place."""
    triton = pytest.importorskip("triton")
    if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 7):
        pytest.skip(f"triton {triton.__version__}'s interpreter fails on the shared kernels; they are tested with "
                    "the test extra's triton 3.7 (main tier)")
    resolution = chain.install(env(ipex_version=None, triton_xpu=True, triton_reason="test"))
    assert resolution.choices[f"customop::{name}"].provider == "triton"
    args = _samples()[name]

    def clones():
        return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]

    got_args, want_args = clones(), clones()
    got = xpu_kernel(name, *got_args)
    want = getattr(torch.ops.customop, name)(*want_args)
    assert_close(got, want, torch.float32, what=name)
    for i, (g, w) in enumerate(zip(got_args, want_args)):  # the caches (and nothing else) written alike
        if isinstance(g, torch.Tensor) and g.is_floating_point():
            assert_close(g, w, w.dtype, what=f"{name} argument {i}")
        elif isinstance(g, torch.Tensor):
            assert torch.equal(g, w), f"{name} argument {i}"


def test_forced_xpu_platform_runs_forward_xpu(no_ipex_import):
    """The mixers built with XPU forced run forward_xpu (the ``customop::`` ops); on CPU tensors
    the dispatcher keeps the CPU kernels (the reference bodies), so the results are the spec's."""
    from customop.samples.mamba import BATCHES, CASES

    chain.install(env(ipex_version=None))
    batch = BATCHES["check"][0]
    for case in (CASES[0], CASES[3], CASES[6]):  # mamba_mixer, mamba_mixer2, short_conv
        with forced_platform("xpu"), customop.use_config(customop.Config(custom_ops=["all"])):
            op = case.build("check", torch.float32, torch.Generator().manual_seed(0))
        assert op._forward_method == op.forward_xpu, case.label
        h, *caches, meta = case.inputs(op, batch, torch.float32, torch.Generator().manual_seed(1))
        native_caches = [c.clone() for c in caches]
        with torch.no_grad():
            out = op(h, *caches, meta)
            want = op.forward_native(h, *native_caches, meta)
        assert_close(out, want, torch.float32, atol=1e-5, what=case.label)
        assert_close(caches, native_caches, torch.float32, atol=1e-5, what=f"{case.label} caches")


@pytest.mark.ipex
def test_ipex_cpu_build_mamba_functions():
    """IPEX 2.8.0's CPU build has Mamba functions, but not where the chain looks and not for XPU
    tensors: ``ipex.llm.modules.MambaMixer`` (class methods on dense batches, no slot indices, no
    varlen offsets), nothing in ``ipex.llm.functional``, and its runtime refuses any device but
    the CPU. The chain therefore maps no mamba op to IPEX (docs/xpu.md)."""
    ipex, _ = real_ipex()
    mixer = ipex.llm.modules.MambaMixer
    for name in ("causal_conv1d_fn", "causal_conv1d_update", "selective_state_update", "selective_scan_fn"):
        assert callable(getattr(mixer, name)), name
    words = ("mamba", "conv1d", "selective", "ssd", "scan")
    assert not [n for n in dir(ipex.llm.functional) if any(w in n.lower() for w in words)]
    meta = torch.empty(2, 4, 8, 16, device="meta")
    with pytest.raises(AssertionError, match="only support CPU device"):
        mixer.selective_state_update(meta, meta[:, :, :, 0], meta[:, :, :, 0], meta[0], meta[:, :1, 0], meta[:, :1, 0])
