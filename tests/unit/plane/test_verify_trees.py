"""A tree of drafts taken as certain is read where the rule reads (``plane.verify_plain``: p
at each draft in its parent's row, one whole row where the walk ends): the same answer, seed
for seed, as the dense path (``plane.verify.verify``: every position's whole row), under
every option and greedily, in process against a loaded head."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from service.heads.files import HeadWeights, save_head
from service.limits import Limits
from service.messages import (
    DecodingOptions,
    SampleOptions,
    Target,
    TokenLists,
    VocabularyOptions,
)
from service.metrics import Metrics
from service.plane import verify, verify_checks
from service.plane.dataplane import DataPlane
from service.repository.registry import Registry
from service.settings import Settings
from service.verify_messages import VerifyRequest, VerifyResult
from tests.conftest import D_MODEL, VOCAB, reference_logits

HEAD = Target("head")
SEQUENCES = 24
#: Three children at the root (two may draw one token), two under the second, one below.
PARENTS = np.array([-1, -1, -1, 1, 1, 3])
RUN_ROWS = 8  # runs of 8 rows: a request's rows span several runs


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trees")
    table = np.random.default_rng(46).standard_normal((VOCAB, D_MODEL), dtype=np.float32)
    save_head(HeadWeights.from_arrays(table * 0.3), root / HEAD.model / "1")
    return root


def _both(repository: Path, request: VerifyRequest) -> tuple[VerifyResult, VerifyResult]:
    """The request served by the data plane (the fast reads), and the same checked inputs
    through the dense path."""

    async def main() -> tuple[VerifyResult, VerifyResult]:
        settings = Settings(
            repository=repository, max_rows=1024, max_logits_bytes=RUN_ROWS * 2 * VOCAB * 4
        )
        with ThreadPoolExecutor(1) as executor:
            registry = Registry(settings, executor, Metrics())
            serving = DataPlane(registry, settings, Metrics())
            await registry.load_all()
            try:
                fast = await serving.verify(request)
                model = registry.get(HEAD.model)
                checked = verify_checks.check(request, model, Limits.from_settings(settings))
                assert not checked.dense
                rows = checked.hidden.reshape(-1, D_MODEL)
                return fast, await verify.verify(model, checked, rows)
            finally:
                await serving.close()
                await registry.close()

    return asyncio.run(main())


def _options(case: str, rng: np.random.Generator, keep: np.ndarray) -> VocabularyOptions:
    if case == "greedy":
        penalty = DecodingOptions(repetition_penalty=1.3)
        return VocabularyOptions(sample=SampleOptions(temperature=0.0), decoding=penalty)
    if case == "temperature":
        return VocabularyOptions(sample=SampleOptions(temperature=0.7))
    allowed = np.union1d(rng.choice(VOCAB, 700, replace=False), keep)
    histories = TokenLists.of([rng.choice(VOCAB, 5).tolist() for _ in range(SEQUENCES)])
    return VocabularyOptions(
        allowed_token_ids=allowed,
        logit_bias={int(token): 1.5 for token in rng.choice(allowed, 8)},
        banned_token_ids=np.setdiff1d(rng.choice(VOCAB, 20, replace=False), keep),
        sample=SampleOptions(temperature=0.8, top_k=200, top_p=0.9, min_p=0.002),
        decoding=DecodingOptions(
            output_token_ids=histories,
            presence_penalty=0.4,
            repetition_penalty=1.2,
            logprobs_mode="processed",
        ),
    )


@pytest.mark.parametrize("case", ["temperature", "everything", "greedy"])
def test_a_tree_answers_as_the_dense_path(repository: Path, case: str) -> None:
    """Drafts are each node's parent's top tokens (often accepted) but for some sequences'
    (a runner-up, a sibling's token repeated, unlikely tokens at the root): some walks stop
    at the root, some go two or three deep; the fast reads and the dense path agree on
    every token, node and log-prob."""
    rng = np.random.default_rng(46)
    hidden = rng.standard_normal((SEQUENCES, len(PARENTS) + 1, D_MODEL), dtype=np.float32)
    logits = reference_logits(repository / HEAD.model / "1", hidden.reshape(-1, D_MODEL))
    ranked = np.argsort(-logits.reshape(SEQUENCES, len(PARENTS) + 1, VOCAB), axis=2)
    draft_ids = ranked[:, PARENTS + 1, 0].copy()
    draft_ids[:, 0] = ranked[:, 0, 1]  # the root's runner-up first, then its top
    draft_ids[::3, 2] = draft_ids[::3, 1]  # a sibling repeats a token
    draft_ids[1::4, 3] = ranked[1::4, 2, 5]
    draft_ids[::5, :3] = ranked[::5, 0, 300:303]  # the root's children all unlikely
    seeds = np.arange(30, 30 + SEQUENCES)
    options = _options(case, rng, draft_ids.reshape(-1))
    request = VerifyRequest(
        HEAD, hidden, draft_ids, draft_parents=PARENTS, vocabulary=options, seeds=seeds
    )
    fast, dense = _both(repository, request)
    assert fast.accepted.tolist() == dense.accepted.tolist()
    assert fast.token_ids.tolist() == dense.token_ids.tolist()
    assert fast.nodes.tolist() == dense.nodes.tolist()
    assert {0, 2} <= set(fast.accepted.tolist()), fast.accepted
    assert fast.logprobs_mode == dense.logprobs_mode
    listed = fast.token_ids >= 0
    np.testing.assert_allclose(fast.logprobs[listed], dense.logprobs[listed], atol=1e-4)
    assert np.isnan(fast.logprobs[~listed]).all()
