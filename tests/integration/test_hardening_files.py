"""Hostile files and careless operators, against a real server on real files.

Classes of issue 13: files changed under a served version (1), models that load but could not
serve (5), the repository and control API (6), start-up failures (7).
"""

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

from service.heads import DATA_FILE, MODEL_FILE
from service.heads.files import HeadWeights, save_head
from service.heads.graph import EMBEDDING_WEIGHT
from service.heads.reference import top_k
from service.repository.disk import CONFIG_FILE
from tests.conftest import D_MODEL, reference_logits
from tests.server import (
    anonymous_peak,
    anonymous_resident,
    live_server,
    poll,
    running_server,
    server_process,
)

HIDDEN = np.random.default_rng(11).standard_normal((3, D_MODEL)).astype(np.float32)


def _top(client: httpx.Client, model: str) -> list[list[int]]:
    answer = client.post(f"/v1/models/{model}/topk", json={"hidden_states": HIDDEN.tolist()})
    assert answer.status_code == 200, answer.text
    ids: list[list[int]] = [row["token_ids"] for row in answer.json()["results"]]
    return ids


def _expected(version_dir: Path) -> list[list[int]]:
    ids: list[list[int]] = top_k(reference_logits(version_dir, HIDDEN), 5)[1].tolist()
    return ids


@pytest.fixture
def served(
    tmp_path: Path, table: npt.NDArray[np.float32], output_weight: npt.NDArray[np.float32]
) -> Iterator[tuple[Path, httpx.Client]]:
    root = tmp_path / "models"
    save_head(HeadWeights.from_arrays(table), root / "ext" / "1", external_data=True)
    save_head(HeadWeights.from_arrays(table, output_weight), root / "untied" / "1")
    with running_server(root) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield root, client


def test_truncating_or_overwriting_a_served_version_changes_nothing_it_answers(
    served: tuple[Path, httpx.Client], output_weight: npt.NDArray[np.float32]
) -> None:
    """`cp` over a served model.onnx.data used to kill the process (SIGBUS) or change answers
    under the same version number; the service answers from its own copy, until a load."""
    root, client = served
    version = root / "ext" / "1"
    original = _expected(version)
    assert _top(client, "ext") == original
    data = version / DATA_FILE
    with data.open("r+b") as stream:
        stream.truncate(data.stat().st_size // 3)  # what `cp` over the file does first
    assert _top(client, "ext") == original
    assert _top(client, "untied") == _expected(root / "untied" / "1")  # nobody went down
    other = root / "staging"
    save_head(HeadWeights.from_arrays(output_weight), other, external_data=True)
    shutil.copyfile(other / DATA_FILE, data)  # same size, other weights, same version
    assert _top(client, "ext") == original  # never mixed: still the copy it loaded
    loaded = client.post("/v2/repository/models/ext/load")
    assert loaded.status_code == 200
    assert "version 1's files changed on disk: loaded again" in loaded.json()["notes"]
    assert _top(client, "ext") == _expected(version) != original


@pytest.mark.xdist_group("measure")  # a server's memory (tests/conftest.py)
def test_a_tied_head_from_a_private_copy_keeps_the_memory_promise(
    tmp_path: Path,
) -> None:
    """Loading from a private copy: tied shared <= 1.15x W resident, and the anonymous memory
    held at any moment of the load <= 1.3x W (the weight file's clean pages, mapped while
    onnxruntime packs them, come and go with the page cache: see ``anonymous_peak``)."""
    vocab, d_model = 50257, 768
    weight_bytes = vocab * d_model * 4
    table = np.random.default_rng(0).standard_normal((vocab, d_model), dtype=np.float32)
    root = tmp_path / "models"
    root.mkdir()
    with (
        running_server(root, provider="cpu") as url,
        httpx.Client(base_url=url, timeout=120) as client,
    ):
        server = server_process(url)
        before, anonymous_before = server.memory_info().rss, anonymous_resident(server)
        save_head(HeadWeights.from_arrays(table), root / "big" / "1", external_data=True)
        loaded, anonymous = anonymous_peak(
            server, lambda: client.post("/v2/repository/models/big/load")
        )
        assert loaded.status_code == 200
        body = {"hidden_states": table[:4].tolist(), "k": 3}
        assert client.post("/v1/models/big/topk", json=body).status_code == 200
        resident = (server.memory_info().rss - before) / weight_bytes
    peak = (anonymous - anonymous_before) / weight_bytes
    print(f"\nloaded from a private copy: resident {resident:.2f} W, load peak +{peak:.2f} W")
    assert resident <= 1.15
    assert peak <= 1.3


def _bad_transforms(directory: Path, table: npt.NDArray[np.float32]) -> None:
    path = save_head(HeadWeights.from_arrays(table), directory)
    model = onnx.load(str(path))
    for prop in model.metadata_props:
        if prop.key == "lmhead.transforms":
            prop.value = "1"
    onnx.save(model, str(path))


def _nan_weight(directory: Path, table: npt.NDArray[np.float32]) -> None:
    """A head exported with one NaN in W (``lmhead import`` refuses such weights; another
    exporter might not)."""
    path = save_head(HeadWeights.from_arrays(table), directory)
    model = onnx.load(str(path))
    (weight,) = [i for i in model.graph.initializer if i.name == EMBEDDING_WEIGHT]
    values = onnx.numpy_helper.to_array(weight).copy()
    values[5, 2] = np.nan
    weight.CopyFrom(onnx.numpy_helper.from_array(values, weight.name))
    onnx.save(model, str(path))


def test_models_that_could_not_serve_fail_at_load_with_the_reason(
    tmp_path: Path, table: npt.NDArray[np.float32]
) -> None:
    root = tmp_path / "models"
    _bad_transforms(root / "bad-metadata" / "1", table)
    save_head(HeadWeights.from_arrays(table), root / "big-k" / "1")
    (root / "big-k" / CONFIG_FILE).write_text(json.dumps({"default_k": 60}))
    _nan_weight(root / "nan-weight" / "1", table)
    save_head(HeadWeights.from_arrays(table), root / "fine" / "1")
    with running_server(root, max_k="50") as url:
        models = {m["name"]: m for m in httpx.get(f"{url}/v1/models").json()["models"]}
    assert models["bad-metadata"]["state"] == "FAILED"
    assert "lmhead.transforms must be an object" in models["bad-metadata"]["reason"]
    assert models["big-k"]["state"] == "FAILED"
    assert "default_k 60 is above LMHEAD_MAX_K (50)" in models["big-k"]["reason"]
    assert models["nan-weight"]["state"] == "FAILED"
    assert "weights hold NaN/Inf" in models["nan-weight"]["reason"]
    assert models["fine"]["state"] == "READY"


def test_repository_tricks_are_refused_and_reasons_name_no_machine_path(
    tmp_path: Path, table: npt.NDArray[np.float32]
) -> None:
    root = tmp_path / "models"
    outside = tmp_path / "outside"
    save_head(HeadWeights.from_arrays(table), outside / "1")
    (outside / CONFIG_FILE).write_text(json.dumps({"default_k": 3}))
    (root / "linked-model" / "1").mkdir(parents=True)
    (root / "linked-model" / "1" / MODEL_FILE).symlink_to(outside / "1" / MODEL_FILE)
    save_head(HeadWeights.from_arrays(table), root / "linked-config" / "1")
    (root / "linked-config" / CONFIG_FILE).symlink_to(outside / CONFIG_FILE)
    fifo_dir = root / "fifo" / "1"
    save_head(HeadWeights.from_arrays(table), fifo_dir, external_data=True)
    (fifo_dir / DATA_FILE).unlink()
    os.mkfifo(fifo_dir / DATA_FILE)  # used to block the loader forever
    save_head(HeadWeights.from_arrays(table), root / "fine" / "1")
    with running_server(root) as url, httpx.Client(base_url=url) as client:
        models = {m["name"]: m for m in client.get("/v1/models").json()["models"]}
        newline = client.post("/v2/repository/models/fine%0a/load")
        rows = client.post("/v2/repository/index").json()
    for name, why in (
        (
            "linked-model",
            "linked-model/1/model.onnx is a link that resolves outside the repository",
        ),
        (
            "linked-config",
            "linked-config/config.json is a link that resolves outside the repository",
        ),
        ("fifo", "fifo/1/model.onnx.data is not a regular file"),
    ):
        assert models[name]["state"] == "FAILED", name
        assert why in models[name]["reason"], models[name]["reason"]
        assert "models/" not in models[name]["reason"]  # paths start inside the repository
    assert models["fine"]["state"] == "READY"
    assert newline.status_code == 400
    reasons = " ".join(row["reason"] for row in rows)
    assert str(tmp_path) not in reasons
    assert "/tmp/" not in reasons


def test_a_bad_version_directory_fails_that_version_only(
    tmp_path: Path, table: npt.NDArray[np.float32]
) -> None:
    """A version directory linked out of the repository, or two directories that are one
    version ("3" and "0003"), fail those versions; version 1 serves, at start-up and after,
    and a load says that the version its policy picked failed."""
    root = tmp_path / "models"
    save_head(HeadWeights.from_arrays(table), root / "m" / "1")
    save_head(HeadWeights.from_arrays(table * 2), tmp_path / "outside" / "2")
    (root / "m" / "2").symlink_to(tmp_path / "outside" / "2")
    save_head(HeadWeights.from_arrays(table * 3), root / "m" / "3")
    save_head(HeadWeights.from_arrays(table * 4), root / "m" / "0003")
    with running_server(root) as url, httpx.Client(base_url=url) as client:
        model = client.get("/v1/models/m").json()
        reload = client.post("/v2/repository/models/m/load")
        pinned = client.post("/v2/repository/models/m/load", json={"version": 2})
        served = client.post("/v1/models/m/topk", json={"hidden_states": HIDDEN.tolist()})
        asked = client.post("/v1/models/m/versions/2/topk", json={"hidden_states": HIDDEN.tolist()})
    assert (model["state"], model["served_version"]) == ("READY", 1)
    failed = model["failed_versions"]
    assert "resolves outside the repository" in failed["2"]
    assert "are all version 3" in failed["3"]
    # a reload the policy's choice (3) failed, as a broken model file would: 400, 1 serves on
    assert reload.status_code == 400
    assert "are all version 3" in reload.json()["error"]
    assert (served.status_code, served.json()["version"]) == (200, 1)
    assert pinned.status_code == 404  # no such version, and why
    assert "resolves outside the repository" in pinned.json()["error"]  # V2: a string
    assert asked.status_code == 503
    assert "resolves outside" in asked.json()["error"]["message"]


def test_a_bad_directory_beside_the_served_version_never_rolls_it_back(
    tmp_path: Path, table: npt.NDArray[np.float32]
) -> None:
    """Version 2 serves; a copy of it named "02" makes version 2 ambiguous: version 2 keeps
    serving (the reload says why it did not change), it does not fall back to version 1."""
    root = tmp_path / "models"
    save_head(HeadWeights.from_arrays(table), root / "m" / "1")
    save_head(HeadWeights.from_arrays(table * 2), root / "m" / "2")
    with running_server(root) as url, httpx.Client(base_url=url) as client:
        shutil.copytree(root / "m" / "2", root / "m" / "02")
        reload = client.post("/v2/repository/models/m/load")
        model = client.get("/v1/models/m").json()
    assert reload.status_code == 400  # a load that changed nothing, as for a broken version
    assert "previous version keeps serving" in reload.json()["error"]
    assert (model["served_version"], model["versions"]) == (2, [2])
    assert "are all version 2" in model["failed_versions"]["2"]


def test_config_edits_are_picked_up_by_load(
    served: tuple[Path, httpx.Client], table: npt.NDArray[np.float32]
) -> None:
    root, client = served
    assert client.get("/v1/models/untied").json()["default_k"] == 5
    (root / "untied" / CONFIG_FILE).write_text(json.dumps({"default_k": 2}))
    assert client.post("/v2/repository/models/untied/load").status_code == 200
    assert client.get("/v1/models/untied").json()["default_k"] == 2
    answer = client.post("/v1/models/untied/topk", json={"hidden_states": HIDDEN.tolist()})
    assert [len(row["token_ids"]) for row in answer.json()["results"]] == [2, 2, 2]


def test_cross_site_browser_requests_cannot_use_the_control_api(
    served: tuple[Path, httpx.Client],
) -> None:
    _, client = served
    simple = {"content-type": "text/plain", "origin": "http://evil.example"}
    assert client.post("/v2/repository/models/untied/unload", headers=simple).status_code == 403
    fetch = {"sec-fetch-site": "cross-site"}
    assert client.post("/v1/repository/models/untied/load", headers=fetch).status_code == 403
    assert client.get("/v1/models/untied").json()["state"] == "READY"  # nothing happened
    assert client.post("/v2/repository/index").status_code == 200  # curl, no Origin: fine


def _settled_readiness(url: str) -> httpx.Response:
    """Readiness once start-up has ended one way or the other (not "still loading")."""

    def settled() -> httpx.Response | None:
        answer = httpx.get(f"{url}/health/ready")
        return None if "still loading" in answer.text else answer

    return poll(settled, "start-up to end")


def test_a_service_whose_every_model_failed_is_not_ready(
    tmp_path: Path, table: npt.NDArray[np.float32]
) -> None:
    """It answered ready while serving nothing: a bad image or a full GPU rolled out across
    every replica, and the load balancer sent them traffic they answered 503."""
    broken = tmp_path / "broken" / "1"
    broken.mkdir(parents=True)
    (broken / MODEL_FILE).write_bytes(b"not an onnx file")
    with live_server(tmp_path) as (url, _):
        ready = _settled_readiness(url)
        assert ready.status_code == 503
        assert "no model could be loaded (broken: " in ready.json()["error"]["message"]
        assert httpx.get(f"{url}/v2/health/ready").status_code == 503
        save_head(HeadWeights.from_arrays(table), tmp_path / "good" / "1")
        assert httpx.post(f"{url}/v1/repository/models/good/load").status_code == 200
        assert httpx.get(f"{url}/health/ready").json()["models"] == {
            "broken": "FAILED",
            "good": "READY",
        }


def test_a_repository_that_is_not_there_is_refused_at_start(tmp_path: Path) -> None:
    """It ran "not ready" for good (a typo'd volume path); now it says so and exits, as a
    bad setting does."""
    command = [sys.executable, "-m", "service", "serve", "--repository", str(tmp_path / "typo")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "typo (LMHEAD_REPOSITORY or --repository) is not a directory" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "typo").exists()


def test_failing_to_write_the_demo_heads_is_logged_and_reported(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("the repository cannot be made under a file")
    with live_server(blocker / "models", create_demo_models="true") as (url, log):
        ready = _settled_readiness(url)
        logged = log()
    assert ready.status_code == 503
    message = ready.json()["error"]["message"]
    assert message.startswith("start-up failed:")
    assert "start-up failed" in logged
    assert "Traceback" in logged  # the cause is in the log, not in the answer
    assert "Traceback" not in message
