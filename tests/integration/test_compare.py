"""Score, compare and shadow traffic against a real server, checked with float64 numpy."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import pytest

from service.heads.files import HeadWeights, save_head
from service.heads.reference import log_softmax, logsumexp, top_k
from service.plane.comparison import kl_rows
from tests.conftest import D_MODEL, VOCAB, reference_logits
from tests.server import poll, running_server

HIDDEN = np.random.default_rng(17).standard_normal((12, D_MODEL)).astype(np.float32)
TARGETS = np.random.default_rng(18).integers(0, VOCAB, 12)


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory, table: npt.NDArray[np.float32]) -> Path:
    root = tmp_path_factory.mktemp("models")
    perturbed = table + np.random.default_rng(5).standard_normal(table.shape).astype(np.float32)
    save_head(HeadWeights.from_arrays(table), root / "tied" / "1")
    save_head(HeadWeights.from_arrays(table, table.copy()), root / "twin" / "1")
    save_head(HeadWeights.from_arrays(table, perturbed), root / "perturbed" / "1")
    save_head(HeadWeights.from_arrays(table[:, :16]), root / "narrow" / "1")
    ties = table.copy()
    ties[11] = ties[7]
    save_head(HeadWeights.from_arrays(ties), root / "ties" / "1")
    save_head(HeadWeights.from_arrays(table), root / "shadowed" / "1")
    shadow = {"shadow": {"model": "perturbed", "fraction": 1.0}, "shadow_k": 5}
    (root / "shadowed" / "config.json").write_text(json.dumps(shadow))
    save_head(HeadWeights.from_arrays(table), root / "bad-shadow" / "1")
    bad = {"shadow": {"model": "narrow", "fraction": 1.0}}
    (root / "bad-shadow" / "config.json").write_text(json.dumps(bad))
    return root


@pytest.fixture(scope="module")
def url(repository: Path) -> Iterator[str]:
    with running_server(repository) as base_url:
        yield base_url


def _logits(repository: Path, model: str, hidden: npt.NDArray[np.float32]) -> Any:
    return reference_logits(repository / model / "1", hidden)


def test_score_equals_reference(url: str, repository: Path) -> None:
    body = {"hidden_states": HIDDEN.tolist(), "target_ids": TARGETS.tolist()}
    answer = httpx.post(f"{url}/v1/models/perturbed/score", json=body).json()
    logits = _logits(repository, "perturbed", HIDDEN)
    rows = np.arange(len(TARGETS))
    expected_lp = log_softmax(logits)[rows, TARGETS]
    expected_rank = (logits > logits[rows, TARGETS][:, None]).sum(axis=1)
    got = answer["results"]
    np.testing.assert_allclose([r["logprob"] for r in got], expected_lp, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose([r["logit"] for r in got], logits[rows, TARGETS], atol=1e-4)
    assert [r["rank"] for r in got] == expected_rank.tolist()
    assert answer["nll"] == pytest.approx(-expected_lp.mean(), rel=1e-5)
    assert answer["perplexity"] == pytest.approx(np.exp(-expected_lp.mean()), rel=1e-4)


def test_score_accepts_batch_by_tokens_and_candidates(url: str, repository: Path) -> None:
    hidden = HIDDEN.reshape(3, 4, D_MODEL)
    body = {
        "hidden_states": hidden.tolist(),
        "target_ids": TARGETS.reshape(3, 4).tolist(),
        "candidate_ids": [5, 7],
    }
    answer = httpx.post(f"{url}/v1/models/tied/score", json=body).json()
    assert len(answer["results"]) == 12
    logits = _logits(repository, "tied", HIDDEN)
    full = httpx.post(
        f"{url}/v1/models/tied/score",
        json={"hidden_states": HIDDEN.tolist(), "target_ids": [5] * 12},
    ).json()
    for candidates, row, full_row, lse in zip(
        answer["candidates"], logits, full["results"], logsumexp(logits), strict=True
    ):
        assert candidates["ids"] == [5, 7]
        np.testing.assert_allclose(candidates["logits"], row[[5, 7]], atol=1e-4)
        np.testing.assert_allclose(candidates["logprobs"], row[[5, 7]] - lse, atol=1e-4)
        assert candidates["logprobs"][0] == pytest.approx(full_row["logprob"], abs=1e-5)


@pytest.mark.parametrize(
    ("targets", "message"),
    [([VOCAB] * 12, "must be in"), ([1, 2], "must have shape [12]"), (None, "is required")],
)
def test_bad_targets_are_4xx(url: str, targets: Any, message: str) -> None:
    body: dict[str, Any] = {"hidden_states": HIDDEN.tolist()}
    if targets is not None:
        body["target_ids"] = targets
    response = httpx.post(f"{url}/v1/models/tied/score", json=body)
    assert response.status_code == 422
    assert message in response.json()["error"]["message"]


@pytest.mark.parametrize("other", ["tied", "twin"])
def test_a_head_agrees_with_itself_and_with_its_untied_twin(url: str, other: str) -> None:
    body = {"models": ["tied", other], "hidden_states": HIDDEN.tolist(), "k": 5}
    answer = httpx.post(f"{url}/v1/compare", json=body).json()
    assert answer["top1_agreement"] == 1.0
    assert answer["topk_overlap"] == 1.0
    assert answer["kl_ab"]["max"] == pytest.approx(0.0, abs=1e-9)
    assert answer["kl_ba"]["max"] == pytest.approx(0.0, abs=1e-9)
    assert [m["tied"] for m in answer["models"]] == [True, other == "tied"]


def test_compare_against_a_perturbed_head_matches_reference(url: str, repository: Path) -> None:
    body = {
        "models": ["tied", "perturbed"],
        "hidden_states": HIDDEN.tolist(),
        "target_ids": TARGETS.tolist(),
        "k": 5,
        "measure_speed": True,
    }
    answer = httpx.post(f"{url}/v1/compare", json=body).json()
    a, b = _logits(repository, "tied", HIDDEN), _logits(repository, "perturbed", HIDDEN)
    kl_ab, kl_ba = kl_rows(a, b), kl_rows(b, a)
    assert answer["kl_ab"]["mean"] == pytest.approx(kl_ab.mean(), rel=1e-3)
    assert answer["kl_ab"]["max"] == pytest.approx(kl_ab.max(), rel=1e-3)
    assert answer["kl_ba"]["p50"] == pytest.approx(np.quantile(kl_ba, 0.5), rel=1e-3)
    assert answer["top1_agreement"] == pytest.approx(np.mean(a.argmax(1) == b.argmax(1)))
    lp_a = log_softmax(a)[np.arange(12), TARGETS]
    lp_b = log_softmax(b)[np.arange(12), TARGETS]
    close = np.isclose(lp_a, lp_b, rtol=1e-5, atol=1e-5)
    blocks = {m["name"]: m for m in answer["models"]}
    assert blocks["tied"]["wins"] == pytest.approx(np.mean((lp_a > lp_b) & ~close))
    assert blocks["perturbed"]["wins"] == pytest.approx(np.mean((lp_b > lp_a) & ~close))
    assert answer["ties"] == pytest.approx(np.mean(close))
    assert blocks["tied"]["nll"] == pytest.approx(-lp_a.mean(), rel=1e-4)
    assert blocks["perturbed"]["parameters"] == 2 * blocks["tied"]["parameters"]
    assert blocks["tied"]["rows_per_s"] > 0


def test_a_head_compared_with_itself_ties_every_row(url: str) -> None:
    body = {"models": ["tied", "tied"], "hidden_states": HIDDEN.tolist()}
    answer = httpx.post(f"{url}/v1/compare", json={**body, "target_ids": TARGETS.tolist()}).json()
    assert [m["wins"] for m in answer["models"]] == [0.0, 0.0]
    assert answer["ties"] == 1.0


def test_scores_within_candidates_rank_equal_logits_in_id_order(url: str, repository: Path) -> None:
    """Tokens 7 and 11 have one row of W: equal logits, ranked by id, as over the vocabulary."""
    body = {"hidden_states": HIDDEN[:2].tolist(), "target_ids": [11, 7], "candidate_ids": [7, 11]}
    logits = _logits(repository, "ties", HIDDEN[:2])
    above = (logits > logits[:, [7]]).sum(axis=1)
    expected = {"vocabulary": [above[0] + 1, above[1]], "candidates": [1, 0]}
    for over, ranks in expected.items():
        answer = httpx.post(
            f"{url}/v1/models/ties/score", json={**body, "logprobs_over": over}
        ).json()
        assert [r["rank"] for r in answer["results"]] == ranks


def test_compare_refuses_mismatched_heads(url: str) -> None:
    body = {"models": ["tied", "narrow"], "hidden_states": HIDDEN.tolist()}
    response = httpx.post(f"{url}/v1/compare", json=body)
    assert response.status_code == 422
    assert "d_model differs" in response.json()["error"]["message"]


def test_cli_compare_prints_a_table_and_json(url: str, repository: Path, tmp_path: Path) -> None:
    np.save(tmp_path / "h.npy", HIDDEN)
    np.save(tmp_path / "t.npy", TARGETS)
    command = [sys.executable, "-m", "service", "compare", "tied", "perturbed", "--url", url]
    command += ["--hidden", str(tmp_path / "h.npy"), "--targets", str(tmp_path / "t.npy")]
    command += ["--repository", str(repository)]
    table = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    assert "top-1 agreement" in table
    assert "perplexity" in table
    report = json.loads(
        subprocess.run([*command, "--json"], capture_output=True, text=True, check=True).stdout
    )
    resident = {m["name"]: m["resident_bytes"] for m in report["models"]}
    weight = VOCAB * D_MODEL * 4
    assert resident["tied"] > 0.5 * weight
    assert "note" not in report
    elsewhere = [*command[:-1], str(tmp_path)]  # --repository where the files are not
    table = subprocess.run(elsewhere, capture_output=True, text=True, check=True).stdout
    assert "resident bytes n/a: no model file of tied, perturbed under" in table


def _metric(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    match = re.search(rf"^{name}{{{wanted}}} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _wait_for(url: str, name: str, value: float, **labels: str) -> str:
    """Shadow runs finish after the answers: poll /metrics until the count is reached."""

    def reached() -> str | None:
        text = httpx.get(f"{url}/metrics").text
        return text if _metric(text, name, **labels) >= value else None

    return poll(reached, f"{name} reaching {value}")


def test_shadow_traffic_metrics_match_a_reference(url: str, repository: Path) -> None:
    temperature = 0.5  # the shadow must run at the request's temperature too

    def primary(row: npt.NDArray[np.float32]) -> list[int]:
        body = {"hidden_states": [row.tolist()], "k": 3, "temperature": temperature}
        answer = httpx.post(f"{url}/v1/models/shadowed/topk", json=body, timeout=30).json()
        assert answer["model"] == "shadowed"
        ids: list[int] = answer["results"][0]["token_ids"]
        return ids

    with ThreadPoolExecutor(6) as clients:  # concurrent load, every request shadowed
        answers = list(clients.map(primary, HIDDEN))
    expected = top_k(_logits(repository, "shadowed", HIDDEN), 3)[1]
    np.testing.assert_array_equal(answers, expected)  # primary answers stay exact
    pair = {"primary": "shadowed", "shadow": "perturbed"}
    text = _wait_for(url, "lmhead_shadow_requests_total", 12, outcome="ran", **pair)
    agree = _metric(text, "lmhead_shadow_top1_rows_total", agree="true", **pair)
    disagree = _metric(text, "lmhead_shadow_top1_rows_total", agree="false", **pair)
    a = _logits(repository, "shadowed", HIDDEN) / temperature
    b = _logits(repository, "perturbed", HIDDEN) / temperature
    assert agree + disagree == 12
    assert agree == int(np.sum(a.argmax(1) == b.argmax(1)))
    kl_sum = _metric(text, "lmhead_shadow_kl_sum", **pair)
    assert kl_sum == pytest.approx(kl_rows(a, b).sum(), rel=1e-3)


def test_a_failing_shadow_never_fails_the_primary(url: str) -> None:
    for _ in range(3):
        body = {"hidden_states": [HIDDEN[0].tolist()]}
        assert httpx.post(f"{url}/v1/models/bad-shadow/topk", json=body).status_code == 200
    pair = {"primary": "bad-shadow", "shadow": "narrow"}
    _wait_for(url, "lmhead_shadow_requests_total", 3, outcome="failed", **pair)
