"""One run of the logit lens: a few positions' states of every layer through the head.

A run takes the rows of ``tokens`` positions at every layer (layer-major), so the last layer's
distribution of each position is in the same run as the other layers': KL(last || layer) is
read from the run's logits and no (layers x tokens x vocab) tensor ever exists. The logits
are the session's scoring buffer (``HeadSession.logits_run``); the reductions over the
vocabulary (entropy, KL) go a row at a time, so their temporary is one row, not the run's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from service.runtime.session import HeadSession, target_ranks


@dataclass(frozen=True)
class LensPart:
    """(layers, tokens, ...) arrays of one run's positions."""

    token_ids: npt.NDArray[np.int64]
    logprobs: npt.NDArray[np.float32]
    entropy: npt.NDArray[np.float32]
    kl_to_last: npt.NDArray[np.float32]
    target_logprobs: npt.NDArray[np.float32] | None
    target_ranks: npt.NDArray[np.int64] | None


def lens_run(
    session: HeadSession,
    states: npt.NDArray[np.float32],
    residual: npt.NDArray[np.bool_],
    k: int,
    targets: npt.NDArray[np.int64] | None,
) -> LensPart:
    """``states`` (layers, tokens, d_model); ``residual`` (layers,) says which layers the
    head's final norm reads first; ``targets`` (tokens,) or None."""
    layers, tokens, d_model = states.shape
    rows = np.ascontiguousarray(states.reshape(-1, d_model), dtype=np.float32)
    normed = np.repeat(residual, tokens)
    if normed.any():  # a copy: the request's own array may be a read-only view of its body
        rows = rows.copy()
        rows[normed] = session.normalize(rows[normed])
    values, ids, lse, logits = session.logits_run(rows, k)
    target_logprobs = target_ranks_out = None
    if targets is not None:
        target_logits, ranks = target_ranks(logits, np.tile(targets, layers))
        target_logprobs = (target_logits - lse).reshape(layers, tokens)
        target_ranks_out = ranks.reshape(layers, tokens)
    shaped = logits.reshape(layers, tokens, -1)
    entropy, kl = _entropy_and_kl(shaped, lse.reshape(layers, tokens))
    return LensPart(
        ids.reshape(layers, tokens, -1),
        (values - lse[:, None]).reshape(layers, tokens, -1),
        entropy,
        kl,
        target_logprobs,
        target_ranks_out,
    )


def _entropy_and_kl(
    logits: npt.NDArray[np.float32], lse: npt.NDArray[np.float32]
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """Entropy of every (layer, token) distribution and KL(last layer's || it), in nats, from
    the logits and their log-sum-exp, one row at a time (a row of a 128k vocabulary stays in
    the core's cache for the passes over it; the run's logits are read from memory once).
    One thread reads them: with two (numpy gives the GIL up), a served lens of 2,048 rows on a
    128256 x 2048 head took 1.4x a /topk of the same rows, its onnxruntime runs slowed in
    the serving process; with one, 1.10-1.19x.

    H = -sum(p * logp) (``lse - sum(p * logits)`` lost ~2e-4 nats to cancellation where the
    entropy is near 0); KL = sum(p_last * (logits_last - logits)) + lse - lse_last, the
    difference of the logits taken first, so a layer close to the last loses little to
    cancellation (its KL is a sum of small terms)."""
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
