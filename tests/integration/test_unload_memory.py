"""Unloading a large head gives its memory back: the server's RSS returns near its baseline.

The margin is documented in the README: at most 15% of W (allocator and arena leftovers) above
the resident size the server had before the head was loaded.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from service.heads.files import HeadWeights, save_head
from tests.server import running_server

# A server's resident set (tests/conftest.py: the measure group).
pytestmark = pytest.mark.xdist_group("measure")

VOCAB, D_MODEL = 50257, 768
WEIGHT_BYTES = VOCAB * D_MODEL * 4
MARGIN = 0.15


def _resident(client: httpx.Client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("process_resident_memory_bytes "):
            return float(line.split()[-1])
    raise AssertionError("process_resident_memory_bytes missing from /metrics")


def test_unload_returns_the_memory_of_a_large_head(tmp_path: Path) -> None:
    repository = tmp_path / "models"
    repository.mkdir()
    table = np.random.default_rng(0).standard_normal((VOCAB, D_MODEL), dtype=np.float32)
    hidden = {"hidden_states": table[:8].tolist(), "k": 3}
    with (
        running_server(repository, provider="cpu") as url,  # host memory is what is measured
        httpx.Client(base_url=url, timeout=120) as client,
    ):
        client.post("/v2/repository/index")  # touch the code paths used below once
        baseline = _resident(client)
        save_head(HeadWeights.from_arrays(table), repository / "big" / "1")
        assert client.post("/v2/repository/models/big/load").status_code == 200
        assert client.post("/v1/models/big/topk", json=hidden).status_code == 200
        loaded = _resident(client)
        assert client.post("/v2/repository/models/big/unload").status_code == 200
        released = _resident(client)
    grown = (loaded - baseline) / WEIGHT_BYTES
    left = (released - baseline) / WEIGHT_BYTES
    print(f"\nRSS over baseline: loaded {grown:.2f} W, after unload {left:.2f} W")
    assert grown >= 0.9
    assert left <= MARGIN
