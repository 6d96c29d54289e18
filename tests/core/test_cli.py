"""`customop info`: platform, backends, config and the dispatch table."""

import pytest

import customop
from customop import Config, CustomOp, use_config
from customop.cli import main
from customop.report import dispatch_report

from .ops_for_tests import make_op, unregister


@pytest.fixture
def two_ops():
    make_op("cli_full")
    make_op("cli_native", methods=("forward_native",))
    yield
    unregister("cli_full", "cli_native")


def test_info_prints_every_section(two_ops, capsys, monkeypatch):
    monkeypatch.setenv("CUSTOMOP_CUSTOM_OPS", "none,+cli_full")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "platform: cpu" in out
    assert "custom_ops=['none', '+cli_full']" in out
    for backend in ("triton", "cuda", "rocm", "xpu", "tpu", "cpu"):
        assert f"\n{backend} " in out
    full = next(line for line in out.splitlines() if line.startswith("cli_full "))
    native = next(line for line in out.splitlines() if line.startswith("cli_native "))
    assert " on " in full and full.endswith("forward_cpu")
    assert " off " in native and native.endswith("forward_native")


def test_dispatch_report_resolves_fallbacks_and_replacements(two_ops):
    class Vendor(CustomOp.op_registry["cli_native"]):
        def forward_cpu(self, x=None):
            return "vendor"

    CustomOp.register_oot(name="cli_native")(Vendor)
    with use_config(Config(custom_ops=["all"])):
        rows = {r.op: r for r in dispatch_report()}
    assert rows["cli_native"].replaced_by == "test_dispatch_report_resolves_fallbacks_and_replacements.<locals>.Vendor"
    assert rows["cli_native"].runs == "forward_cpu"
    assert rows["cli_full"].runs == "forward_cpu"
    assert "cli_full" in customop.list_ops()


def test_unknown_command_exits_with_usage():
    with pytest.raises(SystemExit):
        main(["nope"])


def test_check_passes_on_real_ops_and_prints_the_table(capsys):
    assert main(["check", "--ops", "silu_and_mul", "relu2"]) == 0
    out = capsys.readouterr().out
    assert "platform: cpu" in out
    rows = [line for line in out.splitlines() if line.startswith(("silu_and_mul", "relu2"))]
    assert rows and all(line.rstrip().endswith("pass") for line in rows)
    assert "forward_cpu" in rows[0]
    assert " 0 failed" in out


def test_check_fails_on_a_wrong_replacement(capsys):
    relu2 = CustomOp.op_registry["relu2"]

    class WrongRelu2(relu2):
        def forward_cpu(self, x):
            return x * 0 + 1  # not relu(x)^2

    CustomOp.register_oot(name="relu2")(WrongRelu2)
    try:
        assert main(["check", "--ops", "relu2"]) == 1
    finally:
        CustomOp.unregister_oot("relu2")
    out = capsys.readouterr().out
    assert "FAIL" in out and "exceed" in out
