"""Statistics that compare two heads, or a head with the real next tokens (numpy, exact).

The data plane's score and compare, and shadow traffic, use them; the math itself (ranks,
KL) is ``service.runtime.logmath``'s. Log-probabilities always use the full-vocabulary
log-sum-exp; KL is taken over the full softmax in float64. Rows are processed in chunks of
``CHUNK_BYTES`` of logits (``service.limits``; ``service.budget`` counts what they hold in the
worst case): the float64 and index temporaries of a chunk are ~10x its bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from service.limits import CHUNK_BYTES
from service.runtime.logmath import kl_divergence, target_ranks

#: The largest x whose exp float64 holds.
MAX_EXP = math.log(np.finfo(np.float64).max)


def _chunks(rows: int, vocab_size: int) -> Iterator[slice]:
    step = max(1, CHUNK_BYTES // (4 * vocab_size))
    for start in range(0, rows, step):
        yield slice(start, start + step)


def _by_rows(
    function: Callable[..., tuple[npt.NDArray[Any], ...]], *arrays: npt.NDArray[Any]
) -> tuple[npt.NDArray[Any], ...]:
    """``function`` over row chunks of ``arrays`` (the first one is (rows, vocab)), joined."""
    parts = [function(*(array[part] for array in arrays)) for part in _chunks(*arrays[0].shape)]
    return tuple(np.concatenate(column) for column in zip(*parts, strict=True))


@dataclass(frozen=True)
class Scores:
    """Per-row scores of target tokens."""

    logit: npt.NDArray[np.float32]
    logprob: npt.NDArray[np.float32]
    rank: npt.NDArray[np.int64]

    @property
    def nll(self) -> float:
        return float(-np.mean(self.logprob.astype(np.float64)))

    @property
    def perplexity(self) -> float:
        return perplexity(self.nll)


def perplexity(nll: float) -> float:
    """exp(NLL); Inf past float64 (NLL over ~709), which JSON answers carry as null."""
    return math.exp(nll) if nll < MAX_EXP else math.inf


def score(
    logits: npt.NDArray[np.float32], lse: npt.NDArray[np.float32], targets: npt.NDArray[np.int64]
) -> Scores:
    """Target logit, log-prob and rank (0 = top; equal logits rank lower ids first) per row."""
    return Scores(*_by_rows(_score, logits, lse, targets))


def _score(
    logits: npt.NDArray[np.float32], lse: npt.NDArray[np.float32], targets: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[Any], ...]:
    target_logit, rank = target_ranks(logits, targets)
    return target_logit, target_logit - lse, rank


def summary(values: npt.NDArray[np.floating]) -> dict[str, float]:
    """mean, p50, p90 and max of a per-row statistic."""
    data = np.asarray(values, dtype=np.float64)
    return {
        "mean": float(data.mean()),
        "p50": float(np.quantile(data, 0.5)),
        "p90": float(np.quantile(data, 0.9)),
        "max": float(data.max()),
    }


def kl_rows(logits_p: npt.NDArray[np.floating], logits_q: npt.NDArray[np.floating]) -> Any:
    """KL(P || Q) per row over the full softmax, in float64."""
    return _by_rows(lambda p, q: (kl_divergence(p, q),), logits_p, logits_q)[0]


def row_agreement(
    logits_a: npt.NDArray[np.floating], logits_b: npt.NDArray[np.floating], k: int
) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Per row: top-1 agreement, top-k overlap (Jaccard at k) and KL(A || B).

    Top-1 is ``argmax`` and the top-k sets are ``top_k_sets``: equal logits go to the lower
    id, as in the top-k contract, so two heads that answer the same top-k overlap fully.
    """
    agree, overlap, kl = _by_rows(lambda a, b: _row_agreement(a, b, k), logits_a, logits_b)
    return agree, overlap, kl


def _row_agreement(
    logits_a: npt.NDArray[np.floating], logits_b: npt.NDArray[np.floating], k: int
) -> tuple[npt.NDArray[Any], ...]:
    k = min(k, logits_a.shape[1])
    in_a, in_b = top_k_sets(logits_a, k), top_k_sets(logits_b, k)
    overlap = (in_a & in_b).sum(axis=1) / (in_a | in_b).sum(axis=1)
    agree = logits_a.argmax(axis=1) == logits_b.argmax(axis=1)
    return agree, overlap, kl_divergence(logits_a, logits_b)


def top_k_sets(logits: npt.NDArray[np.floating], k: int) -> npt.NDArray[np.bool_]:
    """(rows, vocab) masks of each row's k largest logits, equal ones taken in id order
    (``argpartition`` alone picks any of them: linear in the vocabulary, no full sort)."""
    kth = -np.partition(-logits, k - 1, axis=1)[:, k - 1 : k]
    above = logits > kth
    level = logits == kth
    wanted = k - above.sum(axis=1, keepdims=True)  # of the tied: the lowest ids
    chosen: npt.NDArray[np.bool_] = above | (level & (np.cumsum(level, axis=1) <= wanted))
    return chosen


def agreement(
    logits_a: npt.NDArray[np.floating], logits_b: npt.NDArray[np.floating], k: int
) -> dict[str, Any]:
    """Top-1 agreement, top-k overlap (Jaccard at k) and KL both ways, over rows."""
    agree, overlap, kl_ab = row_agreement(logits_a, logits_b, k)
    return {
        "rows": int(len(logits_a)),
        "k": min(k, logits_a.shape[1]),
        "top1_agreement": float(np.mean(agree)),
        "topk_overlap": float(np.mean(overlap)),
        "kl_ab": summary(kl_ab),
        "kl_ba": summary(kl_rows(logits_b, logits_a)),
    }


def wins(a: Scores, b: Scores) -> tuple[float, float, float]:
    """Shares of rows where A, where B gives the target the higher log-prob, and of ties.

    Equal within float32 rounding is a tie: two kernels on one matrix differ in the last bits.
    """
    tie = np.isclose(a.logprob, b.logprob, rtol=1e-5, atol=1e-5)
    return (
        float(np.mean((a.logprob > b.logprob) & ~tie)),
        float(np.mean((b.logprob > a.logprob) & ~tie)),
        float(np.mean(tie)),
    )
