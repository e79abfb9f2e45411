"""Speculative verification is exact: over 200,000 fixed-seed verifications on a vocabulary
of 32, the first emitted token's frequencies match the target distribution (a chi-square
test, p >= 0.001) and the first draft's acceptance rate matches its exact value (the sum over
tokens of min(p, q), or for drafts taken as certain the mass of the drafted tokens) within 4
standard errors; for chains with and without a draft distribution and for a tree with three
children at the root. Greedy verification is greedy decoding, and a seed always gives the
same answer. The draft tokens are sampled from the draft's own distribution, as a drafter
would: exactness holds only for drafts that follow ``q``."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import pytest

from service.runtime.verification import (
    Verdict,
    chain_accepted,
    chain_assembled,
    chain_emitted,
    chain_parents,
    chain_verdict,
    tree_verdict,
    tree_walk,
    uniforms,
    verify_chain,
    verify_greedy,
    verify_tree,
)

VOCAB = 32
RUNS = 200_000
Doubles = npt.NDArray[np.float64]
Ids = npt.NDArray[np.int64]


def chi_square_p(observed: Ids, expected: Doubles) -> float:
    """The chi-square test's p-value (bins expected below 5 pooled), by the regularized upper
    incomplete gamma Q(df / 2, x / 2) from its power series (scipy is not installed)."""
    small = expected < 5
    counts = np.append(observed[~small], observed[small].sum())
    means = np.append(expected[~small], expected[small].sum())
    if means[-1] == 0:
        counts, means = counts[:-1], means[:-1]
    statistic = float(((counts - means) ** 2 / means).sum())
    a, x = (len(means) - 1) / 2, statistic / 2
    term = total = 1.0 / a
    for n in range(1, 10_000):
        term *= x / (a + n)
        total += term
        if term < 1e-17 * total:
            break
    lower = math.exp(a * math.log(x) - x - math.lgamma(a)) * total if x > 0 else 0.0
    return max(0.0, 1.0 - lower)


def within_4_se(hits: int, runs: int, exact: float) -> bool:
    """Whether ``hits`` of ``runs`` Bernoulli trials agree with probability ``exact``."""
    se = math.sqrt(exact * (1 - exact) / runs)
    return abs(hits / runs - exact) <= 4 * se


def test_the_chi_square_helper_agrees_with_known_values() -> None:
    """df 2: the survival function is exp(-x / 2); df 10 at 23.209: 0.01 (the table)."""
    p = chi_square_p(np.array([60, 20, 20]), np.array([40.0, 30.0, 30.0]))
    assert p == pytest.approx(math.exp(-(400 / 40 + 100 / 30 + 100 / 30) / 2), rel=1e-9)
    statistic = 23.209
    expected = np.full(11, 1000.0)
    observed = expected.copy()
    observed[0] += math.sqrt(statistic * 1000 / 2)
    observed[1] -= math.sqrt(statistic * 1000 / 2)
    assert chi_square_p(observed, expected) == pytest.approx(0.01, abs=2e-5)


def _sampled(probs: Doubles, rng: np.random.Generator) -> Ids:
    """One token per row of ``probs`` (rows, V), or RUNS rows of one (V,) distribution."""
    rows = probs if probs.ndim == 2 else np.broadcast_to(probs, (RUNS, len(probs)))
    cumulative = np.cumsum(rows, axis=1)
    u = rng.random(len(rows)) * cumulative[:, -1]
    index: Ids = np.minimum((cumulative <= u[:, None]).sum(axis=1), rows.shape[1] - 1)
    return index.astype(np.int64)


def _distributions(rng: np.random.Generator, rows: int, sharp: float = 1.0) -> Doubles:
    """Random distributions over the vocabulary, a few tokens near zero (filtered ones
    exactly zero: the target's top-k keeps 24 of them)."""
    probs = rng.dirichlet(np.full(VOCAB, sharp), size=rows)
    probs[:, rng.permutation(VOCAB)[:8]] = 0.0
    normalized: Doubles = probs / probs.sum(axis=1, keepdims=True)
    return normalized


@pytest.mark.parametrize("with_draft", [True, False])
def test_a_chain_emits_exactly_the_target_distribution(with_draft: bool) -> None:
    """K = 3; one target and draft distribution for all runs, drafts sampled from it (from
    a uniform draft for the one-hot case, which any draft satisfies)."""
    rng = np.random.default_rng(46)
    k = 3
    target = _distributions(rng, k + 1)
    draft = rng.dirichlet(np.full(VOCAB, 0.7), size=k)  # gives tokens the target filtered
    draft_ids = np.stack([_sampled(draft[i], rng) for i in range(k)], axis=1)
    verdict = verify_chain(
        np.broadcast_to(target, (RUNS, k + 1, VOCAB)),
        draft_ids,
        rng.random((RUNS, k + 1)),
        np.broadcast_to(draft, (RUNS, k, VOCAB)) if with_draft else None,
    )
    first = verdict.token_ids[:, 0]
    assert chi_square_p(np.bincount(first, minlength=VOCAB), RUNS * target[0]) >= 0.001
    hits = int((verdict.accepted >= 1).sum())
    exact = np.minimum(target[0], draft[0]).sum() if with_draft else target[0] @ draft[0]
    assert within_4_se(hits, RUNS, float(exact))
    after = verdict.accepted >= 1  # the second token follows the target's second position
    second = np.bincount(verdict.token_ids[after, 1], minlength=VOCAB)
    assert chi_square_p(second, after.sum() * target[1]) >= 0.001
    assert (first[verdict.accepted >= 1] == draft_ids[verdict.accepted >= 1, 0]).all()
    assert target[0][first].min() > 0  # nothing the target filtered is ever emitted


def _tree_by_reads(target: Doubles, draft_ids: Ids, parents: Ids, u: Doubles) -> Verdict:
    """Drafts taken as certain, read as ``plane.verify_plain`` reads them: p at each draft
    in its parent's row, then the one row where the walk ended."""
    every = np.arange(len(draft_ids))
    p_x = target[every[:, None], parents[None, :] + 1, draft_ids]
    walk = tree_walk(p_x, draft_ids, parents, u)
    return tree_verdict(target[every, walk.current + 1], draft_ids, parents, walk, u)


@pytest.mark.parametrize("rule", [verify_tree, _tree_by_reads], ids=["dense", "reads"])
def test_a_tree_with_three_children_at_the_root_emits_exactly_the_target(
    rule: Callable[..., Verdict],
) -> None:
    """Nodes 0, 1, 2 are the root's children (tokens 3, 7, 11), node 3 is node 1's child:
    the first token follows p at the root, its acceptance is the three tokens' mass, and
    after node 1 the next token follows node 1's distribution; whole rows at every position
    (``verify_tree``) or p at the drafts and the row where the walk ended."""
    rng = np.random.default_rng(4646)
    parents = np.array([-1, -1, -1, 1])
    target = _distributions(rng, 5, sharp=0.5)
    target[0] = rng.dirichlet(np.full(VOCAB, 0.5))
    tokens = np.array([3, 7, 11, int(np.argmax(target[2]))])
    verdict = rule(
        np.broadcast_to(target, (RUNS, 5, VOCAB)),
        np.broadcast_to(tokens, (RUNS, 4)),
        parents,
        rng.random((RUNS, 5)),
    )
    first = verdict.token_ids[:, 0]
    assert chi_square_p(np.bincount(first, minlength=VOCAB), RUNS * target[0]) >= 0.001
    hits = int((verdict.accepted >= 1).sum())
    assert within_4_se(hits, RUNS, float(target[0][tokens[:3]].sum()))
    via_one = verdict.nodes[:, 0] == 1
    second = np.bincount(verdict.token_ids[via_one, 1], minlength=VOCAB)
    assert chi_square_p(second, via_one.sum() * target[2]) >= 0.001
    assert (verdict.nodes[verdict.accepted == 2] == [1, 3]).all()
    assert (verdict.positions[via_one, 1] == 2).all()


def test_a_chain_as_a_tree_is_the_chain_without_a_draft() -> None:
    """Drafts taken as certain: the tree walk over a chain's parents makes the same choices,
    uniform for uniform, as the one-hot chain rule."""
    rng = np.random.default_rng(7)
    rows, k = 5_000, 4
    target = _distributions(rng, rows * (k + 1)).reshape(rows, k + 1, VOCAB)
    draft_ids = rng.integers(0, VOCAB, (rows, k))
    u = rng.random((rows, k + 1))
    chain = verify_chain(target, draft_ids, u)
    tree = verify_tree(target, draft_ids, chain_parents(k), u)
    for name in ("accepted", "token_ids", "positions", "nodes"):
        assert (getattr(chain, name) == getattr(tree, name)).all(), name


def test_a_tree_read_at_its_drafts_walks_as_the_dense_tree() -> None:
    """Drafts taken as certain on a tree of two levels with siblings that repeat a token
    (a repeat has no mass left once its twin is rejected): p at the drafts and the row where
    the walk ended make the choices ``verify_tree`` makes from every whole row, uniform for
    uniform."""
    rng = np.random.default_rng(8)
    rows, parents = 5_000, np.array([-1, -1, -1, 0, 1, 1, 1, 5])
    nodes = len(parents)
    target = _distributions(rng, rows * (nodes + 1), sharp=0.3).reshape(rows, nodes + 1, VOCAB)
    draft_ids = rng.integers(0, 4, (rows, nodes))  # few tokens: siblings repeat
    u = rng.random((rows, nodes + 1))
    dense = verify_tree(target, draft_ids, parents, u)
    reads = _tree_by_reads(target, draft_ids, parents, u)
    for name in ("accepted", "token_ids", "positions", "nodes"):
        assert (getattr(dense, name) == getattr(reads, name)).all(), name
    assert {0, 1, 2} <= set(dense.accepted.tolist())
    assert (draft_ids[:, 1] == draft_ids[:, 0]).any()


@pytest.mark.parametrize("with_draft", [False, True])
def test_a_chain_drawn_a_few_sequences_at_a_time_is_the_whole_chains_verdict(
    with_draft: bool,
) -> None:
    """``chain_emitted`` over chunks of 1, 3 and 7 sequences (the residuals made in place,
    the draft's rows of the rejecting sequences alone) emits what ``chain_verdict`` emits
    from every sequence's rows at once, token for token: float32 rows of 1,000 tokens (the
    draw's blocks and a partial last one), every count of accepted drafts."""
    rng = np.random.default_rng(12)
    rows, k, vocab = 300, 4, 1_000
    p_rows = (rng.dirichlet(np.full(vocab, 0.1), rows)).astype(np.float32)
    q_rows = (rng.dirichlet(np.full(vocab, 0.1), rows)).astype(np.float32)
    draft_ids = rng.integers(0, vocab, (rows, k))
    p_x, q_x = rng.random((rows, k)), rng.random((rows, k)) if with_draft else None
    u = rng.random((rows, k + 1))
    accepted = chain_accepted(p_x, q_x, u)
    whole = chain_verdict(p_rows, q_rows if with_draft else None, draft_ids, accepted, u)
    assert set(accepted.tolist()) == set(range(k + 1))
    for step in (1, 3, 7):
        emitted = np.zeros(rows, np.int64)
        for start in range(0, rows, step):
            part = slice(start, start + step)
            rejected = np.flatnonzero(accepted[part] < k) + start
            q_part = q_rows[rejected] if with_draft else None
            ids, got = draft_ids[part], accepted[part]
            emitted[part] = chain_emitted(p_rows[part].copy(), q_part, ids, got, u[part])
        chunked = chain_assembled(draft_ids, accepted, emitted)
        for name in ("accepted", "token_ids", "positions", "nodes"):
            assert (getattr(whole, name) == getattr(chunked, name)).all(), (step, name)


def _greedy_decoding(target: Doubles, draft_ids: Ids) -> list[list[int]]:
    """Greedy decoding one position at a time: take the top token; stop after a mismatch."""
    out = []
    for row, drafts in zip(target, draft_ids, strict=True):
        tokens = []
        for position in range(len(drafts) + 1):
            tokens.append(int(np.argmax(row[position])))
            if position == len(drafts) or tokens[-1] != drafts[position]:
                break
        out.append(tokens)
    return out


def test_greedy_verification_is_greedy_decoding() -> None:
    rng = np.random.default_rng(11)
    rows, k = 400, 4
    target = _distributions(rng, rows * (k + 1)).reshape(rows, k + 1, VOCAB)
    target[:5, 0, :2] = 1.0  # a tie: the lower id is the top
    draft_ids = np.argmax(target[:, :k], axis=2).astype(np.int64)
    wrong = rng.random((rows, k)) < 0.25
    draft_ids[wrong] = (draft_ids[wrong] + 1) % VOCAB
    verdict = verify_greedy(target, draft_ids)
    for row, tokens in enumerate(_greedy_decoding(target, draft_ids)):
        assert verdict.accepted[row] == len(tokens) - 1
        assert verdict.token_ids[row].tolist() == tokens + [-1] * (k + 1 - len(tokens))
    assert (verdict.token_ids[:5, 0] == 0).all()
    assert set(verdict.accepted.tolist()) == set(range(k + 1))


def test_greedy_on_a_tree_follows_the_first_matching_child() -> None:
    """Root children 0 (a miss), 1 and 2 (both the top token): node 1 is followed, then
    node 3 (its child) if it matches node 1's top."""
    target = np.full((1, 5, VOCAB), 0.01)
    target[0, 0, 9] = target[0, 2, 4] = target[0, 4, 6] = 1.0
    verdict = verify_greedy(target, np.array([[8, 9, 9, 4]]), np.array([-1, -1, -1, 1]))
    assert verdict.nodes.tolist() == [[1, 3]]
    assert verdict.token_ids.tolist() == [[9, 4, 6]]
    assert verdict.positions.tolist() == [[0, 2, 4]]


def test_a_seed_gives_the_same_answer_whatever_else_is_sent() -> None:
    """Sequence s's uniforms come from its own seed: alone or beside others, the same."""
    rng = np.random.default_rng(3)
    target = _distributions(rng, 3 * 4).reshape(3, 4, VOCAB)
    draft = _distributions(rng, 3 * 3).reshape(3, 3, VOCAB) * 0.5 + 0.5 / VOCAB
    draft_ids = rng.integers(0, VOCAB, (3, 3))
    together = verify_chain(target, draft_ids, uniforms([5, 6, 7], 4), draft)
    alone = verify_chain(target[1:2], draft_ids[1:2], uniforms([6], 4), draft[1:2])
    again = verify_chain(target, draft_ids, uniforms([5, 6, 7], 4), draft)
    assert together.token_ids[1].tolist() == alone.token_ids[0].tolist()
    assert together.token_ids.tolist() == again.token_ids.tolist()
    assert uniforms([6], 4)[0].tolist() == uniforms([1, 6], 4)[1].tolist()
    assert uniforms([6], 4).dtype == np.float64


def test_a_tree_of_independent_draws_from_the_draft_emits_exactly_the_target() -> None:
    """Three children at the root, each an independent draw from q (siblings may repeat):
    the multi-draft rule keeps the first token's distribution p; the acceptance rate is
    1 - the mass the three rejections leave, computed here in float64 by the same recursion
    over q's expectation (exact: each rejection's residual depends on q alone)."""
    rng = np.random.default_rng(464)
    target = _distributions(rng, 4, sharp=0.5)
    q = rng.dirichlet(np.full(VOCAB, 0.8))
    children = np.stack([_sampled(q, rng) for _ in range(3)], axis=1)
    draft = np.broadcast_to(np.stack([q, q, q]), (RUNS, 3, VOCAB))
    verdict = verify_tree(
        np.broadcast_to(target, (RUNS, 4, VOCAB)),
        children,
        np.array([-1, -1, -1]),
        rng.random((RUNS, 4)),
        draft,
    )
    first = verdict.token_ids[:, 0]
    assert chi_square_p(np.bincount(first, minlength=VOCAB), RUNS * target[0]) >= 0.001
    residual, rejected = target[0].copy(), 1.0
    for _ in range(3):  # P(reject | residual r) = 1 - sum(min(r, q)); then r <- norm(max(0, r - q))
        rejected *= 1.0 - np.minimum(residual, q).sum()
        residual = np.maximum(residual - q, 0.0)
        residual /= residual.sum()
    hits = int((verdict.accepted >= 1).sum())
    assert within_4_se(hits, RUNS, 1.0 - rejected)
