"""A request's declared cost (``service.plane.costs``): admitted or refused by the settings it
would pass, before any run; the figures grow with what the answer holds (rows, k, layers,
labels), in-process against a loaded head."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from service.budget import BODY_EXPANSION, IDLE_TRIM_BYTES, MemoryBudget, charge
from service.errors import PayloadTooLarge, ServerBusy
from service.heads.files import HeadWeights, save_head
from service.limits import Limits
from service.metrics import Metrics
from service.plane import costs
from service.plane.options import CheckedTopK
from service.plane.verify_checks import CheckedVerify
from service.repository.disk import LABELS_FILE
from service.repository.loaded_version import LoadedVersion
from service.repository.registry import Registry
from service.runtime.vocabulary import Ids, SampleSpec, Shape
from service.settings import Settings
from tests.conftest import D_MODEL, VOCAB

LIMITS = Limits(max_rows=64, max_k=50, max_logits_bytes=2**20, max_inflight_bytes=4 * 2**20)


def test_a_run_past_the_logits_limit_is_refused_naming_it() -> None:
    with pytest.raises(PayloadTooLarge, match="LMHEAD_MAX_LOGITS_BYTES=1048576"):
        costs.admit(costs.Cost(10, 2**20 + 1), LIMITS, "lens")


def test_a_cost_no_budget_holds_is_refused_even_alone() -> None:
    budget = MemoryBudget(LIMITS.max_inflight_bytes)
    with budget.request(), pytest.raises(PayloadTooLarge, match="LMHEAD_MAX_INFLIGHT_BYTES"):
        costs.admit(costs.Cost(4 * 2**20 + 1), LIMITS, "topk")
    assert budget.used == 0


def test_an_admitted_cost_is_charged_and_busy_beside_others() -> None:
    budget = MemoryBudget(LIMITS.max_inflight_bytes)
    with budget.request() as first:
        costs.admit(costs.Cost(3 * 2**20), LIMITS, "topk")
        assert first.bytes == budget.used == 3 * 2**20
        with budget.request(), pytest.raises(ServerBusy):
            costs.admit(costs.Cost(2 * 2**20), LIMITS, "topk")
    assert budget.used == 0


def test_a_run_counts_toward_handing_memory_back_however_small_the_charge() -> None:
    released: list[bool] = []
    budget = MemoryBudget(LIMITS.max_inflight_bytes, lambda: released.append(True))
    limits = Limits(64, 50, IDLE_TRIM_BYTES, LIMITS.max_inflight_bytes)
    with budget.request():
        costs.admit(costs.Cost(16, IDLE_TRIM_BYTES), limits, "lens")
    assert released == [True]


@pytest.fixture(scope="module")
def heads(
    tmp_path_factory: pytest.TempPathFactory, table: npt.NDArray[np.float32]
) -> Iterator[dict[str, LoadedVersion]]:
    root: Path = tmp_path_factory.mktemp("costs")
    for name, label in (("short", "t{}"), ("long", "{}" + "\x01" * 30)):
        save_head(HeadWeights.from_arrays(table), root / name / "1")
        labels = "".join(label.format(i) + "\n" for i in range(VOCAB))
        (root / name / "1" / LABELS_FILE).write_text(labels)
    loop = asyncio.new_event_loop()
    with ThreadPoolExecutor(1) as executor:
        registry = Registry(Settings(repository=root), executor, Metrics())
        loop.run_until_complete(registry.load_all())
        yield {name: registry.get(name) for name in ("short", "long")}
        loop.run_until_complete(registry.close())
    loop.close()


def _topk(model: LoadedVersion, rows: int, k: int, tokens: bool = True) -> int:
    hidden = np.zeros((rows, D_MODEL), np.float32)
    checked = CheckedTopK(hidden, k, 1.0)
    return costs.topk(model, checked, logprobs=True, tokens=tokens, residual=False).held


def test_a_topk_answer_grows_with_rows_k_and_labels(heads: dict[str, LoadedVersion]) -> None:
    short, long = heads["short"], heads["long"]
    assert long.label_bytes > short.label_bytes
    assert _topk(short, 2, 5) > _topk(short, 1, 5)
    assert _topk(short, 1, 10) > _topk(short, 1, 5)
    assert _topk(long, 64, 10) - _topk(short, 64, 10) >= costs.JSON_COPIES * 64 * 10 * (
        long.label_bytes - short.label_bytes
    )
    assert _topk(long, 64, 10, tokens=False) == _topk(short, 64, 10, tokens=False)


def test_a_lens_run_holds_every_layer_of_a_position_at_least(
    heads: dict[str, LoadedVersion],
) -> None:
    model = heads["short"]
    assert costs.lens_run_rows(model, model.rows_per_run * 3) == model.rows_per_run * 3
    assert costs.lens_run_rows(model, 2) == (model.rows_per_run // 2) * 2
    one = costs.lens(model, 2, 4, 5, False, False)
    assert costs.lens(model, 4, 4, 5, False, False).held > one.held
    assert costs.lens(model, 2, 4, 5, True, True).held > one.held
    assert one.run == costs.lens_run_rows(model, 2) * VOCAB * 4 * model.session.score_copies


def test_json_logits_are_declared_larger_than_binary(heads: dict[str, LoadedVersion]) -> None:
    model = heads["short"]
    text = costs.logits(model, 8, VOCAB, False, True)
    binary = costs.logits(model, 8, VOCAB, False, False)
    assert text.held >= 8 * VOCAB * (4 + costs.F32_TEXT) > binary.held >= 8 * VOCAB * 8
    assert text.run == binary.run == costs.run_bytes(model, 8)


BIG_VOCAB = 128256  # Llama 3's vocabulary; a narrow head (the costs follow the vocabulary)


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoadedVersion]:
    """A head of 128256 tokens served with the default settings."""
    root: Path = tmp_path_factory.mktemp("big")
    table = np.random.default_rng(0).standard_normal((BIG_VOCAB, 8), dtype=np.float32)
    save_head(HeadWeights.from_arrays(table), root / "big" / "1")
    loop = asyncio.new_event_loop()
    with ThreadPoolExecutor(1) as executor:
        registry = Registry(Settings(repository=root), executor, Metrics())
        loop.run_until_complete(registry.load_all())
        yield registry.get("big")
        loop.run_until_complete(registry.close())
    loop.close()


def _verify(
    model: LoadedVersion, parents: Ids | None, shape: Shape | None, probs: bool = True
) -> CheckedVerify:
    """64 sequences of 4 drafts, with draft_probs (a broadcast row: shapes alone matter)."""
    sequences, k = 64, 4
    draft = np.broadcast_to(np.float32(1 / model.vocab_size), (sequences, k, model.vocab_size))
    return CheckedVerify(
        np.zeros((sequences, k + 1, model.d_model), np.float32),
        np.zeros((sequences, k), np.int64),
        draft if probs else None,
        parents,
        shape,
        1.0,
        False,
        np.arange(sequences),
    )


def test_a_chain_with_draft_probs_declares_what_its_reads_hold(big: LoadedVersion) -> None:
    """64 x 4 with draft_probs on a 128256-token head, default settings: the chain reads its
    320 rows' logits, the stopping rows and the residual's (``verify_reads``), not every
    row's probabilities (``verify``, a tree with draft_probs): with its body as the front
    end charges it (3x), admitted under LMHEAD_MAX_INFLIGHT_BYTES, plain or shaped by
    top-p; the dense path's declaration would not be."""
    limits = Limits.from_settings(Settings())
    vocab, body = big.vocab_size, 64 * 4 * big.vocab_size * 4
    sampled = Shape(sample=SampleSpec(temperature=0.7, top_p=0.9, seed=1))
    for shape in (None, sampled):
        chain = costs.verify_call(big, [], _verify(big, None, shape), residual=False)
        assert chain.held + BODY_EXPANSION * body <= limits.max_inflight_bytes
        assert chain.held >= 320 * vocab * 4 + 5 * 64 * vocab * 4 + body  # logits, rule, probs
        tree = costs.verify_call(big, [], _verify(big, np.arange(-1, 3), shape), residual=False)
        assert tree.held + BODY_EXPANSION * body > limits.max_inflight_bytes
        assert chain.run == tree.run == costs.run_bytes(big, 320)
    budget = MemoryBudget(limits.max_inflight_bytes)
    with budget.request():
        budget_body = BODY_EXPANSION * body
        charge(budget_body)
        costs.admit(costs.verify_call(big, [], _verify(big, None, None), False), limits, "verify")


def test_drafts_taken_as_certain_declare_no_draft_rows(big: LoadedVersion) -> None:
    """Without a draft distribution a chain or a tree holds the logits and the stopping rows
    alone; greedily over the head's own distribution, no logits at all."""
    chain = costs.verify_call(big, [], _verify(big, None, None, probs=False), residual=False)
    tree = _verify(big, np.array([-1, -1, -1, 1]), None, probs=False)
    assert costs.verify_call(big, [], tree, residual=False).held == chain.held
    assert chain.held < 320 * big.vocab_size * 4 + 5 * 64 * big.vocab_size * 4
    greedy = replace(tree, greedy=True)
    assert costs.verify_call(big, [], greedy, residual=False).held < 2**20
