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


def test_rounds_give_the_best_peer_of_each_round_against_customop():
    row = _row(customop=10.0, compile=11.0, liger=10.5)
    rounds = {"customop": [10.0, 9.0, 11.0], "compile": [11.0, 12.0, 10.0], "liger": [10.5, 9.9, 12.0]}
    for name, us in rounds.items():
        row["impls"][name]["us_rounds"] = us
    _summarise(row)
    assert row["best_peer"] == "liger" and row["speedup"] == 10.5 / 10.0
    assert row["speedup_rounds"] == [10.5 / 10.0, 9.9 / 9.0, 10.0 / 11.0]


def test_targets_count_the_rows_below_the_best_peer_in_every_round():
    from customop.benchmarks.runner_output import targets

    rows = []
    for shape, ours, peer in (("1x8", [10.0, 10.0], [9.0, 9.5]), ("2x8", [10.0, 10.0], [9.0, 11.0]),
                              ("3x8", [10.0, 10.0], [12.0, 12.0])):
        row = {"op": "rms_norm", "shape": shape, "tokens": int(shape[0]), "impls": {
            "customop": {"us": sum(ours) / 2, "us_rounds": ours}, "compile": {"us": sum(peer) / 2, "us_rounds": peer}}}
        _summarise(row)
        rows.append(row)
    text = targets(rows)
    assert "Rows below 1.00x the best peer: 1 of 3; below in every round: 1 (rms_norm 1x8)" in text
    assert "0.93x (0.90-0.95) (1x8)" in text
