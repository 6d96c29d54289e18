"""Smoke runs of the CPU benchmarks' ``torch.compile(forward_native)`` columns (issue 18): the
encoder attention and MoE experts tables at tiny sizes, one short timing each."""

from __future__ import annotations

import sys

import pytest

from customop.benchmarks.cpu import attention, moe


def table_rows(text: str) -> list[list[str]]:
    """The cells of each data row of the markdown tables in ``text``."""
    rows = [line.strip("|").split("|") for line in text.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in row] for row in rows if row[0].strip() not in ("dtype", "layer")]


@pytest.mark.slow
def test_encoder_table_has_the_compile_column(capsys):
    attention.main(["encoder", "--dtypes", "fp32,bf16", "--heads", "2x16", "--packings", "48/3,40/mixed",
                    "--min-time", "0", "--threads", "1"])
    out = capsys.readouterr().out
    (header,) = (line for line in out.splitlines() if line.startswith("| dtype"))
    assert "compile (ms)" in header and header.endswith("forward_cpu x compile |")
    rows = table_rows(out)
    assert len(rows) == 4
    for row in rows:
        p5, median = (float(r) for r in row[-1].split(" / "))  # compile's time over forward_cpu's
        assert p5 > 0 and median > 0


@pytest.mark.slow
def test_encoder_no_compile_leaves_the_column_empty(capsys):
    attention.main(["encoder", "--dtypes", "fp32", "--heads", "2x16", "--packings", "48/3", "--no-compile",
                    "--min-time", "0"])
    (row,) = table_rows(capsys.readouterr().out)
    assert row[6] == "-" and row[-1] == "-"


@pytest.mark.slow
def test_moe_table_has_the_native_compile_column(monkeypatch, capsys):
    monkeypatch.setitem(moe.MODELS, "tiny", (4, 2, 64, 32))
    monkeypatch.setattr(sys, "argv", ["moe", "--models", "tiny", "--tokens", "1,5", "--dtypes", "float32",
                                      "--rounds", "1", "--threads", "1"])
    moe.main()
    rows = table_rows(capsys.readouterr().out)
    assert len(rows) == 2
    for row in rows:
        assert float(row[-2]) > 0  # forward_cpu x native_compile
        assert "frames compiled" in row[-1] and "WRONG" not in row[-1]
