"""The math of a head's distribution, written once: log-sum-exp, log-softmax, ranks, entropy
and KL.

Every number the service derives from logits goes through here: the session's ranks, prompt
scoring, the comparison of two heads, the logit lens and the shaped vocabularies. A second
copy of one formula is a place for the two to drift apart, so callers import these and write
none of their own. ``service.heads.reference`` is kept apart on purpose: it is the tests'
oracle, written independently in plain float64, and serving code never imports it (an oracle
the code under test shares checks nothing; ``tests/unit/test_architecture.py`` holds that).

The contract:

* log-sum-exp over the last axis with the row's maximum taken out first, so no finite logit
  overflows ``exp``; in the terms' own precision: float32 where answers carry float32 (a
  float64 copy of a (rows, vocab) run would double what it holds), float64 where a caller
  wants a float64 statistic and passes float64 terms. A row of -inf alone is -inf.
* log-softmax: ``logits - logsumexp(logits)``.
* ranks: the tokens scoring strictly higher than the target, plus equal ones with lower ids,
  so 0 is the top and a rank is the target's place in the top-k list (values descending,
  ties broken toward the lower token id: the top-k contract).
* entropy ``H = -sum(p * log p)`` and ``KL(P || Q) = sum(p * (log p - log q))``, in nats.
"""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

F = TypeVar("F", bound=np.floating[Any])
#: Rows whose ranks are counted at once (a rows x vocab boolean temporary).
RANK_ROWS = 8


def logsumexp(terms: npt.NDArray[F]) -> npt.NDArray[F]:
    """log(sum(exp(terms))) over the last axis, in the terms' own precision, stably (the
    row's maximum out first); -inf for a row that is all -inf (nothing in it to draw)."""
    top = terms.max(axis=-1, keepdims=True)
    safe = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):  # log(0) of an all -inf row: -inf, as it should be
        total: npt.NDArray[F] = np.log(np.exp(terms - safe).sum(axis=-1)) + safe[..., 0]
    return total


def log_softmax(logits: npt.NDArray[F]) -> npt.NDArray[F]:
    """Log-probabilities over the last axis, in the logits' own precision."""
    normalized: npt.NDArray[F] = logits - logsumexp(logits)[..., None]
    return normalized


def kl_divergence(
    logits_p: npt.NDArray[np.floating[Any]], logits_q: npt.NDArray[np.floating[Any]]
) -> npt.NDArray[np.float64]:
    """KL(P || Q) per row over the full softmax, in float64 (the comparison of two heads:
    its logits differ in their last float32 bits, and float64 keeps that from the sum).
    Its callers pass a few rows at a time: the temporaries are ~4 float64 copies of them."""
    log_p = log_softmax(logits_p.astype(np.float64))
    log_q = log_softmax(logits_q.astype(np.float64))
    kl: npt.NDArray[np.float64] = np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)
    return kl


def target_ranks(
    logits: npt.NDArray[np.floating[Any]],
    columns: npt.NDArray[np.int64],
    ids: npt.NDArray[np.int64] | None = None,
) -> tuple[npt.NDArray[Any], npt.NDArray[np.int64]]:
    """Each row's target logit (the one in column ``columns[row]``) and its rank: the tokens
    scoring strictly higher, plus equal ones with lower ids. ``ids``: the columns' token ids,
    (n,) for every row or (rows, n) per row (a candidate list); None when the columns are the
    ids (the whole vocabulary). Counted ``RANK_ROWS`` rows at a time (a small boolean
    temporary, never one of the run's size)."""
    target = logits[np.arange(len(logits)), columns]
    rank = np.empty(len(logits), np.int64)
    for start in range(0, len(logits), RANK_ROWS):
        part = slice(start, start + RANK_ROWS)
        row_ids = ids[part] if ids is not None and ids.ndim == 2 else ids
        rank[part] = _ranks(logits[part], target[part], columns[part], row_ids)
    return target, rank


def _ranks(
    logits: npt.NDArray[np.floating[Any]],
    target: npt.NDArray[np.floating[Any]],
    columns: npt.NDArray[np.int64],
    ids: npt.NDArray[np.int64] | None,
) -> npt.NDArray[np.int64]:
    """Tokens scoring strictly higher than each row's target, plus equal ones with lower ids
    (two passes over the rows; the second only in rows where another token ties the target)."""
    mark = target[:, None]
    rank: npt.NDArray[np.int64] = np.count_nonzero(logits > mark, axis=1).astype(np.int64)
    for row in np.flatnonzero(np.count_nonzero(logits == mark, axis=1) > 1).tolist():
        if ids is None:  # the columns are the ids: the lower ids are the columns before
            rank[row] += np.count_nonzero(logits[row, : columns[row]] == target[row])
        else:
            row_ids = ids if ids.ndim == 1 else ids[row]
            lower = row_ids < row_ids[columns[row]]
            rank[row] += np.count_nonzero((logits[row] == target[row]) & lower)
    return rank


def entropy_and_kl_to_last(
    logits: npt.NDArray[np.float32], lse: npt.NDArray[np.float32]
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """The logit lens's statistics of (layers, tokens, vocab) logits and their log-sum-exp
    (layers, tokens): the entropy of every (layer, token) distribution and KL(last layer's
    || it), in nats, one row at a time (a row of a 128k vocabulary stays in the core's cache
    for the passes over it; the run's logits are read from memory once, and no float64 or
    (rows, vocab) temporary is made). One thread reads them: with two (numpy gives the GIL
    up), a served lens of 2,048 rows on a 128256 x 2048 head took 1.4x a /topk of the same
    rows, its onnxruntime runs slowed in the serving process; with one, 1.10-1.19x.

    H = -sum(p * logp) (``lse - sum(p * logits)`` lost ~2e-4 nats to cancellation where the
    entropy is near 0); KL = sum(p_last * (logits_last - logits)) + lse - lse_last, the
    difference of the logits taken first, so a layer close to the last loses little to
    cancellation (its KL is a sum of small terms). KL is never below 0 (rounding is cut),
    and the last layer's against itself is exactly 0."""
    layers, tokens, vocab = logits.shape
    entropy = np.empty((layers, tokens), np.float32)
    kl = np.empty((layers, tokens), np.float32)

    def position(token: int) -> None:
        logprobs, probs = np.empty(vocab, np.float32), np.empty(vocab, np.float32)
        last, last_level = logits[-1, token], lse[-1, token]
        weights = np.exp(last - last_level)
        for layer in range(layers):
            row, level = logits[layer, token], lse[layer, token]
            np.subtract(row, level, out=logprobs)
            np.exp(logprobs, out=probs)
            entropy[layer, token] = -np.dot(probs, logprobs)
            np.subtract(last, row, out=logprobs)
            kl[layer, token] = np.dot(weights, logprobs) + (level - last_level)
        kl[-1, token] = 0.0  # the last layer against itself, exactly

    for token in range(tokens):
        position(token)
    return entropy, np.maximum(kl, 0.0)
