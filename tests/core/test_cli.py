"""The console script: info, check, bench; errors; ``python -m customop``."""

import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import customop
from customop import Config, CustomOp, use_config
from customop.cli import main
from customop.ops.moe import cpu as moe_cpu
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


def test_info_prints_the_moe_routes(capsys, monkeypatch):
    monkeypatch.setenv("CUSTOMOP_CUSTOM_OPS", "all")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    section = out[out.index("\nmoe routes (bf16, forward_cpu):"):]
    rows = [line.split(None, 6) for line in section.splitlines() if line.startswith(("Mixtral", "Qwen3"))]
    assert len(rows) == 6
    # CPU: the eager grouped form below COMPILE_FROM_SLOTS slots, the compiled one from there (on
    # AVX2 CPUs the spec from SPEC_FROM_SLOTS_PER_EXPERT's slots an expert: 256 tokens x 8 / 128
    # experts = 16)
    assert "Qwen3-30B-A3B E128 k8 H2048 I768  1 " in section
    assert rows[3][5:] == ["1", "grouped (torch._grouped_mm, eager)"]
    big = "spec" if torch.bfloat16 in moe_cpu.SPEC_FROM_SLOTS_PER_EXPERT else "compiled"
    assert rows[4][5:6] == ["256"] and rows[4][6].startswith(big)
    monkeypatch.setenv("CUSTOMOP_CUSTOM_OPS", "none")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "moe routes (bf16, forward_native, fused_moe disabled):" in out


def test_moe_routes_on_cuda_read_the_tuning_table():
    """The CUDA rows come from moe_tuning's table or default_config, without a GPU or triton."""
    from customop.platforms import CudaPlatform
    from customop.report import moe_routes

    heading, rows = moe_routes(Config(custom_ops=["all"]), CudaPlatform())
    assert heading == "bf16, forward_cuda"
    routes = {(label.split()[0], int(tokens)): route for label, tokens, route in rows}
    mixtral, qwen = routes["Mixtral-8x7B", 256], routes["Qwen3-30B-A3B", 1]
    assert mixtral.startswith("triton block_m=128") and mixtral.endswith("(table)")
    assert qwen.startswith("triton sparse decode") and qwen.endswith("(table)")
    # a shape without a row takes default_config, and says so
    from customop.backends.triton import moe_tuning

    untuned = moe_tuning.route(torch.device("cuda"), 256, 64, 1408, 2048, 6, torch.bfloat16)
    assert untuned.startswith("triton block_m=") and untuned.endswith("(default)")


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


def test_check_gives_every_registered_op_a_row(two_ops, capsys, monkeypatch):
    """Stubbed conformance (a full run takes minutes): the rows, outcomes and counts only."""
    import customop.testing

    def one_pass(op_cls, device="cpu"):
        yield "", torch.float32, "forward_cpu", 0.0, None

    monkeypatch.setattr(customop.testing, "run_conformance", one_pass)
    assert main(["check"]) == 1  # cli_full and cli_native have no samples
    out = capsys.readouterr().out
    starts = {line.split()[0] for line in out.splitlines() if line.strip()}
    assert set(customop.list_ops()) <= starts
    lm_head = next(line for line in out.splitlines() if line.startswith("parallel_lm_head "))
    assert "skip" in lm_head and "logits_processor" in lm_head
    n = len(customop.list_ops())
    assert f"{n - 3} passed, 2 failed, 1 skipped" in out


# ---- the console script, in a subprocess, as users run it ------------------------------------

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("customop")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "customop"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CUSTOMOP_")}
    kwargs.setdefault("stderr", subprocess.PIPE)
    return subprocess.run([*cmd, *args], env={**clean, **(env or {})}, stdout=subprocess.PIPE, text=True,
                          timeout=300, **kwargs)


def test_python_m_customop_runs_the_cli():
    done = subprocess.run([sys.executable, "-m", "customop", "info"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "platform: " in done.stdout and "dispatch:" in done.stdout


def test_bench_passes_its_options_to_the_runner():
    done = run_cli("bench", "--list", "--ops", "rms_norm")
    assert done.returncode == 0, done.stderr
    assert [line.split()[0] for line in done.stdout.splitlines()] == ["rms_norm"]


def test_bench_help_has_every_option_in_the_benchmarks_readme():
    text = (ROOT / "benchmarks" / "README.md").read_text()
    runner_section = text.split("## The GPU runner")[1].split("\n## ")[0]
    documented = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", runner_section))
    assert {"--ops", "--quick", "--list", "--dry-run"} <= documented
    done = run_cli("bench", "--help")
    assert done.returncode == 0 and done.stdout.startswith("usage: customop bench"), done.stderr
    assert documented <= set(re.findall(r"--[a-z][a-z-]*", done.stdout))


def test_bench_dry_run_writes_results_on_cpu(tmp_path):
    pytest.importorskip("triton")
    done = run_cli("bench", "--ops", "rms_norm", "--quick", "--dry-run", "--impls", "customop,eager",
                   "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "results.json").read_text())["results"]
    assert {r["op"] for r in rows} == {"rms_norm"} and len(rows) == 2  # --quick: tokens 1 and 4096
    assert all(r["impls"]["customop"]["ok"] for r in rows)


def test_bench_tokens_keeps_only_those_shapes(tmp_path):
    pytest.importorskip("triton")
    done = run_cli("bench", "--ops", "rms_norm", "--tokens", "16", "--dry-run", "--impls", "customop",
                   "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [r["shape"] for r in rows] == ["16x4096[dry]", "16x8192[dry]"]  # the dry run's labels


def test_bench_rounds_time_each_implementation_that_many_times(tmp_path):
    pytest.importorskip("triton")
    done = run_cli("bench", "--ops", "rms_norm", "--tokens", "16", "--dry-run", "--impls", "customop,eager",
                   "--rounds", "3", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["environment"]["rounds"] == 3
    for row in results["results"]:
        for entry in row["impls"].values():
            assert len(entry["us_rounds"]) == 3 and entry["us"] == sorted(entry["us_rounds"])[1]


@pytest.mark.parametrize("env, says", [
    ({"CUSTOMOP_PLATFORM": "bogus"}, "known: ['cpu'"),
    ({"CUSTOMOP_CUSTOM_OPS": "rms_norm"}, "'+op'"),
])
def test_errors_are_one_line_and_exit_2(env, says):
    done = run_cli("info", env=env)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("customop: error: ") and says in lines[0], done.stderr


def test_check_rejects_unknown_ops_listing_the_known_ones():
    done = run_cli("check", "--ops", "rms_norm,bogus_op")
    assert done.returncode == 2
    assert "'bogus_op'" in done.stderr and "silu_and_mul" in done.stderr and "Traceback" not in done.stderr


def test_check_takes_comma_lists_and_class_names():
    done = run_cli("check", "--ops", "QuickGELU,relu2")
    assert done.returncode == 0, done.stderr
    checked = {line.split()[0] for line in done.stdout.splitlines() if line.endswith(" pass")}
    assert checked == {"quick_gelu", "relu2"}
    assert re.search(r"\n[1-9]\d* passed, 0 failed, 0 skipped\n", done.stdout)


def test_check_fails_when_nothing_was_checked():
    done = run_cli("check", "--ops", "parallel_lm_head")
    assert done.returncode == 1
    assert "0 passed, 0 failed, 1 skipped" in done.stdout
    assert "checked through logits_processor" in done.stdout
    assert "nothing was checked" in done.stderr


def test_progress_bar_only_on_a_terminal():
    piped = run_cli("check", "--ops", "relu2")
    assert piped.returncode == 0 and "\r" not in piped.stderr and "1/1 done" not in piped.stderr
    primary, secondary = pty.openpty()
    try:
        on_tty = run_cli("check", "--ops", "relu2", stderr=secondary)
        os.close(secondary)
        drawn = os.read(primary, 1 << 16).decode()
    finally:
        os.close(primary)
    assert on_tty.returncode == 0
    assert "\r[" in drawn and "1/1 done" in drawn


def test_no_numpy_warning_without_numpy(tmp_path):
    # a numpy that fails to import, as in the core install (which has none)
    (tmp_path / "numpy").mkdir()
    (tmp_path / "numpy" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    done = run_cli("info", env={"PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert "NumPy" not in done.stderr
