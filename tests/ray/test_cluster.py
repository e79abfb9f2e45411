"""lmhead on a real three-node Ray cluster (tests/ray/conftest.py), through Serve's proxy.

Checked under load, with every answer compared to the numpy reference of the version it
names: replicas on several nodes; a version published to the shared repository reaches every
replica with no failed request; a worker node killed under load loses no request that the
client retried once; autoscaling goes up under load and back down; a multiplexed replica
loads the model a request names, and evicts the least recently used.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import pytest
import yaml
from ray import serve
from ray.serve.schema import ServeDeploySchema

from service.heads.files import HeadWeights, save_head
from service.hosting.rayserve import LMHead, build
from service.settings import Settings
from tests.conftest import reference_logits
from tests.ray.conftest import COUNTS, Cluster
from tests.server import free_port, poll

VOCAB, D_MODEL = 3000, 64
REPLICA_CPUS = 0.5


@dataclass
class Answer:
    status: int
    retried: bool
    version: int = 0
    replica: str = ""
    node: str = ""
    ids: list[int] = field(default_factory=list)


class Load:
    """Client threads posting one request each in a loop; a failed request is retried once,
    as a client of any replicated service does."""

    def __init__(self, url: str, hidden: npt.NDArray[np.float32], clients: int = 6) -> None:
        self.url, self.hidden, self.clients = url, hidden, clients
        self.answers: list[Answer] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> Load:
        for _ in range(self.clients):
            thread = threading.Thread(target=self._client, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)

    def _client(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                self.answers.append(request(client, self.url, self.hidden))

    @property
    def failed(self) -> list[Answer]:
        return [answer for answer in self.answers if answer.status != 200]

    def summary(self) -> str:
        retried = sum(answer.retried for answer in self.answers)
        return f"{len(self.answers)} requests, {retried} retried once, {len(self.failed)} failed"


def request(
    client: httpx.Client, url: str, hidden: npt.NDArray[np.float32], **headers: str
) -> Answer:
    """POST top-1 for ``hidden``; one retry on a transport error or a 5xx."""
    body = {"hidden_states": hidden.tolist(), "k": 1}
    for attempt in (0, 1):
        try:
            response = client.post(url, json=body, headers=headers)
        except httpx.TransportError:
            continue
        if response.status_code < 500 or attempt == 1:
            break
    else:
        return Answer(599, retried=True)
    if response.status_code != 200:
        return Answer(response.status_code, retried=attempt == 1)
    return Answer(
        200,
        attempt == 1,
        int(response.headers["x-lmhead-version"]),
        response.headers["x-lmhead-replica"],
        response.headers["x-lmhead-node"],
        [row["token_ids"][0] for row in response.json()["results"]],
    )


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tied`` (all versions served) and ``other``, on a path every node reads."""
    root = tmp_path_factory.mktemp("shared") / "models"
    rng = np.random.default_rng(0)
    save_head(HeadWeights.from_arrays(rng.standard_normal((VOCAB, D_MODEL))), root / "tied" / "1")
    (root / "tied" / "config.json").write_text(json.dumps({"versions": "all"}))
    weights = HeadWeights.from_arrays(
        rng.standard_normal((VOCAB, D_MODEL)), rng.standard_normal((VOCAB, D_MODEL))
    )
    save_head(weights, root / "other" / "1")
    return root


@pytest.fixture(scope="module")
def proxy(cluster: Cluster) -> Iterator[str]:
    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def deploy(repository: Path, max_models: int = 0, **options: Any) -> None:
    settings = {
        "repository": str(repository),
        "control_mode": "poll",
        "poll_interval_s": 0.5,
        "load_at_start": max_models == 0,
    }
    options.setdefault("ray_actor_options", {"num_cpus": REPLICA_CPUS})
    serve.run(LMHead.options(**options).bind(settings, max_models), name="lmhead", route_prefix="/")


def expected(repository: Path, model: str, version: int, hidden: npt.ArrayLike) -> list[int]:
    logits = reference_logits(repository / model / str(version), hidden)
    return [int(i) for i in logits.argmax(axis=1)]


def replica_count() -> int:
    status = serve.status().applications["lmhead"].deployments["Replica"]
    return int(status.replica_states.get("RUNNING", 0))


HIDDEN = np.random.default_rng(7).standard_normal((4, D_MODEL)).astype(np.float32)


def test_replicas_on_several_nodes_answer_as_the_reference(
    cluster: Cluster, proxy: str, repository: Path
) -> None:
    deploy(repository, num_replicas=3)
    url = f"{proxy}/v1/models/tied/topk"
    with Load(url, HIDDEN) as load:
        poll(lambda: len(load.answers) >= 90 or None, "90 answers", 60)
    assert not load.failed, load.failed[:3]
    assert {tuple(a.ids) for a in load.answers} == {tuple(expected(repository, "tied", 1, HIDDEN))}
    assert len({a.replica for a in load.answers}) == 3
    assert len({a.node for a in load.answers}) >= 2, {a.node for a in load.answers}


def test_a_published_version_reaches_every_replica_with_no_failed_request(
    cluster: Cluster, proxy: str, repository: Path
) -> None:
    deploy(repository, num_replicas=3)
    url = f"{proxy}/v1/models/tied/topk"
    with Load(url, HIDDEN) as load:
        poll(lambda: len({a.replica for a in load.answers}) == 3 or None, "3 replicas", 60)
        replicas = {a.replica for a in load.answers}
        staging = repository / "tied" / ".incoming"
        rng = np.random.default_rng(2)
        save_head(HeadWeights.from_arrays(rng.standard_normal((VOCAB, D_MODEL))), staging)
        staging.rename(repository / "tied" / "2")

        def everywhere() -> bool | None:
            on_two = {a.replica for a in load.answers if a.version == 2}
            return True if on_two >= replicas else None

        poll(everywhere, "version 2 on every replica", 90)
    COUNTS.append(f"version published to 3 replicas: {load.summary()}")
    assert not load.failed, load.failed[:3]
    for version in (1, 2):
        answers = [a for a in load.answers if a.version == version]
        assert answers, version
        assert {tuple(a.ids) for a in answers} == {
            tuple(expected(repository, "tied", version, HIDDEN))
        }
    with httpx.Client(timeout=30) as client:  # a client may pin the old version
        pinned = [request(client, url + "?version=1", HIDDEN) for _ in range(9)]
    assert {(a.status, a.version) for a in pinned} == {(200, 1)}


def test_a_killed_worker_node_loses_no_request_retried_once(
    cluster: Cluster, proxy: str, repository: Path
) -> None:
    deploy(repository, num_replicas=3)
    url = f"{proxy}/v1/models/other/topk"
    with Load(url, HIDDEN) as load:
        poll(lambda: len({a.node for a in load.answers}) >= 2 or None, "answers from 2 nodes", 60)
        before = len(load.answers)
        cluster.kill("worker-2")
        poll(lambda: replica_count() == 3 or None, "3 running replicas again", 120)
        poll(lambda: len(load.answers) >= before + 60 or None, "60 answers after the kill", 60)
    COUNTS.append(f"killed worker node: {load.summary()}")
    assert not load.failed, load.failed[:3]
    assert {tuple(a.ids) for a in load.answers} == {tuple(expected(repository, "other", 1, HIDDEN))}


def test_autoscaling_adds_replicas_under_load_and_removes_them_after(
    cluster: Cluster, proxy: str, repository: Path
) -> None:
    deploy(
        repository,
        autoscaling_config={
            "min_replicas": 1,
            "max_replicas": 3,
            "target_ongoing_requests": 2,
            "upscale_delay_s": 1,
            "downscale_delay_s": 3,
            "look_back_period_s": 12,  # must exceed the (deprecated) metrics_interval_s
        },
        max_ongoing_requests=8,
    )
    poll(lambda: replica_count() == 1 or None, "one replica at the start", 60)
    url = f"{proxy}/v1/models/tied/topk"
    with Load(url, HIDDEN, clients=12) as load:
        peak = poll(lambda: replica_count() if replica_count() >= 2 else None, "scale-up", 90)
    poll(lambda: replica_count() == 1 or None, "back to one replica", 90)
    COUNTS.append(f"autoscaling 1 -> {peak} -> 1 replicas: {load.summary()}")
    assert not load.failed, load.failed[:3]


def test_a_multiplexed_replica_loads_what_is_asked_and_evicts_the_oldest(
    cluster: Cluster, proxy: str, repository: Path
) -> None:
    deploy(repository, max_models=1, num_replicas=1)
    with httpx.Client(timeout=60) as client:
        listed = client.get(f"{proxy}/v1/models").json()["models"]
        assert listed == []  # nothing loaded at start
        for model in ("tied", "other"):
            answer = request(
                client, f"{proxy}/v1/models/{model}/topk", HIDDEN, serve_multiplexed_model_id=model
            )
            assert answer.status == 200
            latest = max(int(v.name) for v in (repository / model).iterdir() if v.name.isdigit())
            assert answer.ids == expected(repository, model, latest, HIDDEN)
            states = {
                m["name"]: m["state"] for m in client.get(f"{proxy}/v1/models").json()["models"]
            }
            ready = [name for name, state in states.items() if state == "READY"]
            assert ready == [model]  # one model per replica: the other was evicted
        assert states["tied"] == "UNAVAILABLE"  # unloaded, as the control API leaves it


def test_the_serve_config_file_is_valid_and_builds() -> None:
    path = Path(__file__).resolve().parents[2] / "deploy" / "ray" / "serve.yaml"
    config = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text(encoding="utf-8")))
    (application,) = config.applications
    assert application.import_path == "service.hosting.rayserve:build"
    (deployment,) = application.deployments
    assert deployment.name == LMHead.name
    for name in application.runtime_env["env_vars"]:
        assert name.removeprefix("LMHEAD_").lower() in Settings.model_fields
    assert set(application.args) <= set(Settings.model_fields)
    assert build(application.args) is not None
    with pytest.raises(ValueError, match=r"unknown args \['repositry'\]"):  # was dropped
        build({"repositry": "/shared/models"})
