"""KServe's own gRPC client (``kserve.InferenceGRPCClient``) against lmhead's gRPC port: health,
raw and typed contents, answers equal to the numpy reference. The kserve SDK lives in its own
environment (``make test`` builds it and sets ``LMHEAD_KSERVE_PYTHON``), since its server
dependencies pin versions lmhead's own environment does not share."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from service.heads.reference import top_k
from tests.conftest import D_MODEL, reference_logits, write_tied_and_untied
from tests.server import free_port, running_server

KSERVE_PYTHON = os.environ.get("LMHEAD_KSERVE_PYTHON")
CLIENT = Path(__file__).with_name("kserve_client.py")
pytestmark = pytest.mark.skipif(
    KSERVE_PYTHON is None, reason="needs LMHEAD_KSERVE_PYTHON (make test sets it)"
)


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory,
    table: npt.NDArray[np.float32],
    output_weight: npt.NDArray[np.float32],
) -> Iterator[tuple[Path, str]]:
    root = tmp_path_factory.mktemp("models")
    write_tied_and_untied(root, table, output_weight)
    port = free_port()
    with running_server(root, grpc_port=str(port)):
        yield root, f"127.0.0.1:{port}"


@pytest.mark.parametrize("model", ["tied", "untied"])
@pytest.mark.parametrize("encoding", ["raw", "typed"])
def test_kserve_grpc_client_gets_the_reference_answer(
    served: tuple[Path, str], tmp_path: Path, model: str, encoding: str
) -> None:
    root, address = served
    hidden = np.random.default_rng(9).standard_normal((3, D_MODEL)).astype(np.float32)
    np.save(tmp_path / "hidden.npy", hidden)
    assert KSERVE_PYTHON is not None
    done = subprocess.run(
        [KSERVE_PYTHON, str(CLIENT), address, model, str(tmp_path / "hidden.npy"), encoding],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    answer = json.loads(done.stdout)
    assert (answer["live"], answer["ready"], answer["model_ready"]) == (True, True, True)
    assert answer["version"] == "1"
    values, ids = top_k(reference_logits(root / model / "1", hidden), 3)
    np.testing.assert_array_equal(answer["outputs"]["topk_token_ids"], ids)
    np.testing.assert_allclose(answer["outputs"]["topk_logits"], values, rtol=1e-4, atol=1e-4)
