"""One model per server, as KServe runs a runtime: ``lmhead serve --model-name NAME``.

The pod serves the repository's ``NAME`` only (V2 clients address it by the InferenceService
name), and a name the repository lacks is a start-up failure readiness reports, never an
empty healthy server.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import numpy as np
import numpy.typing as npt

from tests.conftest import D_MODEL, reference_logits, write_tied_and_untied
from tests.server import live_server, poll, running_server


def test_only_the_named_model_is_served(
    tmp_path: Path, table: npt.NDArray[np.float32], output_weight: npt.NDArray[np.float32]
) -> None:
    write_tied_and_untied(tmp_path, table, output_weight)
    hidden = np.random.default_rng(3).standard_normal((2, D_MODEL)).astype(np.float32)
    with running_server(tmp_path, model_name="untied", read_only="false") as url:
        models = httpx.get(f"{url}/v1/models").json()
        assert [m["name"] for m in models["models"]] == ["untied"]
        body = {
            "inputs": [
                {"name": "hidden_states", "shape": [2, D_MODEL], "datatype": "FP32",
                 "data": hidden.reshape(-1).tolist()}
            ],
            "parameters": {"k": 1},
        }  # fmt: skip
        answer = httpx.post(f"{url}/v2/models/untied/infer", json=body).json()
        ids = next(o for o in answer["outputs"] if o["name"] == "topk_token_ids")["data"]
        expected = reference_logits(tmp_path / "untied" / "1", hidden).argmax(axis=1)
        assert ids == expected.tolist()
        assert httpx.post(f"{url}/v2/models/tied/infer", json=body).status_code == 404
        assert httpx.get(f"{url}/v2/models/tied/ready").status_code == 404
        index = httpx.post(f"{url}/v2/repository/index").json()
        assert {row["name"] for row in index} == {"untied"}


def test_a_name_the_repository_lacks_fails_start_up_visibly(
    tmp_path: Path, table: npt.NDArray[np.float32], output_weight: npt.NDArray[np.float32]
) -> None:
    write_tied_and_untied(tmp_path, table, output_weight)
    with live_server(tmp_path, model_name="missing") as (url, log):
        ready = httpx.get(f"{url}/health/ready")
        assert ready.status_code == 503
        assert "'missing'" in ready.text
        assert "tied" in ready.text  # what the repository does hold
        assert "start-up failed: LMHEAD_MODEL_NAME is 'missing'" in log()
        assert "Traceback" not in log()  # the message is the whole story


def _scans(url: str) -> float:
    (line,) = [
        line
        for line in httpx.get(f"{url}/metrics").text.splitlines()
        if line.startswith("lmhead_repository_scans_total")
    ]
    return float(line.split()[-1])


def test_started_empty_only_models_asked_for_follow_the_repository(
    tmp_path: Path, table: npt.NDArray[np.float32], output_weight: npt.NDArray[np.float32]
) -> None:
    """LMHEAD_LOAD_AT_START=false (Ray Serve multiplexing): nothing loads at start, a load call
    loads one model, and new versions are followed for that model alone."""
    write_tied_and_untied(tmp_path, table, output_weight)
    settings = {"load_at_start": "false", "control_mode": "poll", "poll_interval_s": "0.05"}
    with running_server(tmp_path, **settings) as url:
        states = {m["name"]: m["state"] for m in httpx.get(f"{url}/v1/models").json()["models"]}
        assert states == {}
        assert httpx.post(f"{url}/v2/repository/models/tied/load").status_code == 200
        for name in ("tied", "untied"):  # publish version 2 of both: copy, then rename
            shutil.copytree(tmp_path / name / "1", tmp_path / name / ".incoming")
            (tmp_path / name / ".incoming").rename(tmp_path / name / "2")
        start = _scans(url)
        poll(lambda: _scans(url) >= start + 3 or None, "three repository scans")
        models = {m["name"]: m for m in httpx.get(f"{url}/v1/models").json()["models"]}
        assert set(models) == {"tied"}
        assert (models["tied"]["state"], models["tied"]["served_version"]) == ("READY", 2)
