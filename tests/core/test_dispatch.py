"""Which forward runs: platform table, fallbacks, enable rules (op-semantics.md A.2-A.5)."""

import logging

import pytest
import torch

import customop
from customop import Config, CustomOp, use_config
from customop.platforms import BUILTIN_PLATFORMS, Platform, PlatformEnum, UnspecifiedPlatform
from customop.testing import forced_platform

from .ops_for_tests import METHODS, make_op, unregister

EXPECTED = {"cuda": "forward_cuda", "rocm": "forward_hip", "xpu": "forward_xpu",
            "tpu": "forward_tpu", "cpu": "forward_cpu"}


class AvailablePlatform:
    """Wraps a built-in so that it counts as runnable here (dispatch only, no backend)."""

    def __init__(self, name):
        cls = BUILTIN_PLATFORMS[name]
        self.platform = type(f"Test{cls.__name__}", (cls,), {"unavailable_reason": classmethod(lambda c: None)})()


@pytest.fixture
def op_all():
    cls = make_op("dispatch_all")
    yield cls
    unregister("dispatch_all")


@pytest.mark.parametrize("platform", sorted(EXPECTED))
def test_enabled_op_goes_to_the_platform_method(op_all, platform):
    with forced_platform(AvailablePlatform(platform).platform), use_config(Config(custom_ops=["all"])):
        assert op_all()(None) == EXPECTED[platform]


def test_oot_platform_goes_to_forward_oot(op_all):
    class Npu(Platform):
        _enum = PlatformEnum.OOT
        name = "npu"
        forward_method = "forward_oot"

    with forced_platform(Npu()), use_config(Config(custom_ops=["all"])):
        assert op_all()(None) == "forward_oot"


def test_unspecified_platform_runs_native(op_all):
    with forced_platform(UnspecifiedPlatform()), use_config(Config(custom_ops=["all"])):
        assert op_all()(None) == "forward_native"


def test_forward_hip_falls_back_to_forward_cuda():
    cls = make_op("dispatch_no_hip", methods=("forward_native", "forward_cuda"))
    try:
        with forced_platform(AvailablePlatform("rocm").platform), use_config(Config(custom_ops=["all"])):
            assert cls()(None) == "forward_cuda"
        assert cls.effective_method("forward_hip") == "forward_cuda"
    finally:
        unregister("dispatch_no_hip")


@pytest.mark.parametrize("platform", sorted(EXPECTED))
def test_undefined_platform_methods_fall_back_to_native(platform):
    cls = make_op("dispatch_native_only", methods=("forward_native",))
    try:
        with forced_platform(AvailablePlatform(platform).platform), use_config(Config(custom_ops=["all"])):
            assert cls()(None) == "forward_native"
    finally:
        unregister("dispatch_native_only")


@pytest.mark.parametrize("ops", [["none"], ["all", "-dispatch_all"], ["none", "-dispatch_all"]])
def test_disabled_op_runs_native(op_all, ops):
    with forced_platform("cpu"), use_config(Config(custom_ops=ops)):
        assert op_all()(None) == "forward_native"


def test_plus_enables_under_none(op_all):
    with forced_platform("cpu"), use_config(Config(custom_ops=["none", "+dispatch_all"])):
        assert op_all()(None) == "forward_cpu"


def test_enforce_enable_wins_over_none_and_minus(op_all):
    with forced_platform("cpu"), use_config(Config(custom_ops=["none", "-dispatch_all"])):
        assert op_all(enforce_enable=True)(None) == "forward_cpu"
        assert op_all()(None) == "forward_native"


def test_dispatch_is_frozen_at_construction_until_redispatched(op_all):
    with forced_platform("cpu"):
        with use_config(Config(custom_ops=["all"])):
            op = op_all()
        with use_config(Config(custom_ops=["none"])):
            assert op(None) == "forward_cpu"
            op.dispatch_forward()
            assert op(None) == "forward_native"


def test_counters_tick_once_per_instance(op_all):
    config = Config(custom_ops=["none", "+dispatch_all"])
    with forced_platform("cpu"), use_config(config):
        op_all(), op_all()
    assert config.enabled_custom_ops["dispatch_all"] == 2
    assert config.disabled_custom_ops["dispatch_all"] == 0


def test_default_is_none_under_inductor_compile(op_all):
    config = Config(mode=customop.CompilationMode.VLLM_COMPILE)
    with forced_platform("cpu"), use_config(config):
        assert op_all()(None) == "forward_native"
        assert not op_all.enabled() and not op_all.default_on()


def test_compile_native_compiles_the_disabled_path():
    class Doubler(CustomOp):
        def forward_native(self, x):
            return x * 2

    CustomOp.register("dispatch_doubler")(Doubler)
    try:
        with use_config(Config(custom_ops=["none"])):
            op = Doubler(compile_native=True)
        assert op._forward_method is not op.forward_native  # a compiled wrapper
        x = torch.randn(5)
        torch.testing.assert_close(op(x), x * 2)
    finally:
        unregister("dispatch_doubler")


def test_automatic_choice_falls_back_and_logs_once_but_explicit_request_does_not(op_all, caplog):
    class Broken(BUILTIN_PLATFORMS["cuda"]):
        @classmethod
        def unavailable_reason(cls):
            return "missing ['triton']: pip install customop[cuda]"

    with forced_platform(Broken()), caplog.at_level(logging.WARNING, logger="customop"):
        with use_config(Config(custom_ops=["all"])):
            assert op_all()(None) == "forward_native"
            assert op_all()(None) == "forward_native"
        with use_config(Config(custom_ops=["none", "+dispatch_all"])):
            assert op_all()(None) == "forward_cuda"  # explicit: the backend's own error surfaces
        assert op_all(enforce_enable=True)(None) == "forward_cuda"
    assert sum("dispatch_all runs forward_native" in r.getMessage() for r in caplog.records) == 1


def test_unregistered_subclass_warns_and_uses_base_mode(caplog):
    class Loose(CustomOp):
        def forward_native(self, x=None):
            return "native"

        def forward_cpu(self, x=None):
            return "cpu"

    with forced_platform("cpu"), caplog.at_level(logging.WARNING, logger="customop"):
        with use_config(Config(custom_ops=["none"])):
            assert Loose()(None) == "native"
        with use_config(Config(custom_ops=["all"])):
            assert Loose()(None) == "cpu"
    assert any("not registered" in r.getMessage() for r in caplog.records)


def test_register_rejects_non_ops_and_taken_names(op_all):
    with pytest.raises(TypeError):
        CustomOp.register("x")(int)
    with pytest.raises(ValueError, match="taken"):
        make_op("dispatch_all")


def test_forward_native_must_be_implemented():
    class Empty(CustomOp):
        pass

    with pytest.raises(NotImplementedError, match="Empty"):
        Empty().forward_native()


def test_hooks_fire_through_module_call(op_all):
    with forced_platform("cpu"), use_config(Config(custom_ops=["all"])):
        op = op_all()
    seen = []
    op.register_forward_hook(lambda mod, args, out: seen.append(out))
    op(None)
    assert seen == ["forward_cpu"]


def test_every_method_exists_on_the_base():
    for method in METHODS:
        assert callable(getattr(CustomOp, method))


def test_dispatch_report_follows_an_op_s_own_enabled_rule():
    """MMEncoderAttention is on even under "none" (as in vLLM); the report says what construction
    would decide, not what the config alone says."""
    from customop.report import dispatch_report

    rows = {r.op: r for r in dispatch_report(Config(custom_ops=["none"]), UnspecifiedPlatform())}
    assert rows["mm_encoder_attn"].enabled and not rows["rms_norm"].enabled
    rows = {r.op: r for r in dispatch_report(Config(custom_ops=["none", "-mm_encoder_attn"]), UnspecifiedPlatform())}
    assert not rows["mm_encoder_attn"].enabled
