"""What the speculative verification verb takes and returns (``service.plane.verify``), beside
``service.messages``' other verbs: typed requests and results, numpy arrays and small frozen
dataclasses, no HTTP types."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from service.messages import HeadInfo, Target, VocabularyOptions


@dataclass(frozen=True)
class VerifyRequest:
    """Speculative verification (``service.plane.verify``): the target's states at K drafted
    positions and one more, the drafts, and the draft's distribution or none (drafts taken
    as certain); ``draft_parents`` makes the drafts a tree's nodes. ``seeds``: one per
    sequence (None: random ones, given back)."""

    target: Target
    hidden_states: npt.NDArray[Any]
    draft_token_ids: npt.NDArray[Any]
    draft_probs: npt.NDArray[Any] | None = None
    draft_parents: npt.NDArray[Any] | None = None
    temperature: float = 1.0
    vocabulary: VocabularyOptions | None = None
    seeds: npt.NDArray[Any] | None = None
    states: str = "final"
    draft_model: str | None = None
    """A head of the repository (same tokens) that gives the draft's distribution from
    ``draft_hidden_states`` (sequences, K, its d_model), with the same options."""
    draft_hidden_states: npt.NDArray[Any] | None = None


@dataclass(frozen=True)
class VerifyResult:
    """Per sequence: ``accepted`` drafts; ``token_ids`` the accepted drafts then the emitted
    token (-1 after it) and their ``logprobs`` (``logprobs_mode``: raw, every processor and
    the temperature; processed, the filters too); ``nodes`` the accepted drafts' indices
    (a tree's path), -1 after; the ``seeds`` that reproduce the answer."""

    head: HeadInfo
    accepted: npt.NDArray[np.int64]
    token_ids: npt.NDArray[np.int64]
    logprobs: npt.NDArray[np.float32]
    nodes: npt.NDArray[np.int64]
    seeds: npt.NDArray[np.int64]
    logprobs_mode: str = "processed"
