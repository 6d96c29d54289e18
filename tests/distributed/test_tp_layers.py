"""Every parallel layer at tp_size 2 (two gloo ranks on 127.0.0.1) against tp_size 1.

One job runs all checks in ``_tp_checks`` (start-up dominates: ~2 s per rank); each test case
reports one check from both ranks.
"""

import pytest

from tests.distributed._launch import run_ranks
from tests.distributed._tp_checks import CHECKS, COMPILE_CHECKS

WORLD_SIZE = 2


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    return run_ranks("tests.distributed._tp_checks", world_size=WORLD_SIZE, timeout=180)


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_tp2_matches_tp1(reports: list[dict], check: str) -> None:
    failures = [f"rank {rank}:\n{report[check]}" for rank, report in enumerate(reports)
                if report.get(check, "not run") is not None]
    assert not failures, f"{check} failed\n" + "\n".join(failures)


@pytest.mark.slow
def test_tp2_layers_compile_fullgraph() -> None:
    """A separate job: Dynamo's start-up (~10 s on 2 cores) would slow every other case."""
    reports = run_ranks("tests.distributed._tp_checks", world_size=WORLD_SIZE, timeout=300, extra_args=("--compile",))
    failures = [f"rank {rank} {name}:\n{err}" for rank, report in enumerate(reports) for name in COMPILE_CHECKS
                if (err := report.get(name, "not run")) is not None]
    assert not failures, "\n".join(failures)
