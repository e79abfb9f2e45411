"""``/verify`` with the decoding step's options on the target and a draft_model alike, in
process against float64 numpy: ``allowed_token_ids`` restrict both distributions (a draft
outside them is rejected, never emitted), a draft_model's rows take the penalties with their
own histories (the drafts before each), the bitmask and allowed ids of the position they were
drawn at, on chains and trees; what /verify refuses, naming the field."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from service.errors import InvalidInput
from service.heads.files import HeadWeights, save_head
from service.messages import DecodingOptions, SampleOptions, Target, TokenLists, VocabularyOptions
from service.metrics import Metrics
from service.plane.dataplane import DataPlane
from service.repository.registry import Registry
from service.runtime.processors import pack
from service.runtime.verification import uniforms, verify_chain, verify_greedy, verify_tree
from service.settings import Settings
from service.verify_messages import VerifyRequest, VerifyResult
from tests.conftest import D_MODEL, VOCAB, reference_logits

HEAD = Target("head")
SEQUENCES, K = 6, 3
DRAFT_D = 24
Doubles = npt.NDArray[np.float64]


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("verify-options")
    table = np.random.default_rng(146).standard_normal((VOCAB, D_MODEL), dtype=np.float32)
    save_head(HeadWeights.from_arrays(table * 0.3), root / HEAD.model / "1")
    drafter = np.random.default_rng(147).standard_normal((VOCAB, DRAFT_D), dtype=np.float32)
    save_head(HeadWeights.from_arrays(drafter * 0.3), root / "drafter" / "1")
    save_head(HeadWeights.from_arrays(table * 0.27), root / "twin" / "1")  # a close drafter
    return root


def _verify(repository: Path, request: VerifyRequest) -> VerifyResult:
    """``request`` on a data plane over the repository (runs of 8 rows)."""

    async def main() -> VerifyResult:
        settings = Settings(repository=repository, max_rows=8192, max_logits_bytes=8 * VOCAB * 8)
        metrics = Metrics()
        with ThreadPoolExecutor(1) as executor:
            registry = Registry(settings, executor, metrics)
            plane = DataPlane(registry, settings, metrics)
            await registry.load_all()
            try:
                return await plane.verify(request)
            finally:
                await plane.close()
                await registry.close()

    return asyncio.run(main())


def _softmax(logits: Doubles) -> Doubles:
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs: Doubles = shifted / shifted.sum(axis=-1, keepdims=True)
    return probs


def _logits(repository: Path, head: str, states: npt.NDArray[np.float32]) -> Doubles:
    flat = reference_logits(repository / head / "1", states.reshape(-1, states.shape[-1]))
    return flat.reshape(*states.shape[:-1], VOCAB)


def _allowed_lists(rng: np.random.Generator, rows: int, n: int) -> npt.NDArray[np.int64]:
    return np.stack([rng.choice(VOCAB, n, replace=False) for _ in range(rows)]).astype(np.int64)


def _mask(allowed: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
    """(rows, VOCAB): True where a row allows the token."""
    mask = np.zeros((len(allowed), VOCAB), np.bool_)
    np.put_along_axis(mask, allowed, True, axis=1)
    return mask


def test_allowed_ids_restrict_the_target_and_reject_drafts_outside_them(repository: Path) -> None:
    """One allowed list per sequence (half the vocabulary): the target at every position is
    softmax(logits / T) over the allowed tokens, top-k 40 among them; drafts (from a random
    q near the target, some outside the lists) follow the rule over that reference; a draft
    outside its list is never accepted and every emitted token is allowed; log-probs (raw)
    are those of the allowed tokens' softmax."""
    rng = np.random.default_rng(1)
    hidden = rng.standard_normal((SEQUENCES, K + 1, D_MODEL), dtype=np.float32)
    allowed = _allowed_lists(rng, SEQUENCES, VOCAB // 2)
    allowed_at = np.repeat(_mask(allowed)[:, None, :], K + 1, axis=1)
    logits = np.where(allowed_at, _logits(repository, "head", hidden) / 0.8, -np.inf)
    raw = _softmax(logits)
    floor = np.sort(logits, axis=2)[:, :, -40][:, :, None]
    target = _softmax(np.where(logits >= floor, logits, -np.inf))
    draft = rng.dirichlet(np.full(VOCAB, 0.05), size=(SEQUENCES, K))
    draft = 0.2 * draft + 0.8 * target[:, :K]
    draft_ids = np.array([[rng.choice(VOCAB, p=row) for row in rows] for rows in draft])
    draft_ids[1::2] = np.argmax(target[1::2, :K], axis=2)  # the target's favourites
    draft_ids[::2, 0] = np.argmax(np.where(allowed_at[::2, 0], -1.0, draft[::2, 0]), axis=1)
    outside = ~np.take_along_axis(allowed_at[:, :K], draft_ids[:, :, None], axis=2)[:, :, 0]
    assert outside.any()
    assert (~outside).any()
    seeds = np.arange(300, 300 + SEQUENCES)
    options = VocabularyOptions(
        allowed_token_ids=allowed, sample=SampleOptions(temperature=0.8, top_k=40)
    )
    probs = draft.astype(np.float32)
    result = _verify(
        repository, VerifyRequest(HEAD, hidden, draft_ids, probs, vocabulary=options, seeds=seeds)
    )
    expected = verify_chain(target, draft_ids, uniforms(seeds.tolist(), K + 1), draft)
    assert result.accepted.tolist() == expected.accepted.tolist()
    assert result.token_ids.tolist() == expected.token_ids.tolist()
    assert len(set(result.accepted.tolist())) >= 2
    first_outside = np.where(outside.any(axis=1), np.argmax(outside, axis=1), K)
    assert (result.accepted <= first_outside).all()  # never past a draft outside the list
    listed = result.token_ids >= 0
    rows = np.nonzero(listed)[0]
    assert _mask(allowed)[rows, result.token_ids[listed]].all()
    reference = np.log(raw[rows, expected.positions[listed], expected.token_ids[listed]])
    np.testing.assert_allclose(result.logprobs[listed], reference, rtol=1e-4, atol=1e-4)


def test_allowed_ids_per_position_verify_greedily(repository: Path) -> None:
    """One allowed list per position (sequences x (K + 1) lists): greedy verification is
    greedy decoding restricted to each position's list."""
    rng = np.random.default_rng(2)
    hidden = rng.standard_normal((SEQUENCES, K + 1, D_MODEL), dtype=np.float32)
    allowed = _allowed_lists(rng, SEQUENCES * (K + 1), 20)
    mask = _mask(allowed).reshape(SEQUENCES, K + 1, VOCAB)
    logits = np.where(mask, _logits(repository, "head", hidden), -np.inf)
    top = np.argmax(logits, axis=2)
    draft_ids = top[:, :K].copy()
    draft_ids[1, 1] = allowed[1 * (K + 1) + 1][allowed[1 * (K + 1) + 1] != top[1, 1]][0]
    draft_ids[2, 0] = top[0, 0] if top[0, 0] != top[2, 0] else (top[2, 0] + 1) % VOCAB
    options = VocabularyOptions(allowed_token_ids=allowed)
    result = _verify(
        repository, VerifyRequest(HEAD, hidden, draft_ids, temperature=0.0, vocabulary=options)
    )
    expected = verify_greedy(_softmax(logits), draft_ids)
    assert result.accepted.tolist() == expected.accepted.tolist()
    assert result.accepted.tolist()[:3] == [K, 1, 0]
    assert result.token_ids.tolist() == expected.token_ids.tolist()


def _processed(
    logits: Doubles,
    histories: list[list[int]],
    drafts: npt.NDArray[np.int64],
    rows: list[tuple[int, list[int]]],
    mask: npt.NDArray[np.bool_],
) -> Doubles:
    """The reference step at each (sequence, drafted path) of ``rows``: masked to ``mask``
    row by row, a presence penalty of 1.5 on the sequence's history plus the drafts of the
    path, then the temperature 0.9; probabilities (len(rows), VOCAB)."""
    out = np.empty((len(rows), VOCAB))
    for index, (sequence, path) in enumerate(rows):
        seen = {*histories[sequence], *drafts[sequence, path].tolist()}
        row = logits[index] - 1.5 * np.isin(np.arange(VOCAB), list(seen))
        out[index] = _softmax(np.where(mask[index], row, -np.inf) / 0.9)
    return out


@pytest.mark.parametrize("tree", [False, True])
def test_a_draft_model_takes_the_per_row_options_of_the_positions_it_drafted_at(
    repository: Path, tree: bool
) -> None:
    """Histories per sequence, a presence penalty, a bitmask per position and allowed ids
    per sequence: the drafter's row for node j is processed as the target's at the position
    node j was drawn at (its parent's, after the same drafts). The drafter is the target's
    table scaled (its states the target's, perturbed: a close q, so drafts are accepted and
    rejected). A chain, and a tree of two root children (one drafter state) and a
    grandchild; the answer is the rule's over both reference distributions."""
    rng = np.random.default_rng(3 + tree)
    parents = np.array([-1, -1, 1]) if tree else np.array([-1, 0, 1])
    at = parents + 1  # the position each node was drafted at
    hidden = rng.standard_normal((SEQUENCES, K + 1, D_MODEL), dtype=np.float32)
    noise = 0.3 * rng.standard_normal((SEQUENCES, K + 1, D_MODEL), dtype=np.float32)
    states = (hidden + noise)[:, at]  # node j's: where its parent stands (siblings: one)
    histories = [rng.integers(0, VOCAB, size=int(rng.integers(0, 6))).tolist() for _ in hidden]
    allowed = _allowed_lists(rng, SEQUENCES, VOCAB - 100)
    bits = rng.random((SEQUENCES * (K + 1), VOCAB)) < 0.8
    mask = (bits & np.repeat(_mask(allowed), K + 1, axis=0)).reshape(SEQUENCES, K + 1, VOCAB)
    target_logits = _logits(repository, "head", hidden)
    draft_logits = _logits(repository, "twin", states)
    paths: list[list[int]] = [[]]
    for node in range(K):
        paths.append([*paths[at[node]], node])
    draft_ids = np.zeros((SEQUENCES, K), np.int64)
    drafted = np.zeros((SEQUENCES, K, VOCAB))
    for node in range(K):  # each node drawn from the drafter's processed row, in order
        rows = [(s, paths[at[node]]) for s in range(SEQUENCES)]
        q = _processed(draft_logits[:, node], histories, draft_ids, rows, mask[:, at[node]])
        drafted[:, node] = q
        draft_ids[:, node] = [rng.choice(VOCAB, p=row) for row in q]
    if tree:  # siblings drawn from one distribution
        np.testing.assert_allclose(drafted[:, 0], drafted[:, 1], rtol=1e-12)
    rows = [(s, paths[p]) for s in range(SEQUENCES) for p in range(K + 1)]
    target = _processed(
        target_logits.reshape(-1, VOCAB), histories, draft_ids, rows, mask.reshape(-1, VOCAB)
    ).reshape(SEQUENCES, K + 1, VOCAB)
    seeds = np.arange(40, 40 + SEQUENCES)
    decoding = DecodingOptions(
        output_token_ids=TokenLists.of(histories),
        presence_penalty=1.5,
        token_bitmask=pack(bits),
    )
    options = VocabularyOptions(
        allowed_token_ids=allowed, sample=SampleOptions(temperature=0.9), decoding=decoding
    )
    request = VerifyRequest(
        HEAD,
        hidden,
        draft_ids,
        draft_parents=parents if tree else None,
        vocabulary=options,
        seeds=seeds,
        draft_model="twin",
        draft_hidden_states=states,
    )
    result = _verify(repository, request)
    u = uniforms(seeds.tolist(), K + 1)
    if tree:
        expected = verify_tree(target, draft_ids, parents, u, drafted)
    else:
        expected = verify_chain(target, draft_ids, u, drafted)
    assert result.token_ids.tolist() == expected.token_ids.tolist()
    assert len(set(result.accepted.tolist())) >= 2
    assert result.nodes.tolist() == expected.nodes.tolist()
    listed = expected.token_ids >= 0
    picked = np.nonzero(listed)[0], expected.positions[listed], expected.token_ids[listed]
    np.testing.assert_allclose(result.logprobs[listed], np.log(target[picked]), atol=1e-4)


def _request(**changes: Any) -> VerifyRequest:
    rng = np.random.default_rng(5)
    fields: dict[str, Any] = {
        "target": HEAD,
        "hidden_states": rng.standard_normal((SEQUENCES, K + 1, D_MODEL), dtype=np.float32),
        "draft_token_ids": rng.integers(0, VOCAB, (SEQUENCES, K)),
    }
    return VerifyRequest(**(fields | changes))


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        (
            {"vocabulary": VocabularyOptions(allowed_token_ids=np.zeros((5, 3), np.int64))},
            "allowed_token_ids must be one list for every position, one per sequence (6)",
        ),
        (
            {"vocabulary": VocabularyOptions(sample=SampleOptions(n=2))},
            "sample.n does not apply to /verify (got 2): a verification emits one token",
        ),
        (
            {"vocabulary": VocabularyOptions(logprobs_over="vocabulary")},
            "logprobs_over does not apply to /verify",
        ),
        (
            {
                "draft_parents": np.array([-1, -1, 0]),
                "draft_model": "drafter",
                "draft_hidden_states": np.arange(SEQUENCES * K * DRAFT_D, dtype=np.float32).reshape(
                    SEQUENCES, K, DRAFT_D
                ),
            },
            "draft_hidden_states[:, 1] must equal draft_hidden_states[:, 0]",
        ),
        (
            {
                "draft_probs": np.full((SEQUENCES, K, VOCAB), 1 / VOCAB, np.float32),
                "draft_model": "drafter",
                "draft_hidden_states": np.zeros((SEQUENCES, K, DRAFT_D), np.float32),
            },
            "draft_model takes no draft_probs",
        ),
    ],
)
def test_what_verify_refuses_names_the_field(
    repository: Path, changes: dict[str, Any], named: str
) -> None:
    with pytest.raises(InvalidInput) as refused:
        _verify(repository, _request(**changes))
    assert named in str(refused.value)
