"""A web page whose name is made to resolve to 127.0.0.1 (DNS rebinding) sends requests the
browser takes for same-origin ones: refused by the Host they carry, before any route runs,
on every HTTP front end (one process, and the fronts of LMHEAD_WORKERS > 1). Control calls
take JSON bodies only, so a page's "simple" text/plain or form POST is refused as well."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import numpy.typing as npt
import pytest

from service.heads.files import HeadWeights, save_head
from tests.conftest import D_MODEL
from tests.server import running_server

EVIL = "rebind.evil.example"
UNLOAD = "/v2/repository/models/untied/unload"
HIDDEN = np.ones((1, D_MODEL), np.float32).tolist()


@pytest.fixture(scope="module")
def repository(
    tmp_path_factory: pytest.TempPathFactory,
    table: npt.NDArray[np.float32],
    output_weight: npt.NDArray[np.float32],
) -> Path:
    root = tmp_path_factory.mktemp("hosts")
    save_head(HeadWeights.from_arrays(table, output_weight), root / "untied" / "1")
    return root


@pytest.fixture(scope="module", params=["one process", "two fronts"])
def client(request: pytest.FixtureRequest, repository: Path) -> Iterator[httpx.Client]:
    workers = "2" if request.param == "two fronts" else "1"
    with running_server(repository, workers=workers) as url, httpx.Client(base_url=url) as c:
        yield c


def _port(client: httpx.Client) -> int:
    port = client.base_url.port
    assert port is not None
    return port


@pytest.mark.parametrize("origin", [True, False], ids=["with Origin", "without Origin"])
def test_a_rebound_page_cannot_unload_a_model(client: httpx.Client, origin: bool) -> None:
    """The probe's curl: Host and Origin both the page's name, a text/plain body."""
    host = f"{EVIL}:{_port(client)}"
    headers = {"host": host, "content-type": "text/plain"}
    if origin:
        headers["origin"] = f"http://{host}"
    refused = client.post(UNLOAD, headers=headers)
    assert refused.status_code == 400
    assert EVIL in refused.json()["error"]  # V2 paths: the protocol's error shape
    assert "LMHEAD_ALLOWED_HOSTS" in refused.json()["error"]
    native = client.post("/v1/repository/models/untied/unload", headers=headers)
    assert native.json()["error"]["code"] == "host_not_allowed"
    assert client.get("/v1/models/untied").json()["state"] == "READY"  # nothing happened


def test_every_route_is_refused_for_a_foreign_host(client: httpx.Client) -> None:
    """Inference routes (served ahead of FastAPI's middleware) and metadata alike."""
    foreign = {"host": f"{EVIL}:{_port(client)}"}
    topk = client.post("/v1/models/untied/topk", json={"hidden_states": HIDDEN}, headers=foreign)
    assert topk.status_code == 400
    assert client.get("/v1/models", headers=foreign).status_code == 400
    assert client.get("/health/ready", headers={"host": EVIL}).status_code == 400
    for name in ("localhost", "127.0.0.1"):
        assert client.get("/v1/models", headers={"host": f"{name}:{_port(client)}"}).is_success


def test_control_calls_take_json_bodies_only(client: httpx.Client) -> None:
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        refused = client.post(
            "/v1/repository/models/untied/load",
            content=b'{"version": 1}',
            headers={"content-type": content_type},
        )
        assert refused.status_code == 415, content_type
        assert "application/json" in refused.json()["error"]["message"]
    pinned = client.post("/v1/repository/models/untied/load", json={"version": 1})
    assert pinned.json()["pinned_version"] == 1
    assert client.post("/v1/repository/models/untied/load").status_code == 200  # no body


def test_allowed_hosts_adds_names(repository: Path) -> None:
    with running_server(repository, allowed_hosts=f"{EVIL},127.0.0.1") as url:
        port = httpx.URL(url).port
        answer = httpx.get(f"{url}/v1/models/untied", headers={"host": f"{EVIL}:{port}"})
        assert answer.json()["state"] == "READY"
        other = httpx.get(f"{url}/v1/models/untied", headers={"host": f"localhost:{port}"})
        assert other.status_code == 400
