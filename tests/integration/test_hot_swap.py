"""Swap tied -> untied -> tied under one name while 8 clients keep sending: zero failures.

Every answer names its version and must equal the numpy reference of exactly that version;
once a swap has been published, new requests only ever see the new version.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import numpy.typing as npt
import pytest

from service.heads.files import HeadWeights, save_head
from service.heads.reference import top_k
from tests.conftest import D_MODEL, reference_logits
from tests.server import poll, running_server

CLIENTS = 8
MAX_REQUESTS = 3000
K = 5
HIDDEN = np.random.default_rng(42).standard_normal((16, D_MODEL)).astype(np.float32)


@dataclass
class Answer:
    started: float
    row: int
    status: int
    version: int = -1
    tied: bool | None = None
    ids: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


class Load:
    """Clients on threads, bounded in count; the test waits on their progress, never on time."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.answers: list[Answer] = []
        self.stop = threading.Event()
        self.progress = threading.Condition()
        self.threads = [threading.Thread(target=self._client, args=(i,)) for i in range(CLIENTS)]

    def _client(self, seed: int) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            turn = seed
            while not self.stop.is_set() and len(self.answers) < MAX_REQUESTS:
                row = turn % len(HIDDEN)
                turn += CLIENTS
                started = time.monotonic()
                body = {"hidden_states": [HIDDEN[row].tolist()], "k": K}
                response = client.post("/v1/models/head/topk", json=body)
                answer = Answer(started, row, response.status_code)
                if response.status_code == 200:
                    payload = response.json()
                    result = payload["results"][0]
                    answer.version, answer.tied = payload["version"], payload["tied"]
                    answer.ids, answer.values = result["token_ids"], result["logits"]
                with self.progress:
                    self.answers.append(answer)
                    self.progress.notify_all()

    def wait_for(self, more: int, version: int | None = None) -> None:
        """Block until ``more`` answers (of ``version``, if given) arrived after this call."""
        with self.progress:
            start = len(self.answers)

            def done() -> bool:
                fresh = self.answers[start:]
                if version is not None:
                    fresh = [a for a in fresh if a.version == version]
                return len(fresh) >= more or len(self.answers) >= MAX_REQUESTS

            assert self.progress.wait_for(done, timeout=60), "clients made no progress"

    @contextmanager
    def running(self) -> Iterator[Load]:
        for thread in self.threads:
            thread.start()
        try:
            yield self
        finally:
            self.stop.set()
            for thread in self.threads:
                thread.join(timeout=60)


def _expected(path: Path) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.floating]]:
    values, ids = top_k(reference_logits(path, HIDDEN), K)
    return ids, values


def _check(
    answers: list[Answer],
    expected: dict[int, tuple[npt.NDArray[np.int64], npt.NDArray[np.floating]]],
) -> None:
    failed = [a.status for a in answers if a.status != 200]
    assert failed == [], f"{len(failed)} failed requests: {sorted(set(failed))}"
    for answer in answers:
        ids, values = expected[answer.version]
        assert answer.ids == ids[answer.row].tolist(), f"v{answer.version} row {answer.row}"
        np.testing.assert_allclose(answer.values, values[answer.row], rtol=1e-4, atol=1e-4)


@pytest.fixture
def heads(
    tmp_path: Path, table: npt.NDArray[np.float32], output_weight: npt.NDArray[np.float32]
) -> dict[int, HeadWeights]:
    rng = np.random.default_rng(7)
    return {
        1: HeadWeights.from_arrays(table),
        2: HeadWeights.from_arrays(table, output_weight),
        3: HeadWeights.from_arrays(rng.standard_normal(table.shape).astype(np.float32)),
    }


def _unloads(client: httpx.Client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith('lmhead_model_unloads_total{model="head"}'):
            return float(line.split()[-1])
    return 0.0


def test_swap_through_the_api_under_load(tmp_path: Path, heads: dict[int, HeadWeights]) -> None:
    repository = tmp_path / "models"
    paths = {1: save_head(heads[1], repository / "head" / "1")}
    expected = {1: _expected(paths[1])}
    with running_server(repository) as url, httpx.Client(base_url=url, timeout=60) as admin:
        load = Load(url)
        published: dict[int, float] = {}
        with load.running():
            load.wait_for(100)
            for version in (2, 3):
                paths[version] = save_head(heads[version], repository / "head" / str(version))
                expected[version] = _expected(paths[version])
                response = admin.post("/v2/repository/models/head/load")
                assert response.status_code == 200, response.text
                published[version] = time.monotonic()
                body = response.json()
                assert (body["served_version"], body["tied"]) == (version, heads[version].tied)
                load.wait_for(100, version=version)
        index = admin.post("/v2/repository/index").json()
        assert index == [{"name": "head", "version": "3", "state": "READY", "reason": ""}]
        # The two replaced versions drain in the background, after the loads have answered.
        poll(lambda: True if _unloads(admin) >= 2 else None, "two versions released")
        assert _unloads(admin) == 2
    answers = load.answers
    _check(answers, expected)
    assert {a.version for a in answers} == {1, 2, 3}
    assert {a.tied for a in answers if a.version == 2} == {False}
    for version, when in published.items():
        late = {a.version for a in answers if a.started > when}
        assert min(late) >= version, (
            f"a request sent after v{version} was published saw v{min(late)}"
        )


def test_swap_through_poll_mode_under_load(tmp_path: Path, heads: dict[int, HeadWeights]) -> None:
    repository = tmp_path / "models"
    paths = {1: save_head(heads[1], repository / "head" / "1")}
    expected = {1: _expected(paths[1])}
    with running_server(repository, control_mode="poll", poll_interval_s="0.1") as url:
        load = Load(url)
        with load.running():
            load.wait_for(50)
            for version in (2, 3):
                incoming = repository / "head" / f".incoming-{version}"
                paths[version] = save_head(heads[version], incoming)
                incoming.rename(repository / "head" / str(version))
                expected[version] = _expected(repository / "head" / str(version) / "model.onnx")
                load.wait_for(50, version=version)
        index = httpx.post(f"{url}/v2/repository/index").json()
        assert index == [{"name": "head", "version": "3", "state": "READY", "reason": ""}]
    answers = load.answers
    _check(answers, expected)
    assert {a.version for a in answers} == {1, 2, 3}
