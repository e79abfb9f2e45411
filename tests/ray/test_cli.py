"""The README's Ray command as a user runs it: ``lmhead serve --ray`` starts a local Ray
cluster and serves the repository through Serve's proxy, read-only (replicas follow the
repository); Ctrl-C stops it and its cluster.

Runs before the three-node cluster of test_cluster.py starts (the fixture is created on first
use), so the two never share the machine's two cores.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from service.heads.files import HeadWeights, save_head
from tests.conftest import reference_logits
from tests.server import free_port, poll

ROWS, D_MODEL, VOCAB = 3, 32, 500


def _lmhead() -> str:
    return str(Path(sys.executable).with_name("lmhead"))


def test_lmhead_serve_ray_answers_as_the_reference_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    repository = tmp_path / "models"
    table = np.random.default_rng(3).standard_normal((VOCAB, D_MODEL)).astype(np.float32)
    save_head(HeadWeights.from_arrays(table), repository / "head" / "1")
    port = free_port()
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    command = [_lmhead(), "serve", "--ray", "--replicas", "1", "--repository", str(repository)]
    with (tmp_path / "serve.log").open("wb") as log:
        process = subprocess.Popen(
            [*command, "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**env, "RAY_USAGE_STATS_ENABLED": "0"},
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        poll(lambda: _ready(url, process, tmp_path / "serve.log"), "lmhead on Ray ready", 180)
        hidden = np.random.default_rng(4).standard_normal((ROWS, D_MODEL)).astype(np.float32)
        body = {"hidden_states": hidden.tolist(), "k": 1}
        response = httpx.post(f"{url}/v1/models/head/topk", json=body, timeout=30)
        assert response.status_code == 200, response.text
        assert response.headers["x-lmhead-replica"]
        expected = reference_logits(repository / "head" / "1", hidden).argmax(axis=1)
        assert [row["token_ids"][0] for row in response.json()["results"]] == expected.tolist()
        # Replicas follow the repository; a load/unload would reach only one of them: refused.
        unload = httpx.post(f"{url}/v2/repository/models/head/unload", timeout=30)
        assert unload.status_code == 403, unload.text
        process.send_signal(signal.SIGINT)  # Ctrl-C
        assert process.wait(timeout=120) in (0, -signal.SIGINT, 130)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health/ready", timeout=5)


def _ready(url: str, process: subprocess.Popen[bytes], log: Path) -> bool | None:
    if process.poll() is not None:
        raise AssertionError(f"lmhead serve --ray exited:\n{log.read_text(errors='replace')}")
    try:
        return httpx.get(f"{url}/health/ready", timeout=5).status_code == 200 or None
    except httpx.TransportError:
        return None
