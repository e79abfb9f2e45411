"""Numbers that contrast two heads, or a head with the real next tokens (numpy, exact).

Used by ``/v1/models/{name}/score``, ``/v1/compare``, ``lmhead compare`` and shadow traffic.
Log-probabilities always use the full-vocabulary log-sum-exp; KL is taken over the full
softmax in float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from service.reference import log_softmax


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
        return float(np.exp(self.nll))


def score(
    logits: npt.NDArray[np.float32], lse: npt.NDArray[np.float32], targets: npt.NDArray[np.int64]
) -> Scores:
    """Target logit, log-prob and rank (0 = top; equal logits rank lower ids first) per row."""
    rows = np.arange(len(targets))
    target_logit = logits[rows, targets]
    above = (logits > target_logit[:, None]).sum(axis=1)
    ids = np.arange(logits.shape[1])
    tied_before = ((logits == target_logit[:, None]) & (ids[None, :] < targets[:, None])).sum(1)
    return Scores(target_logit, target_logit - lse, (above + tied_before).astype(np.int64))


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
    log_p, log_q = log_softmax(logits_p), log_softmax(logits_q)
    return np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)


def agreement(
    logits_a: npt.NDArray[np.floating], logits_b: npt.NDArray[np.floating], k: int
) -> dict[str, Any]:
    """Top-1 agreement, top-k overlap (Jaccard at k) and KL both ways, over rows."""
    k = min(k, logits_a.shape[1])
    top_a = np.argsort(-logits_a, axis=1, kind="stable")[:, :k]
    top_b = np.argsort(-logits_b, axis=1, kind="stable")[:, :k]
    jaccard = [
        len(set(a.tolist()) & set(b.tolist())) / len(set(a.tolist()) | set(b.tolist()))
        for a, b in zip(top_a, top_b, strict=True)
    ]
    return {
        "rows": int(len(logits_a)),
        "k": k,
        "top1_agreement": float(np.mean(top_a[:, 0] == top_b[:, 0])),
        "topk_overlap": float(np.mean(jaccard)),
        "kl_ab": summary(kl_rows(logits_a, logits_b)),
        "kl_ba": summary(kl_rows(logits_b, logits_a)),
    }
