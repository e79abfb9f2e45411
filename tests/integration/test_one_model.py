"""One model per server, as KServe runs a runtime: ``lmhead serve --model-name NAME``.

The pod serves the repository's ``NAME`` only (V2 clients address it by the InferenceService
name), and a name the repository lacks is a start-up failure readiness reports, never an
empty healthy server.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import numpy.typing as npt

from tests.conftest import D_MODEL, reference_logits, write_tied_and_untied
from tests.server import live_server, running_server


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
    with live_server(tmp_path, model_name="missing") as (url, _):
        ready = httpx.get(f"{url}/health/ready")
        assert ready.status_code == 503
        assert "'missing'" in ready.text
        assert "tied" in ready.text  # what the repository does hold
