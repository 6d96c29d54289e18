"""The XPU provider chain (backends/xpu/chain.py): IPEX present / absent / mismatched / failing,
Triton, compiled, eager; the registered XPU kernels run on CPU tensors through the dispatcher's
redispatch to the XPU key; ops built with XPU forced as the platform. Runs in both tiers."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import customop
from customop.backends.xpu import chain, probe
from customop.testing import assert_close, forced_platform
from tests.backends.xpu import fake_ipex
from tests.backends.xpu.conftest import env, xpu_kernel

IPEX_OPS = {"customop::rms_norm", "customop::fused_add_rms_norm", "customop::silu_and_mul",
            "customop::gelu_and_mul", "customop::quick_gelu", "customop::rotary_embedding"}


def providers(resolution) -> dict[str, str]:
    return {op: c.provider for op, c in resolution.choices.items()}


@pytest.fixture
def fake_xpu_ipex(monkeypatch, restore_chain):
    build = fake_ipex.xpu_build()
    monkeypatch.setattr(chain, "import_ipex", lambda: build)
    return build


def _forbid_ipex_import(monkeypatch):
    def never():
        raise AssertionError("IPEX must not be imported here")

    monkeypatch.setattr(chain, "import_ipex", never)


def test_real_environment_has_no_xpu():
    """This machine: no XPU device, so no Triton on XPU; IPEX absent (main tier) or the CPU build
    (xpu tier), which is never used for XPU tensors and never imported by the chain."""
    real = probe.probe()
    assert not real.xpu_device and not real.triton_xpu
    if real.ipex_version is not None:
        assert real.ipex_build == "cpu" and "CPU build" in real.ipex_unusable()
    resolution = chain.install()
    assert set(providers(resolution).values()) == {"eager"}
    assert IPEX_OPS <= set(resolution.choices)
    assert ("not installed" if real.ipex_version is None else "CPU build") in resolution.ipex_note


def test_backend_import_stays_light():
    """With IPEX's CPU build installed (xpu tier), neither IPEX (18 s to import) nor the Triton
    kernels are loaded: they cannot serve XPU tensors here."""
    if probe.probe().ipex_version is None:
        pytest.skip("IPEX is not installed: nothing to keep from importing (the xpu tier runs this)")
    code = ("import sys, customop.backends.xpu as x; text = x.describe(); "
            "print(sorted(m for m in ('intel_extension_for_pytorch', 'customop.backends.triton') if m in sys.modules)); "
            "print(text)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == "[]", result.stdout
    assert "xpu backend" in result.stdout and "rms_norm" in result.stdout


def test_ipex_present(fake_xpu_ipex):
    resolution = chain.install(env())
    chosen = providers(resolution)
    assert {op for op, p in chosen.items() if p == "ipex"} == IPEX_OPS
    assert {p for op, p in chosen.items() if op not in IPEX_OPS} == {"eager"}
    assert resolution.choices["customop::fused_add_rms_norm"].fallback == "eager"
    assert resolution.ipex_note == "used: IPEX 2.8.10+xpu"
    assert "add_rms_norm(residual, x, weight, None, eps, add_back=True)" in chain.describe()


def test_ipex_kernels_through_the_dispatcher(fake_xpu_ipex):
    chain.install(env())
    calls = fake_xpu_ipex.llm.functional.calls
    x, residual, weight = torch.randn(3, 16), torch.randn(3, 16), torch.randn(16)
    assert_close(xpu_kernel("rms_norm", x, weight, 1e-6), torch.ops.customop.rms_norm(x, weight, 1e-6))
    expected = x.clone(), residual.clone()
    torch.ops.customop.fused_add_rms_norm(*expected, weight, 1e-6)
    xpu_kernel("fused_add_rms_norm", x, residual, weight, 1e-6)
    assert_close((x, residual), expected)
    gated = torch.randn(2, 10)
    assert_close(xpu_kernel("silu_and_mul", gated), torch.ops.customop.silu_and_mul(gated))
    assert calls == ["rms_norm", "add_rms_norm", "silu_and_mul"]
    # Arguments IPEX cannot take go to the next provider (here the eager reference).
    assert_close(xpu_kernel("rms_norm", x, None, 1e-6), torch.ops.customop.rms_norm(x, None, 1e-6))
    assert calls == ["rms_norm", "add_rms_norm", "silu_and_mul"]


@pytest.mark.parametrize("case", ["absent", "torch_mismatch", "cpu_build", "no_label_mismatch"])
def test_ipex_not_used(monkeypatch, restore_chain, case):
    _forbid_ipex_import(monkeypatch)
    environment = {
        "absent": env(ipex_version=None),
        "torch_mismatch": env(torch_version="2.13.0+xpu"),
        "cpu_build": env(ipex_version="2.8.0+cpu"),
        "no_label_mismatch": env(torch_version="2.9.1", ipex_version="2.8.0"),
    }[case]
    resolution = chain.install(environment)
    assert "ipex" not in providers(resolution).values()
    expected = {"absent": "not installed", "torch_mismatch": "needs torch 2.8.*, found torch 2.13.0+xpu",
                "cpu_build": "CPU build", "no_label_mismatch": "needs torch 2.8.*"}[case]
    assert expected in resolution.ipex_note and expected in chain.describe()


@pytest.mark.parametrize("error", [SystemExit(127), ImportError("libsycl.so.8"), OSError("undefined symbol")])
def test_ipex_import_failure_is_not_fatal(monkeypatch, restore_chain, error):
    def failing():
        raise error

    monkeypatch.setattr(chain, "import_ipex", failing)
    resolution = chain.install(env())
    assert "failed to import" in resolution.ipex_note
    assert "ipex" not in providers(resolution).values()


def test_function_missing_from_the_build_goes_to_the_next_provider(monkeypatch, restore_chain):
    build = fake_ipex.xpu_build()
    del build.llm.functional.gelu_quick
    monkeypatch.setattr(chain, "import_ipex", lambda: build)
    chosen = providers(chain.install(env()))
    assert chosen["customop::quick_gelu"] == "eager" and chosen["customop::rms_norm"] == "ipex"


def _recording_launchers(seen: list[str]):
    """Stand-ins for the Triton launchers: each records its op and runs the reference."""
    bodies = chain.library_bodies()

    def launcher(op):
        def run(*args):
            seen.append(op)
            return bodies[op](*args)
        return run

    return {op: launcher(op) for op in bodies}


def test_triton_after_ipex(fake_xpu_ipex, monkeypatch):
    seen: list[str] = []
    monkeypatch.setattr(chain, "triton_kernels", lambda: _recording_launchers(seen))
    resolution = chain.install(env(triton_xpu=True, triton_reason="test"))
    chosen = providers(resolution)
    assert {op for op, p in chosen.items() if p == "ipex"} == IPEX_OPS
    assert {p for op, p in chosen.items() if op not in IPEX_OPS} == {"triton"}
    assert resolution.choices["customop::rms_norm"].fallback == "triton"
    x = torch.randn(2, 8)
    xpu_kernel("rms_norm", x, None, 1e-6)  # no weight: IPEX hands it to Triton
    xpu_kernel("gemma_rms_norm", x, torch.zeros(8), 1e-6)
    assert seen == ["customop::rms_norm", "customop::gemma_rms_norm"]


def test_triton_without_ipex(monkeypatch, restore_chain):
    _forbid_ipex_import(monkeypatch)
    seen: list[str] = []
    monkeypatch.setattr(chain, "triton_kernels", lambda: _recording_launchers(seen))
    chosen = providers(chain.install(env(ipex_version=None, triton_xpu=True, triton_reason="test")))
    assert set(chosen.values()) == {"triton"}


def test_real_triton_launcher_under_the_interpreter(monkeypatch, restore_chain):
    """The shared launcher itself as the XPU kernel, run by the Triton interpreter on CPU tensors."""
    triton = pytest.importorskip("triton")
    if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 7):
        pytest.skip(f"triton {triton.__version__}'s interpreter fails on the shared kernels; they are "
                    "tested with the test extra's triton 3.7 (main tier)")
    _forbid_ipex_import(monkeypatch)
    chain.install(env(ipex_version=None, triton_xpu=True, triton_reason="test"))
    x, weight = torch.randn(3, 40), torch.randn(40)
    assert_close(xpu_kernel("rms_norm", x, weight, 1e-6), torch.ops.customop.rms_norm(x, weight, 1e-6))


def test_compiled_when_triton_has_no_kernel(monkeypatch, restore_chain):
    """Inductor's XPU code is Triton, so "compiled" needs Triton on XPU; it serves ops without a
    Triton kernel. Run here by Inductor's CPU backend on CPU tensors."""
    _forbid_ipex_import(monkeypatch)
    monkeypatch.setattr(chain, "triton_kernels", lambda: {})
    resolution = chain.install(env(ipex_version=None, triton_xpu=True, triton_reason="test"))
    assert set(providers(resolution).values()) == {"compiled"}
    x = torch.randn(4, 2 * 24)
    assert_close(xpu_kernel("silu_and_mul", x), torch.ops.customop.silu_and_mul(x))
    # One torch.compile per reference body for the process, kept across re-resolutions.
    compiles = chain._compile.cache_info().misses
    chain.install(env(ipex_version=None, triton_xpu=True, triton_reason="test"))
    assert_close(xpu_kernel("silu_and_mul", 2 * x), torch.ops.customop.silu_and_mul(2 * x))
    assert chain._compile.cache_info().misses == compiles


def test_choice_is_made_once(fake_xpu_ipex):
    first = chain.install(env())
    assert chain.install() is first and chain.choices() is first.choices
    chain.describe()
    assert chain.install() is first


def test_forced_xpu_platform_runs_forward_xpu(fake_xpu_ipex):
    """Ops built with XPU forced run forward_xpu (the same ``torch.ops.customop`` call as
    forward_cuda), and building them loads this backend; on CPU tensors the dispatcher keeps the
    CPU kernels, so the results are the spec."""
    from customop.ops.activation import SiluAndMul
    from customop.ops.layernorm import RMSNorm
    from customop.ops.rotary_embedding.base import RotaryEmbedding

    chain.install(env())
    with forced_platform("xpu"), customop.use_config(customop.Config(custom_ops=["all"])):
        norm, act = RMSNorm(32), SiluAndMul()
        rope = RotaryEmbedding(16, 16, 64, 10000.0, True, torch.float32)
    for op in (norm, act, rope):
        assert op._forward_method == op.forward_xpu, op._forward_method
    x, residual = torch.randn(3, 32), torch.randn(3, 32)
    assert_close(norm(x.clone(), residual.clone()), norm.forward_native(x, residual))
    assert_close(act(x), act.forward_native(x))
    positions, q, k = torch.arange(3), torch.randn(3, 32), torch.randn(3, 16)
    assert_close(rope(positions, q.clone(), k.clone()), rope.forward_native(positions, q, k))
    assert "ipex" in chain.describe()
