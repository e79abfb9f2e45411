"""Many concurrent one-row requests to the real server: all correct, merged into batches."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import numpy as np
import numpy.typing as npt
import pytest

from service.heads.files import HeadWeights, save_head
from service.heads.reference import output_projection_tied, top_k
from tests.conftest import D_MODEL
from tests.server import running_server

# How concurrent requests fall into batches (tests/conftest.py: the measure group).
pytestmark = pytest.mark.xdist_group("measure")

CLIENTS = 64


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory, table: npt.NDArray[np.float32]) -> Path:
    root = tmp_path_factory.mktemp("repository")
    save_head(HeadWeights.from_arrays(table), root / "tied" / "1")
    return root


async def _concurrent_topk(base_url: str, hidden: npt.NDArray[np.float32]) -> list[list[int]]:
    limits = httpx.Limits(max_connections=CLIENTS)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=60) as client:

        async def one(row: npt.NDArray[np.float32]) -> list[int]:
            body = {"hidden_states": [row.tolist()], "k": 3}
            response = await client.post("/v1/models/tied/topk", json=body)
            assert response.status_code == 200, response.text
            ids: list[int] = response.json()["results"][0]["token_ids"]
            return ids

        return list(await asyncio.gather(*(one(row) for row in hidden)))


def _histogram(text: str, name: str) -> tuple[float, float]:
    """(count, sum) of a histogram in Prometheus text format."""
    count = re.search(rf"^{name}_count{{[^}}]*}} (\S+)$", text, re.MULTILINE)
    total = re.search(rf"^{name}_sum{{[^}}]*}} (\S+)$", text, re.MULTILINE)
    assert count, f"{name}_count missing from /metrics"
    assert total, f"{name}_sum missing from /metrics"
    return float(count.group(1)), float(total.group(1))


@pytest.mark.parametrize("batching", ["true", "false"])
def test_concurrent_single_rows_are_answered_correctly(
    repository: Path, table: npt.NDArray[np.float32], batching: str
) -> None:
    hidden = np.random.default_rng(0).standard_normal((CLIENTS, D_MODEL)).astype(np.float32)
    expected = top_k(output_projection_tied(hidden.astype(np.float64), table), 3)[1]
    with running_server(repository, batching=batching, max_wait_ms="20") as url:
        answers = asyncio.run(_concurrent_topk(url, hidden))
        metrics = httpx.get(f"{url}/metrics").text
    np.testing.assert_array_equal(np.array(answers), expected)
    runs, rows = _histogram(metrics, "lmhead_batch_rows")
    assert rows == CLIENTS
    if batching == "true":
        assert runs < CLIENTS / 2, f"{CLIENTS} requests ran in {runs} runs"
    else:
        assert runs == CLIENTS
