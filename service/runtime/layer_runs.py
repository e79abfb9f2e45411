"""One run of the logit lens: a few positions' states of every layer through the head.

A run takes the rows of ``tokens`` positions at every layer (layer-major), so the last layer's
distribution of each position is in the same run as the other layers': KL(last || layer) is
read from the run's logits and no (layers x tokens x vocab) tensor ever exists. The logits
are the session's scoring buffer (``HeadSession.logits_run``); the reductions over the
vocabulary (entropy, KL: ``logmath.entropy_and_kl_to_last``) go a row at a time, so their
temporary is one row, not the run's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from service.runtime.logmath import entropy_and_kl_to_last, target_ranks
from service.runtime.session import HeadSession


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
    entropy, kl = entropy_and_kl_to_last(shaped, lse.reshape(layers, tokens))
    return LensPart(
        ids.reshape(layers, tokens, -1),
        (values - lse[:, None]).reshape(layers, tokens, -1),
        entropy,
        kl,
        target_logprobs,
        target_ranks_out,
    )
