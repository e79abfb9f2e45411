"""A short soak (bench/soak.py runs the long one): valid answers stay exact and hostile ones
stay 4xx while versions are swapped, and memory stays within the documented bound."""

from __future__ import annotations

import pytest

from bench.soak import run_soak

# Traffic for a fixed time, and the server's peak memory (tests/conftest.py: the measure group).
pytestmark = pytest.mark.xdist_group("measure")


def test_valid_and_hostile_traffic_through_swaps() -> None:
    report = run_soak(seconds=15)
    assert report.valid > 100
    assert report.wrong == 0
    assert report.failed_valid == 0
    assert report.server_errors == 0
    assert report.hostile > 50
    assert all(400 <= status < 500 for status in report.hostile_statuses)
    assert report.swaps >= 3
    assert len(report.versions_seen) >= 3
    assert report.peak_over_models <= report.bound
