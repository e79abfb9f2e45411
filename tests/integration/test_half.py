"""Half-precision heads served for real: answers equal the numpy reference computed on the
half-rounded weights, within the tolerance of the provider that ran them (exact float32 math
on a CPU, which widens them at load; half-precision math on CUDA)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import numpy.typing as npt
import pytest

from service.heads.files import NUMPY_DTYPES, HeadWeights, save_head
from tests.conftest import D_MODEL
from tests.server import running_server

HIDDEN = np.random.default_rng(21).standard_normal((6, D_MODEL)).astype(np.float32)
#: Largest |logit error| per compute dtype: float32 (CPU, or CUDA without TF32), fp16, bf16.
TOLERANCE = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 2e-1}


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory,
    table: npt.NDArray[np.float32],
    output_weight: npt.NDArray[np.float32],
) -> Iterator[httpx.Client]:
    root = tmp_path_factory.mktemp("half")
    save_head(HeadWeights.from_arrays(table, dtype="float16"), root / "fp16" / "1")
    bf16 = HeadWeights.from_arrays(table, output_weight, dtype="bfloat16")
    save_head(bf16, root / "bf16" / "1", external_data=True)
    save_head(HeadWeights.from_arrays(table), root / "fp32" / "1")
    with running_server(root) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client


def _rounded(array: npt.NDArray[np.float32], dtype: str) -> npt.NDArray[np.float64]:
    return array.astype(NUMPY_DTYPES[dtype]).astype(np.float64)


@pytest.mark.parametrize(("model", "dtype"), [("fp16", "float16"), ("bf16", "bfloat16")])
def test_half_heads_answer_like_their_rounded_weights(
    served: httpx.Client,
    model: str,
    dtype: str,
    table: npt.NDArray[np.float32],
    output_weight: npt.NDArray[np.float32],
) -> None:
    described = served.get(f"/v1/models/{model}").json()
    assert described["dtype"] == dtype
    compute = described["compute_dtype"]
    assert compute == ("float32" if described["providers"][0] == "CPUExecutionProvider" else dtype)
    weight = table if model == "fp16" else output_weight
    reference = HIDDEN.astype(np.float64) @ _rounded(weight, dtype).T
    answer = served.post(f"/v1/models/{model}/topk", json={"hidden_states": HIDDEN.tolist()})
    tolerance = TOLERANCE[compute]
    for row, result in enumerate(answer.json()["results"]):
        ids, logits = result["token_ids"], np.array(result["logits"])
        np.testing.assert_allclose(logits, reference[row, ids], atol=tolerance)
        kth_best = np.sort(reference[row])[::-1][len(ids) - 1]
        assert reference[row, ids].min() >= kth_best - 2 * tolerance  # a true top-k
    embedded = served.post(f"/v1/models/{model}/embed", json={"input_ids": [0, 5, 9]}).json()
    expected = _rounded(table, dtype)[[0, 5, 9]].astype(np.float32)
    np.testing.assert_array_equal(np.array(embedded["embeddings"], np.float32), expected)


def test_a_half_head_agrees_with_its_float32_twin(served: httpx.Client) -> None:
    body = {"models": ["fp16", "fp32"], "hidden_states": HIDDEN.tolist(), "k": 5}
    report = served.post("/v1/compare", json=body).json()
    assert report["top1_agreement"] == 1.0
    assert report["kl_ab"]["max"] < 1e-3
    assert served.get("/v2/models/bf16").json()["parameters"]["dtype"] == "bfloat16"
