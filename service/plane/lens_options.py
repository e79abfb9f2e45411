"""The options of residual states and of the logit lens, checked before any math (as
``service.plane.options`` checks the others; kept apart to keep each module one noun)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from service.errors import InvalidInput
from service.limits import Limits
from service.messages import LensRequest
from service.plane.options import token_ids
from service.repository.loaded_version import LoadedVersion
from service.runtime.vocabulary import Floats, Ids


@dataclass(frozen=True)
class CheckedLens:
    """Every layer's states, which layers the final norm reads first, k, and the targets'
    columns (one per token) or None."""

    states: Floats
    residual: npt.NDArray[np.bool_]
    k: int
    targets: Ids | None


STATES = ("final", "residual")


def residual(states: str, model: LoadedVersion, field: str = "states") -> bool:
    """Whether the rows are residual states the head's final norm reads first: ``final`` (the
    default) or ``residual``, which needs a head that kept its model's norm."""
    if states not in STATES:
        raise InvalidInput(f"{field} must be 'final' or 'residual', got {str(states)[:24]!r}")
    if states == "residual" and not model.session.has_norm:
        raise InvalidInput(
            f"{field}='residual' needs the model's final norm, and {model.name} version "
            f"{model.version} holds none: send final (post-norm) states, or import the head "
            "from a checkpoint with its norm (lmhead import keeps it)"
        )
    return states == "residual"


def lens(request: LensRequest, model: LoadedVersion, limits: Limits) -> CheckedLens:
    """``/lens``: (layers, tokens, d_model) states, which of them are residual, k, targets."""
    states = limits.lens_states(request.hidden_states, model.d_model)
    layers, tokens, _ = states.shape
    normed = residual(request.states, model)
    if request.last_layer not in STATES:
        raise InvalidInput(f"last_layer must be 'final' or 'residual', got {request.last_layer!r}")
    if request.last_layer == "residual" and not normed:
        raise InvalidInput(
            "last_layer='residual' needs states='residual' (with states='final' no layer is "
            "normalized, the last one included)"
        )
    flags = np.full(layers, normed)
    flags[-1] = normed and request.last_layer == "residual"
    k = limits.k(request.k, model.default_k)
    targets = None
    if request.target_ids is not None:
        targets = token_ids(request.target_ids, model.space, limits, "target_ids")
        if targets.shape != (tokens,):
            raise InvalidInput(
                f"target_ids must be one token id per position: shape ({tokens},), got "
                f"{list(targets.shape)[:4]}"
            )
    return CheckedLens(states, flags, min(k, model.vocab_size), targets)
