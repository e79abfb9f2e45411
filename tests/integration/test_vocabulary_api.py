"""Allowed tokens, logit bias, bans, sampling, prompt scoring and trimmed heads over real HTTP
(native and V2), every number checked against the float64 reference of the file served."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import pytest

from service.heads.reference import log_softmax, logsumexp
from tests.conftest import D_MODEL, VOCAB, reference_logits
from tests.server import running_server

HIDDEN = np.random.default_rng(21).standard_normal((6, D_MODEL)).astype(np.float32)
ALLOWED = [5, 900, 17, 3, 250]
RTOL, ATOL = 1e-4, 1e-4


@pytest.fixture(scope="module")
def url(repository: Path) -> Iterator[str]:
    with running_server(repository) as base_url:
        yield base_url


def _logits(repository: Path, model: str, hidden: npt.NDArray[np.float32] = HIDDEN) -> Any:
    return reference_logits(repository / model / "1", hidden)


def _topk(url: str, model: str, **body: Any) -> Any:
    answer = httpx.post(
        f"{url}/v1/models/{model}/topk", json={"hidden_states": HIDDEN.tolist(), **body}
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


@pytest.mark.parametrize("model", ["tied", "untied"])
def test_allowed_tokens_rank_and_normalise_among_themselves(
    url: str, repository: Path, model: str
) -> None:
    answer = _topk(url, model, allowed_token_ids=ALLOWED, k=3, logprobs=True)
    logits = _logits(repository, model)[:, ALLOWED]
    assert answer["logprobs_over"] == "candidates"
    for row, result in enumerate(answer["results"]):
        order = np.argsort(-logits[row])[:3]
        assert result["token_ids"] == [ALLOWED[i] for i in order]
        np.testing.assert_allclose(result["logits"], logits[row, order], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(
            result["logprobs"], log_softmax(logits[row])[order], rtol=RTOL, atol=ATOL
        )


def test_allowed_tokens_with_vocabulary_logprobs_and_per_row_lists(
    url: str, repository: Path
) -> None:
    per_row = np.random.default_rng(2).integers(0, VOCAB, (len(HIDDEN), 4)).tolist()
    answer = _topk(
        url, "untied", allowed_token_ids=per_row, k=2, logprobs=True, logprobs_over="vocabulary"
    )
    logits = _logits(repository, "untied")
    full = log_softmax(logits)
    for row, result in enumerate(answer["results"]):
        ids = np.array(per_row[row])
        order = np.argsort(-logits[row, ids], kind="stable")[:2]
        assert result["token_ids"] == ids[order].tolist()
        np.testing.assert_allclose(result["logprobs"], full[row, ids[order]], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    "options",
    [{"logit_bias": {"5": 3.0}}, {"allowed_token_ids": ALLOWED}, {"sample": {"seed": 1}}],
)
def test_options_answer_log_probs_only_when_asked(url: str, options: dict[str, Any]) -> None:
    """The options' answers carried log-probs whatever ``logprobs`` said (false is the
    default, as without options)."""
    for asked in (None, False):
        body = options if asked is None else {**options, "logprobs": asked}
        assert all("logprobs" not in result for result in _topk(url, "tied", **body)["results"])
    asked = _topk(url, "tied", logprobs=True, **options)["results"]
    assert all(len(result["logprobs"]) == len(result["token_ids"]) for result in asked)


def test_logit_bias_and_bans_reshape_the_whole_distribution(url: str, repository: Path) -> None:
    logits = _logits(repository, "tied")
    best = int(np.argmax(logits[0]))
    lifted = int(np.argsort(logits[1])[VOCAB // 2])
    answer = _topk(
        url,
        "tied",
        k=4,
        logprobs=True,
        logit_bias={str(lifted): 40.0, "7": -5.0},
        banned_token_ids=[best],
    )
    biased = logits.copy()
    biased[:, lifted] += 40.0
    biased[:, 7] -= 5.0
    biased[:, best] = -np.inf
    for row, result in enumerate(answer["results"]):
        order = np.argsort(-biased[row], kind="stable")[:4]
        assert result["token_ids"] == order.tolist()
        want = biased[row, order] - logsumexp(biased[row : row + 1])[0]
        np.testing.assert_allclose(result["logprobs"], want, rtol=RTOL, atol=ATOL)
        assert best not in result["token_ids"]
    assert answer["results"][1]["token_ids"][0] == lifted


def test_logit_bias_is_added_before_temperature(url: str, repository: Path) -> None:
    """(z + b) / T, as transformers and vLLM apply it, so temperature never reorders tokens:
    it was z / T + b, and at T = 0.1 the bias that put a token first weighed ten times less
    and left it second."""
    logits = _logits(repository, "tied")
    second = int(np.argsort(-logits[0])[1])
    lift = round(float(logits[0].max() - logits[0, second]) * 1.5, 3)
    biased = logits.copy()
    biased[:, second] += np.float32(lift)
    for temperature in (0.1, 1.0, 4.0):
        answer = _topk(
            url,
            "tied",
            k=3,
            logprobs=True,
            temperature=temperature,
            logit_bias={str(second): lift},
        )
        scaled = biased / temperature
        assert answer["results"][0]["token_ids"][0] == second
        for row, result in enumerate(answer["results"]):
            order = np.argsort(-scaled[row], kind="stable")[:3]
            assert result["token_ids"] == order.tolist()
            np.testing.assert_allclose(result["logits"], scaled[row, order], rtol=RTOL, atol=ATOL)
            want = log_softmax(scaled[row])[order]
            np.testing.assert_allclose(result["logprobs"], want, rtol=RTOL, atol=ATOL)


def test_ties_go_to_the_lower_id_whatever_the_bias_or_the_list_order(url: str) -> None:
    """As the graph's TopK breaks them: a zero bias dropped its token from a tie (biased
    tokens were ranked after the others), and an allowed list's order decided greedy draws."""
    zeros = {"hidden_states": [[0.0] * D_MODEL]}  # every logit 0: one big tie

    def first(**body: Any) -> Any:
        answer = httpx.post(f"{url}/v1/models/tied/topk", json={**zeros, **body})
        assert answer.status_code == 200, answer.text
        return answer.json()["results"][0]

    assert first(k=4)["token_ids"] == [0, 1, 2, 3]
    assert first(k=4, logit_bias={"2": 0.0})["token_ids"] == [0, 1, 2, 3]
    for allowed in ([9, 5, 3], [3, 5, 9]):
        greedy = first(k=2, allowed_token_ids=allowed, sample={"temperature": 0})
        assert (greedy["token_ids"], greedy["sampled_token_id"]) == ([3, 5], 3)


def test_sampling_is_seeded_per_position_and_follows_filters(url: str, repository: Path) -> None:
    sample = {"seed": 11, "top_k": 5, "temperature": 0.7}
    first = _topk(url, "tied", k=5, sample=sample)
    again = _topk(url, "tied", k=5, sample=sample)
    drawn = [result["sampled_token_id"] for result in first["results"]]
    assert drawn == [result["sampled_token_id"] for result in again["results"]]
    assert first["seed"] == 11
    logits = _logits(repository, "tied") / 0.7
    for row, result in enumerate(first["results"]):
        assert drawn[row] in np.argsort(-logits[row])[:5]  # top_k=5 keeps these alone
        want = log_softmax(logits[row])[drawn[row]]
        np.testing.assert_allclose(result["sampled_logprob"], want, rtol=RTOL, atol=ATOL)
    # the rows' draws do not depend on the rows after them
    one = httpx.post(
        f"{url}/v1/models/tied/topk",
        json={"hidden_states": HIDDEN[:2].tolist(), "k": 5, "sample": sample},
    ).json()
    assert [r["sampled_token_id"] for r in one["results"]] == drawn[:2]


def test_greedy_sampling_is_the_argmax_and_npz_carries_draws(url: str, repository: Path) -> None:
    buffer = io.BytesIO()
    np.save(buffer, HIDDEN)
    answer = httpx.post(
        f"{url}/v1/models/untied/topk",
        params={"k": "2", "sample": '{"temperature": 0, "seed": 1}'},
        content=buffer.getvalue(),
        headers={"content-type": "application/x-npy", "accept": "application/x-npz"},
    )
    assert answer.status_code == 200, answer.text
    arrays = np.load(io.BytesIO(answer.content))
    expected = np.argmax(_logits(repository, "untied"), axis=1)
    np.testing.assert_array_equal(arrays["sampled_token_ids"], expected)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("logit_bias", '{"5": "1"}', "logit_bias"),
        ("sample", '{"seed": "12"}', "sample.seed"),
    ],
)
def test_json_in_query_parameters_is_as_strict_as_a_json_body(
    url: str, name: str, value: str, message: str
) -> None:
    """``k=2`` is text by nature; JSON text holds JSON types, so "1" is no number there."""
    buffer = io.BytesIO()
    np.save(buffer, HIDDEN)
    answer = httpx.post(
        f"{url}/v1/models/tied/topk",
        params={"k": "2", name: value},
        content=buffer.getvalue(),
        headers={"content-type": "application/x-npy"},
    )
    assert answer.status_code == 422, answer.text
    assert message in answer.json()["error"]["message"]


def test_restricted_logits_are_the_columns_asked_for(url: str, repository: Path) -> None:
    answer = httpx.post(
        f"{url}/v1/models/untied/logits",
        json={"hidden_states": HIDDEN.tolist(), "allowed_token_ids": ALLOWED},
        headers={"accept": "application/json"},
    ).json()
    assert answer["token_ids"][0] == ALLOWED
    np.testing.assert_allclose(
        answer["logits"], _logits(repository, "untied")[:, ALLOWED], rtol=RTOL, atol=ATOL
    )


def test_prompt_scoring_of_a_long_prompt(url: str, repository: Path) -> None:
    """(batch, tokens) positions, more than one scoring run: targets, ranks, alternatives."""
    hidden = np.random.default_rng(4).standard_normal((2, 300, D_MODEL)).astype(np.float32)
    targets = np.random.default_rng(5).integers(0, VOCAB, (2, 300))
    body = {"hidden_states": hidden.tolist(), "target_ids": targets.tolist(), "k": 3}
    answer = httpx.post(f"{url}/v1/models/tied/score", json=body)
    assert answer.status_code == 200, answer.text
    payload = answer.json()
    logits = _logits(repository, "tied", hidden.reshape(-1, D_MODEL))
    flat = targets.reshape(-1)
    logprobs = log_softmax(logits)[np.arange(len(flat)), flat]
    got = np.array([row["logprob"] for row in payload["results"]])
    np.testing.assert_allclose(got, logprobs, rtol=RTOL, atol=ATOL)
    ranks = (logits > logits[np.arange(len(flat)), flat][:, None]).sum(axis=1)
    assert [row["rank"] for row in payload["results"]] == ranks.tolist()
    alternatives = [row["ids"] for row in payload["alternatives"]]
    assert alternatives == np.argsort(-logits, axis=1)[:, :3].tolist()
    np.testing.assert_allclose(payload["nll"], -logprobs.mean(), rtol=1e-5)


def test_scoring_among_candidates_only(url: str, repository: Path) -> None:
    targets = [ALLOWED[row % len(ALLOWED)] for row in range(len(HIDDEN))]
    body = {
        "hidden_states": HIDDEN.tolist(),
        "target_ids": targets,
        "candidate_ids": ALLOWED,
        "logprobs_over": "candidates",
    }
    payload = httpx.post(f"{url}/v1/models/untied/score", json=body).json()
    logits = _logits(repository, "untied")[:, ALLOWED]
    for row, result in enumerate(payload["results"]):
        want = log_softmax(logits[row])[ALLOWED.index(targets[row])]
        np.testing.assert_allclose(result["logprob"], want, rtol=RTOL, atol=ATOL)
    assert payload["logprobs_over"] == "candidates"
    with_k = httpx.post(f"{url}/v1/models/untied/score", json={**body, "k": 3})
    assert with_k.status_code == 422  # it was ignored: no alternatives came back
    assert "k does not apply" in with_k.json()["error"]["message"]


def test_v2_parameters_shape_the_distribution(url: str, repository: Path) -> None:
    body = {
        "inputs": [
            {
                "name": "hidden_states",
                "datatype": "FP32",
                "shape": list(HIDDEN.shape),
                "data": HIDDEN.reshape(-1).tolist(),
            }
        ],
        "parameters": {
            "k": 2,
            "allowed_token_ids": "[5, 900, 17, 3, 250]",  # JSON text, as gRPC sends it
            "sample": {"seed": 3},
        },
    }
    answer = httpx.post(f"{url}/v2/models/tied/infer", json=body)
    assert answer.status_code == 200, answer.text
    outputs = {output["name"]: output for output in answer.json()["outputs"]}
    assert set(outputs) >= {"topk_token_ids", "sampled_token_ids", "sampled_logprobs"}
    logits = _logits(repository, "tied")[:, ALLOWED]
    top = np.array(outputs["topk_token_ids"]["data"]).reshape(len(HIDDEN), 2)
    assert top.tolist() == [[ALLOWED[i] for i in np.argsort(-row)[:2]] for row in logits]
    assert set(outputs["sampled_token_ids"]["data"]) <= set(ALLOWED)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"allowed_token_ids": [VOCAB]}, "allowed_token_ids must be in"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {"\u00b2": 1.0}}, "logit_bias keys must be token ids"),  # "²"
        ({"logit_bias": {"9" * 5000: 1.0}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {"05": 1.0}}, "logit_bias keys must be token ids"),
        ({"allowed_token_ids": [5, 900, 5]}, "allowed_token_ids names token 5 twice"),
        ({"allowed_token_ids": [[3, 9, 3]] * len(HIDDEN)}, "names token 3 twice"),
        ({"logit_bias": {"3": 1000.0}}, "logit_bias values must be in"),
        ({"sample": {"top_p": 1.5}}, "sample.top_p must be in"),
        ({"sample": {"temperature": 0.5}, "temperature": 2.0}, "give the temperature once"),
        ({"logprobs_over": "candidates"}, "needs allowed_token_ids"),
        ({"logprobs_over": "all"}, "got 'all'"),
        ({"sample": {"temperature": 2e4}}, "sample.temperature (or 0: greedy) must be a number"),
        ({"allowed_token_ids": [3], "banned_token_ids": [3]}, "every allowed token"),
    ],
)
def test_bad_options_are_422_with_a_reason(url: str, body: dict[str, Any], message: str) -> None:
    answer = httpx.post(
        f"{url}/v1/models/tied/topk", json={"hidden_states": HIDDEN.tolist(), **body}
    )
    assert answer.status_code == 422, answer.text
    assert message in answer.json()["error"]["message"], answer.json()


def test_banned_tokens_among_the_allowed_are_never_listed(url: str, repository: Path) -> None:
    """k is cut to the allowed tokens left once the banned are out, never padded with them."""
    answer = _topk(
        url, "tied", allowed_token_ids=ALLOWED, banned_token_ids=[900, 3], k=5, logprobs=True
    )
    kept = [5, 17, 250]
    logits = _logits(repository, "tied")[:, kept]
    for row, result in enumerate(answer["results"]):
        order = np.argsort(-logits[row])
        assert result["token_ids"] == [kept[i] for i in order]
        np.testing.assert_allclose(
            result["logprobs"], log_softmax(logits[row])[order], rtol=RTOL, atol=ATOL
        )


def test_banned_tokens_leaving_fewer_than_k_are_never_listed(url: str, repository: Path) -> None:
    """Banning all but two tokens answers those two, not banned ones with null logits."""
    left = [11, 600]
    banned = [token for token in range(VOCAB) if token not in left]
    answer = _topk(url, "tied", banned_token_ids=banned, k=5)
    logits = _logits(repository, "tied")[:, left]
    for row, result in enumerate(answer["results"]):
        order = np.argsort(-logits[row])
        assert result["token_ids"] == [left[i] for i in order]
        assert None not in result["logits"]


def test_scoring_refuses_a_candidate_named_twice(url: str) -> None:
    body = {
        "hidden_states": HIDDEN[:1].tolist(),
        "target_ids": [5],
        "logprobs_over": "candidates",
        "candidate_ids": [5, 17, 250, 250],
    }
    answer = httpx.post(f"{url}/v1/models/tied/score", json=body)
    assert answer.status_code == 422, answer.text
    assert "candidate_ids names token 250 twice" in answer.json()["error"]["message"]


def test_rows_past_the_prefix_are_drawn_exactly_from_full_logits(
    url: str, repository: Path
) -> None:
    """No filter on flat rows: the draw may land past the 64 fetched tokens, and those rows run
    again with full logits. Draws are the inverse CDF of the same u over the whole sorted row."""
    from service.runtime.vocabulary import SampleSpec

    spec = SampleSpec(seed=5)
    flat = HIDDEN * np.float32(0.02)  # logits spread ~0.15: nearly uniform over 997 tokens
    body = {"hidden_states": flat.tolist(), "k": 3, "sample": {"seed": 5}}
    answer = httpx.post(f"{url}/v1/models/untied/topk", json=body).json()
    logits = _logits(repository, "untied", flat)
    u = spec.uniforms(len(HIDDEN))
    for row, result in enumerate(answer["results"]):
        order = np.argsort(-logits[row], kind="stable")
        probs = np.exp(log_softmax(logits[row])[order])
        expected = int(order[np.searchsorted(np.cumsum(probs), u[row], side="right")])
        assert result["sampled_token_id"] == expected
        assert result["token_ids"] == order[:3].tolist()
    places = [
        int(np.flatnonzero(np.argsort(-logits[r]) == a["sampled_token_id"])[0])
        for r, a in enumerate(answer["results"])
    ]
    assert max(places) >= 64, places  # at least one row needed the exact path


def test_banning_a_token_that_held_all_the_mass_is_recomputed_exactly(
    url: str, repository: Path, table: npt.NDArray[np.float32]
) -> None:
    hidden = (table[[4, 8]] * 60).astype(np.float32)  # token 4 / 8 hold ~all the mass
    logits = _logits(repository, "tied", hidden)
    best = [int(np.argmax(row)) for row in logits]
    body = {"hidden_states": hidden.tolist(), "k": 2, "logprobs": True, "banned_token_ids": best}
    answer = httpx.post(f"{url}/v1/models/tied/topk", json=body).json()
    biased = logits.copy()
    biased[:, best] = -np.inf
    for row, result in enumerate(answer["results"]):
        order = np.argsort(-biased[row], kind="stable")[:2]
        assert result["token_ids"] == order.tolist()
        want = biased[row, order] - logsumexp(biased[row : row + 1])[0]
        np.testing.assert_allclose(result["logprobs"], want, rtol=RTOL, atol=ATOL)
