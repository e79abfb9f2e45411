"""``/verify`` through the data plane, in process, against numpy: the target distribution is
the float64 reference's (temperature, top-k) at every position, the rule applied to it with
the sequences' seeds gives the plane's answer, the answer's log-probs are the reference's;
greedy verification is greedy decoding of the same states; runs split a request (rows of
several runs); bad inputs are refused naming their field; /metrics counts drafts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import pytest

from service.errors import InvalidInput
from service.heads.files import HeadWeights, save_head
from service.messages import (
    DecodingOptions,
    SampleOptions,
    Target,
    TokenLists,
    VocabularyOptions,
)
from service.metrics import Metrics
from service.plane.dataplane import DataPlane
from service.repository.registry import Registry
from service.runtime.verification import uniforms, verify_chain, verify_tree
from service.settings import Settings
from service.verify_messages import VerifyRequest, VerifyResult
from tests.conftest import D_MODEL, VOCAB, reference_logits

HEAD = Target("head")
RUN_ROWS = 8
SEQUENCES, K = 6, 3
DRAFT_D = 24
T = TypeVar("T")
Doubles = npt.NDArray[np.float64]


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("verify")
    table = np.random.default_rng(46).standard_normal((VOCAB, D_MODEL), dtype=np.float32)
    save_head(HeadWeights.from_arrays(table * 0.3), root / HEAD.model / "1")
    drafter = np.random.default_rng(47).standard_normal((VOCAB, DRAFT_D), dtype=np.float32)
    save_head(HeadWeights.from_arrays(drafter * 0.3), root / "drafter" / "1")
    other = np.random.default_rng(48).standard_normal((VOCAB - 1, D_MODEL), dtype=np.float32)
    save_head(HeadWeights.from_arrays(other), root / "other" / "1")
    return root


def _served(repository: Path, call: Callable[[DataPlane], Awaitable[T]]) -> tuple[T, bytes]:
    """``call`` on a data plane over the repository (runs of 8 rows), and its metrics."""

    @asynccontextmanager
    async def plane() -> AsyncIterator[tuple[DataPlane, Metrics]]:
        settings = Settings(
            repository=repository, max_rows=1024, max_logits_bytes=RUN_ROWS * 2 * VOCAB * 4
        )
        metrics = Metrics()
        with ThreadPoolExecutor(1) as executor:
            registry = Registry(settings, executor, metrics)
            serving = DataPlane(registry, settings, metrics)
            await registry.load_all()
            try:
                yield serving, metrics
            finally:
                await serving.close()
                await registry.close()

    async def main() -> tuple[T, bytes]:
        async with plane() as (serving, metrics):
            return await call(serving), metrics.render()

    return asyncio.run(main())


def _target(
    repository: Path, hidden: Doubles, temperature: float, top_k: int | None, head: str = "head"
) -> Doubles:
    """The reference distribution at every position: softmax(logits / T), top-k kept."""
    logits = reference_logits(repository / head / "1", hidden.reshape(-1, hidden.shape[-1]))
    logits = logits / temperature
    if top_k is not None:
        floor = np.sort(logits, axis=1)[:, -top_k][:, None]
        logits = np.where(logits >= floor, logits, -np.inf)
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    shaped: Doubles = (probs / probs.sum(axis=1, keepdims=True)).reshape(*hidden.shape[:2], -1)
    return shaped


def _inputs(seed: int) -> tuple[npt.NDArray[np.float32], Doubles]:
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((SEQUENCES, K + 1, D_MODEL), dtype=np.float32)
    draft = rng.dirichlet(np.full(VOCAB, 0.05), size=(SEQUENCES, K))
    return hidden, draft


def _verify(repository: Path, request: VerifyRequest) -> tuple[VerifyResult, bytes]:
    async def call(plane: DataPlane) -> VerifyResult:
        return await plane.verify(request)

    return _served(repository, call)


def test_a_chain_with_draft_probs_follows_the_rule_on_the_reference(repository: Path) -> None:
    """Temperature 0.7 and top-k 50 shape the target; drafts are the draft's own top token
    (some kept by the target's top-k, some not); the answer is the rule's over the
    reference distribution with the same seeds, and its log-probs the reference's."""
    hidden, draft = _inputs(1)
    target = _target(repository, hidden.astype(np.float64), 0.7, 50)
    draft_ids = np.argmax(draft, axis=2)
    for position in (0, 1):  # the target's favourite: often kept
        draft_ids[:, position] = np.argmax(target[:, position], axis=1)
        draft[np.arange(SEQUENCES), position, draft_ids[:, position]] += 0.5
    draft /= draft.sum(axis=2, keepdims=True)
    seeds = np.arange(100, 100 + SEQUENCES)
    options = VocabularyOptions(sample=SampleOptions(temperature=0.7, top_k=50))
    request = VerifyRequest(
        HEAD, hidden, draft_ids, draft.astype(np.float32), vocabulary=options, seeds=seeds
    )
    result, metrics = _verify(repository, request)
    expected = verify_chain(target, draft_ids, uniforms(seeds.tolist(), K + 1), draft)
    assert result.accepted.tolist() == expected.accepted.tolist()
    assert len(set(result.accepted.tolist())) >= 2  # some accepted, some not
    assert result.token_ids.tolist() == expected.token_ids.tolist()
    assert result.nodes.tolist() == expected.nodes.tolist()
    listed = expected.token_ids >= 0
    rows = np.nonzero(listed)[0]
    reference = np.log(target[rows, expected.positions[listed], expected.token_ids[listed]])
    assert result.logprobs_mode == "raw"  # no decoding options: /topk's default
    raw = np.log(_target(repository, hidden.astype(np.float64), 0.7, None))
    raw_reference = raw[rows, expected.positions[listed], expected.token_ids[listed]]
    np.testing.assert_allclose(result.logprobs[listed], raw_reference, rtol=1e-4, atol=1e-4)
    assert np.isfinite(reference).all()  # every emitted token has mass in the target
    assert result.seeds.tolist() == seeds.tolist()
    drafted = f'lmhead_verify_drafted_tokens_total{{model="head"}} {float(SEQUENCES * K)}'
    accepted = f'lmhead_verify_accepted_tokens_total{{model="head"}} {float(result.accepted.sum())}'
    assert drafted in metrics.decode()
    assert accepted in metrics.decode()


def test_a_tree_and_drafts_taken_as_certain_follow_the_rule(repository: Path) -> None:
    """Two children at the root, a grandchild under the second; no draft distribution."""
    hidden, _ = _inputs(2)
    target = _target(repository, hidden.astype(np.float64), 1.0, None)
    parents = np.array([-1, -1, 1])
    draft_ids = np.stack(
        [
            np.argsort(target[:, 0], axis=1)[:, -2],
            np.argmax(target[:, 0], axis=1),
            np.argmax(target[:, 2], axis=1),
        ],
        axis=1,
    )
    seeds = np.arange(7, 7 + SEQUENCES)
    request = VerifyRequest(HEAD, hidden, draft_ids, draft_parents=parents, seeds=seeds)
    result, _ = _verify(repository, request)
    expected = verify_tree(target, draft_ids, parents, uniforms(seeds.tolist(), K + 1))
    assert result.token_ids.tolist() == expected.token_ids.tolist()
    assert result.nodes.tolist() == expected.nodes.tolist()


def test_greedy_verification_is_greedy_decoding(repository: Path) -> None:
    """Temperature 0: the drafts are the reference's top tokens but for one per sequence
    (at a position of its own); the answer is greedy decoding of the same states."""
    hidden, _ = _inputs(3)
    top = np.argmax(reference_logits(repository / HEAD.model / "1", hidden.reshape(-1, D_MODEL)), 1)
    top = top.reshape(SEQUENCES, K + 1)
    draft_ids = top[:, :K].copy()
    for sequence in range(SEQUENCES):
        if sequence < K:
            draft_ids[sequence, sequence] = (draft_ids[sequence, sequence] + 1) % VOCAB
    result, _ = _verify(repository, VerifyRequest(HEAD, hidden, draft_ids, temperature=0.0))
    for sequence in range(SEQUENCES):
        stop = sequence if sequence < K else K
        assert result.accepted[sequence] == stop
        assert result.token_ids[sequence, : stop + 1].tolist() == top[sequence, : stop + 1].tolist()


def test_a_seed_gives_the_same_answer_alone_or_in_a_batch(repository: Path) -> None:
    hidden, draft = _inputs(4)
    draft_ids = np.argmax(draft, axis=2)
    probs = draft.astype(np.float32)
    seeds = np.arange(SEQUENCES) * 1000
    batch, _ = _verify(repository, VerifyRequest(HEAD, hidden, draft_ids, probs, seeds=seeds))
    alone, _ = _verify(
        repository, VerifyRequest(HEAD, hidden[3:4], draft_ids[3:4], probs[3:4], seeds=seeds[3:4])
    )
    assert alone.token_ids[0].tolist() == batch.token_ids[3].tolist()


def _bad(**changes: Any) -> dict[str, Any]:
    hidden, draft = _inputs(5)
    fields: dict[str, Any] = {
        "target": HEAD,
        "hidden_states": hidden,
        "draft_token_ids": np.argmax(draft, axis=2),
        "draft_probs": draft.astype(np.float32),
    }
    fields.update(changes)
    return fields


def _negative() -> npt.NDArray[np.float32]:
    probs: npt.NDArray[np.float32] = _bad()["draft_probs"].copy()
    probs[0, 0, :2] = [-0.1, 0.1]
    return probs


def _zero_own() -> npt.NDArray[np.float32]:
    fields = _bad()
    probs: npt.NDArray[np.float32] = fields["draft_probs"].copy()
    probs[2, 1] = 1.0 / (VOCAB - 1)
    probs[2, 1, fields["draft_token_ids"][2, 1]] = 0.0
    return probs


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"draft_token_ids": np.zeros((SEQUENCES, K + 1), np.int64)}, "draft_token_ids must"),
        ({"draft_token_ids": np.full((SEQUENCES, K), VOCAB)}, "draft_token_ids"),
        ({"draft_probs": np.full((SEQUENCES, K, VOCAB), 2.0 / VOCAB, np.float32)}, "sum to 1"),
        ({"draft_probs": "negative"}, "non-negative"),
        ({"draft_probs": "zero own"}, "probability 0"),
        ({"draft_probs": None, "draft_parents": np.array([-1, 1, 0])}, "draft_parents[1]"),
        ({"draft_probs": None, "draft_parents": np.array([-1, 2, 0])}, "points forward"),
        ({"seeds": np.zeros(2, np.int64)}, "seeds must be 6 integers"),
    ],
)
def test_bad_input_is_refused_naming_the_field(
    repository: Path, changes: dict[str, Any], named: str
) -> None:
    if isinstance(changes.get("draft_probs"), str):
        changes = {
            "draft_probs": _negative() if changes["draft_probs"] == "negative" else _zero_own()
        }
    with pytest.raises(InvalidInput, match=None) as refused:
        _verify(repository, VerifyRequest(**_bad(**changes)))
    assert named in str(refused.value)


def test_a_draft_model_gives_the_draft_distribution_with_the_same_options(
    repository: Path,
) -> None:
    """The drafter (another head, d_model 24) reads its own states; its distribution, shaped
    by the same temperature and top-k, is the q of the rule: the answer is the rule's over
    both reference distributions."""
    hidden, _ = _inputs(6)
    states = np.random.default_rng(7).standard_normal((SEQUENCES, K, DRAFT_D), dtype=np.float32)
    target = _target(repository, hidden.astype(np.float64), 0.9, 60)
    draft = _target(repository, states.astype(np.float64), 0.9, 60, head="drafter")
    draft_ids = np.argmax(draft, axis=2)
    draft_ids[:, 0] = np.argmax(target[:, 0], axis=1)  # kept by the drafter's top-60 or not
    seeds = np.arange(3, 3 + SEQUENCES)
    options = VocabularyOptions(sample=SampleOptions(temperature=0.9, top_k=60))
    request = VerifyRequest(
        HEAD,
        hidden,
        draft_ids,
        vocabulary=options,
        seeds=seeds,
        draft_model="drafter",
        draft_hidden_states=states,
    )
    if (np.take_along_axis(draft, draft_ids[:, :, None], axis=2) == 0).any():
        with pytest.raises(InvalidInput, match="probability 0 under these options"):
            _verify(repository, request)
        draft_ids[:, 0] = np.argmax(draft[:, 0], axis=1)
        request = VerifyRequest(
            HEAD,
            hidden,
            draft_ids,
            vocabulary=options,
            seeds=seeds,
            draft_model="drafter",
            draft_hidden_states=states,
        )
    result, _ = _verify(repository, request)
    expected = verify_chain(target, draft_ids, uniforms(seeds.tolist(), K + 1), draft)
    assert result.token_ids.tolist() == expected.token_ids.tolist()


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"draft_model": "other"}, "must name the same tokens"),
        ({"draft_model": "drafter"}, "draft_model needs draft_hidden_states"),
        (
            {"draft_model": "drafter", "draft_hidden_states": np.zeros((SEQUENCES, K, D_MODEL))},
            "draft_hidden_states",
        ),
        ({"draft_hidden_states": np.zeros((SEQUENCES, K, DRAFT_D))}, "needs draft_model"),
    ],
)
def test_a_bad_draft_model_is_refused_naming_the_field(
    repository: Path, changes: dict[str, Any], named: str
) -> None:
    fields = _bad(**changes)
    del fields["draft_probs"]
    with pytest.raises(InvalidInput) as refused:
        _verify(repository, VerifyRequest(**fields))
    assert named in str(refused.value)


def test_penalties_count_the_earlier_drafts(repository: Path) -> None:
    """Histories are per sequence; each position's counts the drafts before it. Positions 0
    and 1 share their state (the same top token), every draft is that token: without the
    drafts in the history the second would be accepted; a presence penalty of 2 on it (the
    first draft counted) moves the greedy top where the runner-up is within 2."""
    hidden, _ = _inputs(8)
    hidden[:, 1] = hidden[:, 0]
    logits = reference_logits(repository / HEAD.model / "1", hidden.reshape(-1, D_MODEL))
    logits = logits.reshape(SEQUENCES, K + 1, -1)
    top = np.argmax(logits[:, 0], axis=1)
    draft_ids = np.repeat(top[:, None], K, axis=1)
    expected_accepted = []
    for sequence in range(SEQUENCES):
        accepted = 0
        for position in range(K + 1):
            seen = set(draft_ids[sequence, :position].tolist())
            penalized = logits[sequence, position] - 2.0 * np.isin(np.arange(VOCAB), list(seen))
            if position == K or int(np.argmax(penalized)) != draft_ids[sequence, position]:
                break
            accepted += 1
        expected_accepted.append(accepted)
    assert 1 in expected_accepted  # the penalty turned the second draft down somewhere
    options = VocabularyOptions(decoding=DecodingOptions(presence_penalty=2.0))
    request = VerifyRequest(HEAD, hidden, draft_ids, temperature=0.0, vocabulary=options)
    result, _ = _verify(repository, request)
    assert result.accepted.tolist() == expected_accepted


def _everything(rng: np.random.Generator, keep: npt.NDArray[np.int64]) -> VocabularyOptions:
    """Every option at once: filters, penalties with histories, bias, bans and a mask
    (allowed ids: 700 tokens, ``keep`` among them), processed log-probs."""
    allowed = np.union1d(rng.choice(VOCAB, 700, replace=False), keep)
    banned = np.setdiff1d(rng.choice(VOCAB, 20, replace=False), keep)
    histories = TokenLists.of([rng.choice(VOCAB, 5).tolist() for _ in range(SEQUENCES)])
    return VocabularyOptions(
        allowed_token_ids=allowed,
        logit_bias={int(token): 1.5 for token in rng.choice(allowed, 8)},
        banned_token_ids=banned,
        sample=SampleOptions(temperature=0.8, top_k=200, top_p=0.9, min_p=0.002),
        decoding=DecodingOptions(
            output_token_ids=histories,
            presence_penalty=0.4,
            repetition_penalty=1.2,
            logprobs_mode="processed",
        ),
    )


@pytest.mark.parametrize(
    "case", ["temperature", "temperature, certain", "everything", "draft_model", "greedy"]
)
def test_a_chain_answers_as_the_same_chain_sent_as_a_tree(repository: Path, case: str) -> None:
    """A chain reads the drafts' probabilities and each sequence's stopping row alone
    (``verify_plain``); the same drafts sent as a tree (parents 0..K-2: the dense path, every
    position's whole row) give the same answer, under every option, with draft_probs, a
    draft_model or drafts taken as certain, and greedily."""
    hidden, draft = _inputs(9)
    rng = np.random.default_rng(9)
    target = _target(repository, hidden.astype(np.float64), 0.7, None)
    draft_ids = np.argmax(target[:, :K], axis=2)
    draft_ids[::2, 1] = np.argmax(draft[::2, 1], axis=1)
    draft[np.arange(SEQUENCES)[:, None], np.arange(K)[None, :], draft_ids] += 0.3
    draft /= draft.sum(axis=2, keepdims=True)
    probs = None if "certain" in case or case == "draft_model" else draft.astype(np.float32)
    options = VocabularyOptions(sample=SampleOptions(temperature=0.7))
    extra: dict[str, Any] = {}
    if case == "everything":
        options = _everything(rng, draft_ids.reshape(-1))
    elif case == "greedy":
        penalty = DecodingOptions(repetition_penalty=1.3)
        options = VocabularyOptions(sample=SampleOptions(temperature=0.0), decoding=penalty)
    elif case == "draft_model":
        states = rng.standard_normal((SEQUENCES, K, DRAFT_D), dtype=np.float32)
        drafter = _target(repository, states.astype(np.float64), 0.9, None, head="drafter")
        draft_ids = np.argmax(drafter, axis=2)
        extra = {"draft_model": "drafter", "draft_hidden_states": states}
        options = VocabularyOptions(
            sample=SampleOptions(temperature=0.9, top_p=0.95),
            decoding=DecodingOptions(frequency_penalty=0.3),
        )
    seeds = np.arange(11, 11 + SEQUENCES)
    sent = {"vocabulary": options, "seeds": seeds, **extra}
    chain, _ = _verify(repository, VerifyRequest(HEAD, hidden, draft_ids, probs, **sent))
    tree = np.arange(-1, K - 1)
    dense, _ = _verify(
        repository, VerifyRequest(HEAD, hidden, draft_ids, probs, draft_parents=tree, **sent)
    )
    assert chain.accepted.tolist() == dense.accepted.tolist()
    assert chain.token_ids.tolist() == dense.token_ids.tolist()
    if case not in ("greedy", "draft_model"):
        assert len(set(chain.accepted.tolist())) >= 2
    assert chain.logprobs_mode == dense.logprobs_mode
    listed = chain.token_ids >= 0
    np.testing.assert_allclose(chain.logprobs[listed], dense.logprobs[listed], atol=1e-4)
    assert np.isnan(chain.logprobs[~listed]).all()


def test_a_tree_with_draft_probs_follows_the_multi_draft_rule(repository: Path) -> None:
    """Two root children drawn from one q, a grandchild under the second: the answer is
    the rule's (``verify_tree`` with the draft rows) over the reference distribution."""
    hidden, draft = _inputs(10)
    target = _target(repository, hidden.astype(np.float64), 1.0, None)
    draft[:, 0] = draft[:, 1] = 0.5 * draft[:, 0] + 0.5 * target[:, 0]  # siblings share q
    draft[:, 2] = 0.5 * draft[:, 2] + 0.5 * target[:, 2]
    parents = np.array([-1, -1, 1])
    rng = np.random.default_rng(10)
    draft_ids = np.stack(
        [
            np.array([rng.choice(VOCAB, p=row / row.sum()) for row in draft[:, node]])
            for node in range(K)
        ],
        axis=1,
    )
    seeds = np.arange(20, 20 + SEQUENCES)
    probs = draft.astype(np.float32)
    request = VerifyRequest(HEAD, hidden, draft_ids, probs, draft_parents=parents, seeds=seeds)
    result, _ = _verify(repository, request)
    expected = verify_tree(target, draft_ids, parents, uniforms(seeds.tolist(), K + 1), draft)
    assert result.token_ids.tolist() == expected.token_ids.tolist()
    assert result.nodes.tolist() == expected.nodes.tolist()
