"""FusedMoE at tp_size 2 and with expert parallelism over 2 ranks (gloo on 127.0.0.1) against
tp_size 1: one job runs every check of ``_moe_checks``; each test case reports one check from
both ranks."""

import pytest

from tests.distributed._launch import run_ranks
from tests.distributed._moe_checks import CHECKS


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    return run_ranks("tests.distributed._moe_checks", world_size=2, timeout=180)


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_tp2_matches_tp1(reports: list[dict], check: str) -> None:
    failures = [f"rank {rank}:\n{report[check]}" for rank, report in enumerate(reports)
                if report.get(check, "not run") is not None]
    assert not failures, f"{check} failed\n" + "\n".join(failures)
