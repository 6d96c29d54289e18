"""forward_cpu's per-call shortcuts (issue 18): RMSNorm's quick input test agrees with the full
check on every case, ``CpuTiers.compiled``'s cache follows ``compile_cache.reset()`` and patched
resolvers, and a caller's ``static`` key still compiles one graph per shape class."""

from __future__ import annotations

import pytest
import torch

from customop.backends.cpu import compile_cache, tiering
from customop.config import Config, use_config
from customop.ops import layernorm as L

H = 8


def _full_check_passes(x, weight, residual) -> bool:
    try:
        L._check_norm_inputs("rms_norm", H, x, weight, {"residual": residual})
    except (TypeError, ValueError):
        return False
    return True


_W = torch.ones(H)
_CASES = {
    "good": (torch.randn(3, H), _W, None),
    "good-fused": (torch.randn(3, H), _W, torch.randn(3, H)),
    "good-3d": (torch.randn(2, 3, H), _W, torch.randn(2, 3, H)),
    "no-weight": (torch.randn(3, H), None, None),
    "bf16-x-fp32-weight": (torch.randn(3, H, dtype=torch.bfloat16), _W, None),
    "0-d": (torch.randn(()), _W, None),
    "hidden": (torch.randn(3, H + 1), _W, None),
    "int-x": (torch.ones(3, H, dtype=torch.int32), _W, None),
    "int-weight": (torch.randn(3, H), torch.ones(H, dtype=torch.int32), None),
    "weight-shape": (torch.randn(3, H), torch.ones(H, 1), None),
    "weight-device": (torch.randn(3, H), torch.ones(H, device="meta"), None),
    "residual-dtype": (torch.randn(3, H), _W, torch.randn(3, H, dtype=torch.bfloat16)),
    "residual-int": (torch.randn(3, H), _W, torch.ones(3, H, dtype=torch.int32)),
    "residual-shape": (torch.randn(3, H), _W, torch.randn(1, H)),
    "residual-device": (torch.randn(3, H), _W, torch.randn(3, H, device="meta")),
    "x-meta": (torch.randn(3, H, device="meta"), _W, None),
    "all-meta": (torch.randn(3, H, device="meta"), torch.ones(H, device="meta"), torch.randn(3, H, device="meta")),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_quick_input_test_agrees_with_the_full_check(case):
    x, weight, residual = _CASES[case]
    assert L._norm_inputs_pass(H, x, weight, residual) == _full_check_passes(x, weight, residual)


def test_tiers_compiled_cache_follows_reset_and_patches(monkeypatch):
    tiers = tiering.CpuTiers(min_numel=0)
    fn = tiers.compiled(L.rms_norm)
    assert fn is compile_cache.compiled(L.rms_norm) and tiers.compiled(L.rms_norm) is fn
    compile_cache.reset()
    again = tiers.compiled(L.rms_norm)
    assert again is not fn and again is compile_cache.compiled(L.rms_norm)
    monkeypatch.setattr(tiering, "compiled", lambda f: "patched")
    assert tiers.compiled(L.rms_norm) == "patched"
    monkeypatch.undo()
    assert tiers.compiled(L.rms_norm) is again
    assert tiers == tiering.CpuTiers(min_numel=0)  # the cache is not part of the value


def test_rms_norm_static_key_one_graph_per_shape_class(monkeypatch):
    """Two eps values are two shape classes: each compiles its dynamic graph once, and new row
    counts of either compile nothing more."""
    compile_cache.reset()
    monkeypatch.setattr(L.RMSNorm, "cpu_tiers", L.RMSNorm.cpu_tiers.compiling_from(0))
    with use_config(Config(custom_ops=["all"])):
        ops = [L.RMSNorm(H, eps=eps) for eps in (1e-6, 1e-5)]
    frames = []
    import torch._dynamo.utils as dynamo_utils
    with torch.no_grad():
        for rows in (2, 3):
            for op in ops:
                op.forward_cpu(torch.randn(rows, H))
        frames.append(dynamo_utils.counters["stats"]["unique_graphs"])
        for rows in (4, 7, 33):
            for op in ops:
                x = torch.randn(rows, H)
                torch.testing.assert_close(op.forward_cpu(x), op.forward_native(x))
        frames.append(dynamo_utils.counters["stats"]["unique_graphs"])
    assert frames[1] == frames[0]
    compile_cache.reset()


def test_for_this_cpu_follows_atens_capability(monkeypatch):
    """The tiers named for ATen's capability on this machine, else the default; SituAndMul's are
    chosen so (the compiled tier at every size on AVX2 CPUs, where it measured faster)."""
    from customop.ops import activation as A

    band, avx2 = tiering.CpuTiers(1 << 20, compiled_up_to=1 << 16), tiering.CpuTiers(1)
    for capability, want in (("AVX2", avx2), ("AVX512", band), ("DEFAULT", band)):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        assert tiering.for_this_cpu(band, AVX2=avx2) is want
    monkeypatch.undo()
    on_avx2 = torch.backends.cpu.get_cpu_capability() == "AVX2"
    assert (A.SituAndMul.cpu_tiers is A.SITU_BAND_CPU_TIERS) is not on_avx2
    assert A.SituAndMul.cpu_tiers.runs_compiled((1 << 16) + 1, torch.float32) is on_avx2
