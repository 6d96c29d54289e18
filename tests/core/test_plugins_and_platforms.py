"""Platform detection and entry-point plugins, through a real importlib.metadata distribution."""

import sys
import textwrap

import pytest
import torch

import customop
from customop import plugins, platforms
from customop.platforms import CpuPlatform, detect

PLUGIN_MODULE = '''
import os
import customop
from customop.platforms import Platform, PlatformEnum

GENERAL_CALLS = []


class NpuPlatform(Platform):
    _enum = PlatformEnum.OOT
    name = "npu"
    forward_method = "forward_oot"


def register():
    GENERAL_CALLS.append(1)


def npu():
    return "customop_test_plugin:NpuPlatform"


def second():
    return "customop_test_plugin.NpuPlatform" if os.environ.get("TEST_SECOND_PLATFORM") else None


def inactive():
    return None
'''

ENTRY_POINTS = """
[customop.plugins]
test_general = customop_test_plugin:register

[customop.platform_plugins]
test_npu = customop_test_plugin:npu
test_second = customop_test_plugin:second
test_inactive = customop_test_plugin:inactive
"""


@pytest.fixture
def plugin_dist(tmp_path, monkeypatch):
    """Installs a tiny distribution with both entry-point groups on sys.path."""
    (tmp_path / "customop_test_plugin.py").write_text(textwrap.dedent(PLUGIN_MODULE))
    info = tmp_path / "customop_test_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: customop-test-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("customop_test_plugin", None)
    plugins.reset_for_tests()


def test_cpu_is_detected_on_this_machine():
    platform = detect()
    assert isinstance(platform, CpuPlatform)
    assert platform.is_cpu() and not platform.is_cuda_alike() and platform.forward_method == "forward_cpu"
    assert platform.dist_backend == "gloo"


def test_current_platform_is_lazy_and_cached():
    platforms.set_current_platform(None)
    assert platforms._current is None
    first = customop.current_platform
    assert first is customop.current_platform is platforms.current_platform()


def test_one_active_platform_plugin_wins(plugin_dist):
    platform = detect()
    assert platform.name == "npu" and platform.is_out_of_tree()


def test_allow_list_filters_plugins(plugin_dist, monkeypatch):
    monkeypatch.setenv("CUSTOMOP_PLUGINS", "test_general,test_inactive")
    assert isinstance(detect(), CpuPlatform)
    assert set(plugins.load_plugins_by_group(plugins.PLATFORM_PLUGINS_GROUP)) == {"test_inactive"}
    monkeypatch.setenv("CUSTOMOP_PLUGINS", "")
    assert plugins.load_plugins_by_group(plugins.GENERAL_PLUGINS_GROUP) == {}


def test_two_active_platform_plugins_raise(plugin_dist, monkeypatch):
    monkeypatch.setenv("TEST_SECOND_PLATFORM", "1")
    with pytest.raises(RuntimeError, match="only one platform plugin"):
        detect()


def test_force_plugin_platform_by_name(plugin_dist, monkeypatch):
    monkeypatch.setenv("TEST_SECOND_PLATFORM", "1")  # forcing one resolves the conflict
    monkeypatch.setenv("CUSTOMOP_PLATFORM", "test_npu")
    assert detect().name == "npu"
    monkeypatch.setenv("CUSTOMOP_PLATFORM", "test_inactive")
    with pytest.raises(RuntimeError, match="not active"):
        detect()


def test_general_plugins_run_once_before_the_first_op(plugin_dist):
    plugins.reset_for_tests()

    class Probe(customop.CustomOp):
        def forward_native(self):
            return None

    Probe(), Probe()
    assert sys.modules["customop_test_plugin"].GENERAL_CALLS == [1]


@pytest.mark.parametrize("name, match", [
    ("cuda", "no CUDA device"),
    ("rocm", "no ROCm device"),
    ("tpu", r"pip install customop\[tpu\]"),
    ("xpu", "no XPU device is visible"),
    ("bogus", "not a known platform"),
])
def test_forced_platform_that_cannot_run_raises(monkeypatch, name, match):
    if name == "tpu" and not platforms.TpuPlatform.unavailable_reason():
        pytest.skip("torch_xla and jax are installed in this tier")
    monkeypatch.setenv("CUSTOMOP_PLATFORM", name)
    with pytest.raises(RuntimeError, match=match):
        detect()


@pytest.mark.parametrize("name", ["cpu"])
def test_forced_platform_that_can_run(monkeypatch, name):
    monkeypatch.setenv("CUSTOMOP_PLATFORM", name.upper())
    assert detect().name == name


def test_backend_status_warns_when_torch_does_not_match_a_pinned_dependency(monkeypatch):
    from customop.backend_loader import BACKENDS

    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())  # "installed"
    ok, why = BACKENDS["xpu"].status()
    assert ok and "intel_extension_for_pytorch works only with torch 2.8.*, but torch 2.13.0+cpu" in why
    monkeypatch.setattr(torch, "__version__", "2.8.0+cpu")
    assert "warning" not in BACKENDS["xpu"].status()[1]


def test_platform_facts():
    assert platforms.CudaPlatform().fp8_dtype() is torch.float8_e4m3fn
    assert platforms.CudaPlatform().dist_backend == "nccl"
    assert platforms.XpuPlatform().dist_backend == "xccl"
    assert platforms.TpuPlatform().dist_backend == "xla" and not platforms.TpuPlatform().use_all_gather()
    rocm = platforms.RocmPlatform()
    assert rocm.is_rocm() and rocm.is_cuda_alike() and rocm.forward_method == "forward_hip"


@pytest.mark.parametrize("arch, dtype", [("gfx942:sramecc+:xnack-", torch.float8_e4m3fnuz),
                                         ("gfx950", torch.float8_e4m3fn)])
def test_rocm_fp8_dtype_by_arch(monkeypatch, arch, dtype):
    class Props:
        gcnArchName = arch

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: Props())
    assert platforms.RocmPlatform().fp8_dtype() is dtype
