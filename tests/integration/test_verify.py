"""``POST /v1/models/{name}/verify`` over real HTTP against the float64 reference: a chain
with draft probabilities (JSON and .npz bodies give the same answer, the rule's over the
reference distribution with the same seeds), greedy verification is greedy decoding, a tree,
/metrics counts drafted and accepted tokens, and bad input is refused naming its field."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import pytest

from service.client import AsyncClient, Client
from service.heads.files import HeadWeights, save_head
from service.heads.reference import log_softmax
from service.runtime.verification import uniforms, verify_chain, verify_tree
from tests.server import metric, running_server

VOCAB, D = 300, 16
RNG = np.random.default_rng(46)
TABLE = (0.4 * RNG.standard_normal((VOCAB, D))).astype(np.float32)
SEQUENCES, K = 5, 3
HIDDEN = RNG.standard_normal((SEQUENCES, K + 1, D)).astype(np.float32)
SEEDS = list(range(40, 40 + SEQUENCES))
DRAFTER = (0.4 * RNG.standard_normal((VOCAB, 8))).astype(np.float32)


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("verify")
    save_head(HeadWeights.from_arrays(TABLE), root / "head" / "1")
    save_head(HeadWeights.from_arrays(DRAFTER), root / "drafter" / "1")
    return root


@pytest.fixture(scope="module")
def url(repository: Path) -> Iterator[str]:
    with running_server(repository) as base_url:
        yield base_url


def _reference(temperature: float = 1.0) -> npt.NDArray[np.float64]:
    logits = HIDDEN.astype(np.float64) @ TABLE.astype(np.float64).T / temperature
    probs: npt.NDArray[np.float64] = np.exp(log_softmax(logits))
    return probs


def _drafts() -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]:
    """Drafts the target likes at the first two positions, a draft distribution giving them
    half its mass."""
    target = _reference(0.8)
    draft = RNG.dirichlet(np.full(VOCAB, 0.1), size=(SEQUENCES, K))
    ids = np.argmax(draft, axis=2)
    ids[:, :2] = np.argmax(target[:, :2], axis=2)
    for position in range(K):
        draft[np.arange(SEQUENCES), position, ids[:, position]] += 1.0
    return ids.astype(np.int64), draft / draft.sum(axis=2, keepdims=True)


def _post(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/models/head/verify", timeout=30, **kwargs)


def test_a_chain_follows_the_rule_over_json_and_npz(url: str) -> None:
    ids, draft = _drafts()
    body = {
        "hidden_states": HIDDEN.tolist(),
        "draft_token_ids": ids.tolist(),
        "draft_probs": draft.tolist(),
        "temperature": 0.8,
        "seeds": SEEDS,
    }
    drafted_before = metric(url, "lmhead_verify_drafted_tokens_total", model="head")
    answer = _post(url, json=body)
    assert answer.status_code == 200, answer.text
    results = answer.json()["results"]
    expected = verify_chain(_reference(0.8), ids, uniforms(SEEDS, K + 1), draft)
    accepted = [row["accepted"] for row in results]
    assert accepted == expected.accepted.tolist()
    assert len(set(accepted)) >= 2
    logp = np.log(_reference(0.8))
    for row, result in enumerate(results):
        chosen = expected.token_ids[row, : accepted[row] + 1].tolist()
        assert result["token_ids"] == chosen
        positions = expected.positions[row, : accepted[row] + 1]
        np.testing.assert_allclose(
            result["logprobs"], logp[row, positions, chosen], rtol=1e-4, atol=1e-4
        )
        assert result["seed"] == SEEDS[row]
    archive = io.BytesIO()
    np.savez(
        archive,
        hidden_states=HIDDEN,
        draft_token_ids=ids,
        draft_probs=draft.astype(np.float32),
        seeds=np.array(SEEDS),
    )
    binary = _post(
        url,
        content=archive.getvalue(),
        params={"temperature": "0.8"},
        headers={"content-type": "application/x-npz"},
    )
    assert binary.status_code == 200, binary.text
    assert [r["token_ids"] for r in binary.json()["results"]] == [r["token_ids"] for r in results]
    drafted = metric(url, "lmhead_verify_drafted_tokens_total", model="head") - drafted_before
    assert drafted == 2 * SEQUENCES * K


def test_greedy_verification_is_greedy_decoding(url: str) -> None:
    top = np.argmax(_reference(), axis=2)
    ids = top[:, :K].copy()
    ids[0, 0] = (ids[0, 0] + 1) % VOCAB
    ids[1, 2] = (ids[1, 2] + 1) % VOCAB
    body = {"hidden_states": HIDDEN.tolist(), "draft_token_ids": ids.tolist(), "temperature": 0}
    results = _post(url, json=body).json()["results"]
    assert [row["accepted"] for row in results] == [0, 2, 3, 3, 3]
    for row, result in enumerate(results):
        assert result["token_ids"] == top[row, : result["accepted"] + 1].tolist()


def test_a_tree_follows_the_rule(url: str) -> None:
    target = _reference()
    parents = [-1, -1, 1]
    ids = np.stack(
        [
            np.argsort(target[:, 0], axis=1)[:, -2],
            np.argmax(target[:, 0], axis=1),
            np.argmax(target[:, 2], axis=1),
        ],
        axis=1,
    )
    body = {
        "hidden_states": HIDDEN.tolist(),
        "draft_token_ids": ids.tolist(),
        "draft_parents": parents,
        "seeds": SEEDS,
    }
    results = _post(url, json=body).json()["results"]
    expected = verify_tree(target, ids, np.array(parents), uniforms(SEEDS, K + 1))
    for row, result in enumerate(results):
        assert result["nodes"] == expected.nodes[row, : result["accepted"]].tolist()
        assert result["token_ids"] == expected.token_ids[row, : result["accepted"] + 1].tolist()


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"draft_token_ids": [[1, 2]] * SEQUENCES}, "draft_token_ids must have shape"),
        ({"draft_token_ids": [[1, 2, VOCAB]] * SEQUENCES}, "draft_token_ids"),
        ({"draft_probs": np.full((SEQUENCES, K, VOCAB), 0.5).tolist()}, "must sum to 1"),
        ({"draft_parents": [-1, 2, 0]}, "draft_parents[1]"),
        ({"unknown": 1}, "unknown"),
    ],
)
def test_bad_input_is_refused_naming_the_field(
    url: str, changes: dict[str, Any], named: str
) -> None:
    body = {"hidden_states": HIDDEN.tolist(), "draft_token_ids": [[1, 2, 3]] * SEQUENCES}
    answer = _post(url, json=body | changes)
    assert 400 <= answer.status_code < 500
    assert named in answer.text


def test_a_seed_gives_the_same_answer_in_split_mode(url: str, repository: Path) -> None:
    """Two fronts before one engine (``LMHEAD_WORKERS=2``): the arrays cross the split, and
    each sequence's answer is the one process's, call after call."""
    ids, draft = _drafts()
    body = {
        "hidden_states": HIDDEN.tolist(),
        "draft_token_ids": ids.tolist(),
        "draft_probs": draft.tolist(),
        "sample": {"top_p": 0.9, "seed": 7},
    }
    one = _post(url, json=body).json()["results"]
    with running_server(repository, workers="2") as split:
        answers = [_post(split, json=body).json()["results"] for _ in range(3)]
    assert all(answer == one for answer in answers)
    assert [row["seed"] for row in one] == list(range(7, 7 + SEQUENCES))


@pytest.mark.parametrize("asynchronous", [False, True])
def test_the_client_sends_an_npz_and_gets_the_same_answer(url: str, asynchronous: bool) -> None:
    ids, draft = _drafts()
    body = {
        "hidden_states": HIDDEN.tolist(),
        "draft_token_ids": ids.tolist(),
        "draft_probs": draft.tolist(),
        "sample": {"top_k": 40},
        "banned_token_ids": [int(ids[0, 0])],
        "seeds": SEEDS,
        "temperature": 0.9,
    }
    expected = _post(url, json=body).json()
    options: dict[str, Any] = {"temperature": 0.9, "sample": {"top_k": 40}}
    options["banned_token_ids"] = [int(ids[0, 0])]
    if asynchronous:

        async def call() -> dict[str, Any]:
            async with AsyncClient(url) as client:
                return await client.verify(
                    "head", HIDDEN, ids, draft_probs=draft, seeds=SEEDS, **options
                )

        answer = asyncio.run(call())
    else:
        with Client(url) as client:
            answer = client.verify("head", HIDDEN, ids, draft_probs=draft, seeds=SEEDS, **options)
    assert answer["results"] == expected["results"]
    assert answer["results"][0]["token_ids"][0] != ids[0, 0]  # banned: never emitted


def test_a_draft_model_computes_the_draft_distribution(url: str) -> None:
    """The drafter head (d_model 8) reads its own states with the same temperature: its
    distribution is the rule's q; the request carries 8 floats per draft, not 300."""
    states = RNG.standard_normal((SEQUENCES, K, 8)).astype(np.float32)
    logits = states.astype(np.float64) @ DRAFTER.astype(np.float64).T / 0.8
    q = np.exp(log_softmax(logits))
    ids = np.argmax(q, axis=2)
    ids[:, 0] = np.argmax(_reference(0.8)[:, 0], axis=1)
    with Client(url) as client:
        answer = client.verify(
            "head",
            HIDDEN,
            ids,
            seeds=SEEDS,
            temperature=0.8,
            draft_model="drafter",
            draft_hidden_states=states,
        )
    expected = verify_chain(_reference(0.8), ids, uniforms(SEEDS, K + 1), q)
    for row, result in enumerate(answer["results"]):
        assert result["token_ids"] == expected.token_ids[row, : result["accepted"] + 1].tolist()
    body = {"hidden_states": HIDDEN.tolist(), "draft_token_ids": ids.tolist()}
    refused = _post(url, json=body | {"draft_model": "drafter"})
    assert refused.status_code == 422
    assert "draft_hidden_states" in refused.text


def test_penalties_over_the_wire_count_the_earlier_drafts(url: str) -> None:
    """JSON and .npz bodies carry per-sequence histories: the answer with a presence
    penalty and histories equals the greedy reference with the drafts counted."""
    hidden = HIDDEN.copy()
    hidden[:, 1] = hidden[:, 0]
    logits = hidden.astype(np.float64) @ TABLE.astype(np.float64).T
    top = np.argmax(logits[:, 0], axis=1)
    ids = np.repeat(top[:, None], K, axis=1)
    history = [[int(top[s]) + 1] for s in range(SEQUENCES)]
    expected = []
    for s in range(SEQUENCES):
        accepted = 0
        for position in range(K + 1):
            seen = [*history[s], *ids[s, :position].tolist()]
            shifted = logits[s, position] - 1.5 * np.isin(np.arange(VOCAB), seen)
            if position == K or int(np.argmax(shifted)) != ids[s, position]:
                break
            accepted += 1
        expected.append(accepted)
    body = {
        "hidden_states": hidden.tolist(),
        "draft_token_ids": ids.tolist(),
        "temperature": 0,
        "presence_penalty": 1.5,
        "output_token_ids": history,
    }
    answer = _post(url, json=body)
    assert answer.status_code == 200, answer.text
    assert [row["accepted"] for row in answer.json()["results"]] == expected
    archive = io.BytesIO()
    np.savez(
        archive,
        hidden_states=hidden,
        draft_token_ids=ids,
        output_token_ids=np.array([h[0] for h in history]),
        output_token_ids_lengths=np.ones(SEQUENCES, np.int64),
    )
    binary = _post(
        url,
        content=archive.getvalue(),
        params={"temperature": "0", "presence_penalty": "1.5"},
        headers={"content-type": "application/x-npz"},
    )
    assert binary.status_code == 200, binary.text
    assert [row["accepted"] for row in binary.json()["results"]] == expected
    with Client(url) as client:
        sent = client.verify(
            "head", hidden, ids, temperature=0, presence_penalty=1.5, output_token_ids=history
        )
    assert [row["accepted"] for row in sent["results"]] == expected
