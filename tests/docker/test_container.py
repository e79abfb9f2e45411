"""The built image and the compose service, over real HTTP (run by .ci/docker).

These tests are collected only when ``LMHEAD_DOCKER_URL`` is set (tests/conftest.py): they
need a container that ``.ci/docker`` started. ``LMHEAD_COMPOSE_URL`` and
``LMHEAD_COMPOSE_MODELS`` (the host directory mounted as /models) enable the swap test.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton

from service.tools.demo import demo_tokens

HIDDEN = np.random.default_rng(5).standard_normal((2, 512)).astype(np.float32).tolist()


def test_image_serves_topk_for_both_demo_heads() -> None:
    url = os.environ["LMHEAD_DOCKER_URL"]
    ready = httpx.get(f"{url}/health/ready", timeout=10).json()
    assert ready["models"] == {"demo-tied": "READY", "demo-untied": "READY"}
    labels = demo_tokens(32000)
    for name, tied in (("demo-tied", True), ("demo-untied", False)):
        body = {"hidden_states": HIDDEN, "k": 3, "logprobs": True}
        answer = httpx.post(f"{url}/v1/models/{name}/topk", json=body, timeout=30).json()
        assert answer["tied"] is tied
        for result in answer["results"]:
            assert len(result["token_ids"]) == 3
            assert result["tokens"] == [labels[i] for i in result["token_ids"]]
            assert result["logits"] == sorted(result["logits"], reverse=True)
            assert all(lp < 0 for lp in result["logprobs"])
    info = httpx.get(f"{url}/v1/models/demo-tied", timeout=10).json()
    assert info["providers"] == ["CPUExecutionProvider"]
    refused = httpx.post(f"{url}/v2/repository/models/demo-tied/load", timeout=10)
    assert refused.status_code == 403  # the image's default: read-only repository API


@pytest.mark.skipif("LMHEAD_DOCKER_GRPC" not in os.environ, reason="the image run by .ci/docker")
def test_image_serves_v2_over_grpc() -> None:
    with triton.InferenceServerClient(os.environ["LMHEAD_DOCKER_GRPC"]) as client:
        assert client.is_model_ready("demo-tied")
        tensor = triton.InferInput("hidden_states", [2, 512], "FP32")
        tensor.set_data_from_numpy(np.asarray(HIDDEN, dtype=np.float32))
        result = client.infer("demo-untied", [tensor], parameters={"k": 3})
        ids, values = result.as_numpy("topk_token_ids"), result.as_numpy("topk_logits")
        assert ids.shape == values.shape == (2, 3)
        assert (np.diff(values, axis=1) <= 0).all()
        answer = httpx.post(
            f"{os.environ['LMHEAD_DOCKER_URL']}/v1/models/demo-untied/topk",
            json={"hidden_states": HIDDEN, "k": 3},
            timeout=30,
        ).json()
        assert ids.tolist() == [row["token_ids"] for row in answer["results"]]


@pytest.mark.skipif("LMHEAD_COMPOSE_URL" not in os.environ, reason="needs docker compose")
def test_compose_swaps_to_a_version_copied_into_the_mounted_repository() -> None:
    url = os.environ["LMHEAD_COMPOSE_URL"]
    models = Path(os.environ["LMHEAD_COMPOSE_MODELS"])
    statuses: list[int] = []
    versions: list[int] = []
    seen_new = threading.Event()
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(base_url=url, timeout=30) as http:
            for _ in range(5000):  # bounded
                if stop.is_set():
                    return
                response = http.post("/v1/models/demo-tied/topk", json={"hidden_states": HIDDEN})
                statuses.append(response.status_code)
                if response.status_code == 200:
                    versions.append(response.json()["version"])
                    if versions[-1] == 2:
                        seen_new.set()

    threads = [threading.Thread(target=client) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        incoming = models / "demo-tied" / ".incoming"
        shutil.copytree(models / "demo-untied" / "1", incoming)
        incoming.rename(models / "demo-tied" / "2")
        started = time.monotonic()
        assert seen_new.wait(timeout=120), "the container never served version 2"
        print(f"\nswap seen by clients {time.monotonic() - started:.1f} s after the copy")
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    assert statuses
    assert set(statuses) == {200}, f"failed requests: {[s for s in statuses if s != 200]}"
    assert versions[0] == 1
    assert versions[-1] == 2
