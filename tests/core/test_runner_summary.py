"""The runner's per-row summary: the best peer and the speedup, bounds kept apart."""

from customop.benchmarks.runner import _summarise


def _row(**us):
    return {"impls": {name: {"us": t} for name, t in us.items()}}


def test_the_best_peer_is_the_fastest_implementation_that_is_not_customop_or_eager():
    row = _row(customop=10.0, eager=4.0, compile=12.0, liger=11.0, customop_fresh=5.0)
    _summarise(row)
    assert row["best_peer"] == "liger" and row["speedup"] == 11.0 / 10.0
    assert "x_bound" not in row


def test_a_bound_is_reported_beside_the_speedup_not_as_the_peer():
    row = _row(customop=19.0, compile=19.5, conv=300.0, gemm=14.0)
    _summarise(row)
    assert row["best_peer"] == "compile" and row["speedup"] == 19.5 / 19.0
    assert row["bound"] == "gemm" and row["x_bound"] == 14.0 / 19.0


def test_wrong_or_failed_peers_do_not_count():
    row = _row(customop=10.0, compile=5.0, liger=12.0)
    row["impls"]["compile"]["ok"] = False
    row["impls"]["triton"] = {"failed": "RuntimeError"}
    _summarise(row)
    assert row["best_peer"] == "liger"
