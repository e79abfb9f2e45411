"""The repository API: failed loads keep the old version serving; auth; read-only; names."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import numpy.typing as npt
import onnx
import pytest

from service.heads import DATA_FILE
from service.heads.files import HeadWeights, save_head
from tests.conftest import D_MODEL
from tests.server import running_server

TOKEN = "s3cret-admin-token"


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory, table: npt.NDArray[np.float32]) -> Path:
    root = tmp_path_factory.mktemp("models")
    save_head(HeadWeights.from_arrays(table), root / "head" / "1")
    (root / "head" / "config.json").write_text(json.dumps({"d_model": D_MODEL}))
    return root


@pytest.fixture(scope="module")
def admin(repository: Path) -> Iterator[httpx.Client]:
    with (
        running_server(repository, admin_token=TOKEN) as url,
        httpx.Client(base_url=url, headers={"authorization": f"Bearer {TOKEN}"}) as client,
    ):
        yield client


def _truncated(directory: Path, table: npt.NDArray[np.float32]) -> None:
    path = save_head(HeadWeights.from_arrays(table), directory)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _wrong_d_model(directory: Path, table: npt.NDArray[np.float32]) -> None:
    save_head(HeadWeights.from_arrays(table[:, :16]), directory)


def _missing_data(directory: Path, table: npt.NDArray[np.float32]) -> None:
    save_head(HeadWeights.from_arrays(table), directory, external_data=True)
    (directory / DATA_FILE).unlink()


def _escaping_data(directory: Path, table: npt.NDArray[np.float32]) -> None:
    path = save_head(HeadWeights.from_arrays(table), directory, external_data=True)
    shutil.move(directory / DATA_FILE, directory.parent / "stolen.data")
    model = onnx.load(str(path), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "../stolen.data"
    onnx.save_model(model, path)


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (_truncated, "not a readable ONNX model"),
        (_wrong_d_model, f"config.json requires {D_MODEL}"),
        (_missing_data, "model.onnx.data"),
        (_escaping_data, "must be a file beside the model"),
    ],
    ids=["truncated file", "wrong d_model vs config", "missing data file", "data outside folder"],
)
def test_a_failed_load_keeps_the_old_version_serving(
    admin: httpx.Client,
    repository: Path,
    table: npt.NDArray[np.float32],
    make: object,
    reason: str,
) -> None:
    version_dir = repository / "head" / "2"
    assert callable(make)
    make(version_dir, table)
    try:
        response = admin.post("/v1/repository/models/head/load")
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "model_load_failed"
        assert reason in error["message"]
        assert "keeps serving" in error["message"]
        v2 = admin.post("/v2/repository/models/head/load")  # Triton's error shape on /v2
        assert v2.status_code == 400
        assert reason in v2.json()["error"]
        rows = {row["version"]: row for row in admin.post("/v2/repository/index").json()}
        assert rows["1"]["state"] == "READY"
        assert reason in rows["1"]["reason"]  # serving, and why the new version is not
        assert rows["2"]["state"] == "FAILED"
        assert reason in rows["2"]["reason"]
        answer = admin.post(
            "/v1/models/head/topk", json={"hidden_states": table[:1].tolist(), "k": 1}
        )
        assert answer.status_code == 200
        assert answer.json()["version"] == 1
        assert answer.json()["results"][0]["token_ids"] == [0]
    finally:
        shutil.rmtree(version_dir)
        (repository / "head" / "stolen.data").unlink(missing_ok=True)


def test_a_version_can_be_pinned(
    admin: httpx.Client, repository: Path, table: npt.NDArray[np.float32]
) -> None:
    save_head(HeadWeights.from_arrays(table * 2), repository / "head" / "5")
    try:
        latest = admin.post("/v2/repository/models/head/load").json()
        assert latest["served_version"] == 5
        pinned = admin.post("/v2/repository/models/head/load", json={"version": 1}).json()
        assert (pinned["served_version"], pinned["pinned_version"]) == (1, 1)
        missing = admin.post("/v2/repository/models/head/load", json={"version": 9})
        assert missing.status_code == 404  # the caller's mistake, not a failed load
        assert "no complete version 9" in missing.json()["error"]
        native = admin.post("/v1/repository/models/head/load", json={"version": 9})
        assert native.json()["error"]["code"] == "version_not_found"
        still = admin.get("/v1/models/head").json()
        assert still["served_version"] == 1  # the pinned version keeps serving
    finally:
        shutil.rmtree(repository / "head" / "5")
        assert admin.post("/v2/repository/models/head/load").json()["served_version"] == 1


def test_control_options_in_the_query_are_refused_not_ignored(admin: httpx.Client) -> None:
    """``?version=1`` (as inference routes take it) would load the latest and drop a pin."""
    for prefix in ("/v1", "/v2"):
        refused = admin.post(f"{prefix}/repository/models/head/load?version=1")
        assert refused.status_code in (400, 422), refused.text
        assert "take no query parameters (got 'version')" in refused.text
    big = admin.post("/v1/repository/models/head/load", content=b" " * 70_000)
    assert big.status_code == 413
    assert "the control API's own limit" in big.json()["error"]["message"]
    assert admin.get("/v1/models/head").json()["state"] == "READY"


def test_unload_with_a_body_it_does_not_understand_unloads_nothing(admin: httpx.Client) -> None:
    body = {"hidden_states": [[0.5] * D_MODEL]}
    for content in (b"xx", b'{"zzz": 1}', b"[1]"):
        refused = admin.post("/v2/repository/models/head/unload", content=content)
        assert refused.status_code == 400, refused.text
        native = admin.post("/v1/repository/models/head/unload", content=content)
        assert native.status_code in (400, 422), native.text
        assert admin.post("/v1/models/head/topk", json=body).status_code == 200


def test_unload_then_load_again(admin: httpx.Client) -> None:
    body = {"hidden_states": [[0.5] * D_MODEL]}
    unloaded = admin.post("/v1/repository/models/head/unload")
    assert unloaded.status_code == 200
    assert unloaded.json()["state"] == "UNAVAILABLE"
    gone = admin.post("/v1/models/head/topk", json=body)
    assert gone.status_code == 503
    assert admin.post("/v2/repository/index").json()[0]["state"] == "UNAVAILABLE"
    assert admin.post("/v2/repository/index", json={"ready": True}).json() == []
    assert admin.post("/v2/repository/index?ready=true").status_code == 400  # not ignored
    assert admin.post("/v2/repository/models/head/load").status_code == 200
    assert admin.post("/v1/models/head/topk", json=body).status_code == 200


@pytest.mark.parametrize(
    "headers", [{}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}]
)
def test_missing_or_wrong_token_is_401(admin: httpx.Client, headers: dict[str, str]) -> None:
    for action in ("index", "models/head/load", "models/head/unload"):
        response = httpx.post(f"{admin.base_url}/v2/repository/{action}", headers=headers)
        assert response.status_code == 401, action
        assert response.headers["www-authenticate"] == "Bearer"
        assert "Authorization: Bearer" in response.json()["error"]
        native = httpx.post(f"{admin.base_url}/v1/repository/{action}", headers=headers)
        assert native.status_code == 401, action
        assert native.json()["error"]["code"] == "unauthorized"
    inference = httpx.post(
        f"{admin.base_url}/v1/models/head/topk", json={"hidden_states": [[0.1] * D_MODEL]}
    )
    assert inference.status_code == 200  # only the repository API is guarded; still served


@pytest.mark.parametrize("name", ["%2E%2E", ".hidden", "-dash", "a%20b", "x" * 200])
def test_names_that_could_escape_are_400(admin: httpx.Client, name: str) -> None:
    response = admin.post(f"/v1/repository/models/{name}/load")
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_model_name"
    v2 = admin.post(f"/v2/repository/models/{name}/load")
    assert v2.status_code == 400
    assert "invalid model name" in v2.json()["error"]
    body = {"hidden_states": [[0.1] * D_MODEL]}
    inference = admin.post(f"/v1/models/{name}/topk", json=body)
    if inference.status_code != 404:  # a path the router does not take (".." and the like)
        assert inference.status_code == 400, inference.text
        assert inference.json()["error"]["code"] == "invalid_model_name"


def test_a_symlink_out_of_the_repository_is_refused(
    admin: httpx.Client, repository: Path, tmp_path: Path, table: npt.NDArray[np.float32]
) -> None:
    save_head(HeadWeights.from_arrays(table), tmp_path / "outside" / "1")
    os.symlink(tmp_path / "outside", repository / "evil")
    try:
        response = admin.post("/v2/repository/models/evil/load")
        assert response.status_code == 400
        assert "outside the repository" in response.json()["error"]
        assert (
            admin.post(
                "/v1/models/evil/topk", json={"hidden_states": [[0.0] * D_MODEL]}
            ).status_code
            == 503
        )
    finally:
        (repository / "evil").unlink()


def test_loading_a_model_that_does_not_exist_is_404_and_leaves_no_record(
    admin: httpx.Client,
) -> None:
    before = admin.get("/metrics").text
    for name in ("nothing-here", "junk-1", "junk-2"):
        response = admin.post(f"/v2/repository/models/{name}/load")
        assert response.status_code == 404
        assert "no model directory" in response.json()["error"]
    assert "nothing-here" not in str(admin.post("/v2/repository/index").json())
    assert "junk-1" not in admin.get("/v1/models").text
    assert admin.get("/metrics").text.count("junk") == before.count("junk") == 0


def test_read_only_service_refuses_load_and_unload(repository: Path) -> None:
    with running_server(repository, read_only="true") as url:
        for action in ("load", "unload"):
            response = httpx.post(f"{url}/v1/repository/models/head/{action}")
            assert response.status_code == 403
            assert response.json()["error"]["code"] == "forbidden"
        assert httpx.post(f"{url}/v2/repository/index").status_code == 200


def test_exposed_admin_api_without_token_refuses_to_start(repository: Path) -> None:
    command = [sys.executable, "-m", "service", "serve", "--repository", str(repository)]
    completed = subprocess.run(
        [*command, "--host", "0.0.0.0", "--port", "0"], capture_output=True, text=True, timeout=60
    )
    assert completed.returncode == 2
    assert "set LMHEAD_ADMIN_TOKEN" in completed.stderr
    assert "Traceback" not in completed.stderr
