"""Memory a service held for big requests goes back once it is idle: its resident set returns
to within 20% of what it held loaded and warm (``allocator.IdleRelease``: the sessions'
arenas shrunk, the allocator trimmed). ``python -m bench.storm_memory`` measures the hostile
probe's whole load; this is a small one."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest

from service.heads.files import HeadWeights, save_head
from tests.server import poll, running_server, server_process

# A server's resident set, grown and given back (tests/conftest.py: the measure group).
pytestmark = pytest.mark.xdist_group("measure")

VOCAB, D_MODEL, ROWS, K = 16000, 256, 4096, 1000


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("idle")
    table = np.random.default_rng(5).standard_normal((VOCAB, D_MODEL), dtype=np.float32)
    save_head(HeadWeights.from_arrays(table), root / "big" / "1")
    return root


def _score(url: str, rows: int) -> int:
    hidden = np.random.default_rng(rows).standard_normal((rows, D_MODEL), dtype=np.float32)
    body = orjson.dumps(
        {"hidden_states": hidden, "target_ids": list(range(rows)), "k": K},
        option=orjson.OPT_SERIALIZE_NUMPY,
    )
    answer = httpx.post(
        f"{url}/v1/models/big/score",
        content=body,
        headers={"content-type": "application/json"},
        timeout=300,
    )
    return answer.status_code


def test_memory_held_for_big_requests_goes_back_once_idle(repository: Path) -> None:
    # Four 4096-row k=1000 scorings at once declare ~1.3 GB (answers and bodies): the budget
    # holds them all, so the test measures what they leave, not 503s.
    with running_server(repository, max_inflight_bytes=str(2 * 2**30)) as url:
        server = server_process(url)
        assert _score(url, 128) == 200  # warm: what a first call sets up stays (its buffers)
        warm = server.memory_info().rss
        with ThreadPoolExecutor(4) as clients:
            statuses = list(clients.map(lambda _: _score(url, ROWS), range(4)))
        assert statuses == [200] * 4
        grown = server.memory_info().rss
        settled = poll(
            lambda: server.memory_info().rss if server.memory_info().rss <= 1.2 * warm else None,
            "the idle service's memory to go back",
            timeout_s=20,
        )
    print(f"\nwarm {warm / 2**20:.0f} MB, after {grown / 2**20:.0f}, idle {settled / 2**20:.0f}")
    assert grown > 1.5 * warm  # the requests did hold memory, which went back
