"""Wire models of ``/v1/models/{name}/verify`` (speculative verification): its options, its
body and its answer, as the OpenAPI document shows them.

Kept beside ``schemas.py`` rather than in it: one verb's models, with the examples the
document's walk sends (one sequence of one draft: K + 1 = 2 positions).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from service.api.decoding_fields import ArrayFields, PenaltyFields, StepFields
from service.api.schemas import Identity, States, _Document, _example, _Options

_EXAMPLE_ROW = [0.5, -1.25, 0.75, 2.0]


class VerifySample(_Options):
    """The filters shaping the target before the acceptance test (Hugging Face's order:
    top_k, top_p, min_p): the distribution a plain step would sample from."""

    temperature: float | None = Field(default=None, examples=[0.8])
    """The target's temperature; 0 is greedy; the request's ``temperature`` when absent."""
    top_k: int | None = Field(default=None, examples=[50])
    top_p: float | None = Field(default=None, examples=[0.9])
    min_p: float | None = Field(default=None, examples=[0.01])
    seed: int | None = Field(default=None, examples=[1])
    """Sequence i's seed is seed + i, when ``seeds`` is absent."""


class VerifyOptions(PenaltyFields, StepFields, _Options):
    """Options of ``/verify``: in the JSON body beside the arrays, or as query parameters
    with an ``.npz`` body (``sample`` and ``logit_bias`` as JSON text there). The decoding
    step's options apply to the target (and a draft_model) as on ``/topk``; its histories
    are one list per sequence: each drafted position's counts the drafts before it."""

    temperature: float = 1.0
    """The target's temperature; 0 verifies greedily (accept while the draft is the top)."""
    states: States = "final"
    """``final``: post-norm hidden states; ``residual``: the head's final norm first."""
    logit_bias: dict[str, float] | None = Field(default=None, examples=[{"3": 2.5}])
    """Token id -> added to the target's logit before everything else (in [-100, 100])."""
    sample: VerifySample | None = None
    draft_model: str | None = Field(default=None, examples=[None])
    """A head of the repository naming the same tokens that gives the draft's distribution
    from ``draft_hidden_states``, shaped by the same options (instead of ``draft_probs``)."""
    """top_k, top_p, min_p (and a temperature, 0 greedy) shaping the target's distribution
    before the acceptance test; ``seed`` seeds sequence i with seed + i."""


class VerifyBody(ArrayFields, VerifyOptions):
    model_config = _example(
        hidden_states=[[_EXAMPLE_ROW, _EXAMPLE_ROW]],
        draft_token_ids=[[7]],
        seeds=[1],
        sample={"seed": 1},
    )

    hidden_states: list[Any]
    """(sequences, K + 1, d_model) floats: the target's states at the K drafted positions
    (the state before each draft) and one more (after the last draft)."""
    draft_token_ids: list[list[int]]
    """(sequences, K) drafted token ids."""
    draft_probs: list[Any] | None = Field(default=None, examples=[None])
    """(sequences, K, vocab): the draft's distribution each draft was sampled from (better as
    an ``.npz`` entry); absent: drafts taken as certain (n-gram, prompt lookup)."""
    draft_hidden_states: list[Any] | None = Field(default=None, examples=[None])
    """(sequences, K, the draft head's d_model): the drafter's states, with ``draft_model``."""
    draft_parents: list[int] | None = Field(default=None, examples=[[-1]])
    """(K,): each draft's parent, -1 for the root's children, else an earlier draft: a tree
    whose siblings are tried in order (taken as certain, or independent draws from their
    draft_probs row, the same for siblings)."""
    allowed_token_ids: list[Any] | None = Field(default=None, examples=[None])
    """The only tokens the target (and a draft_model) may give mass: one list for every
    position, one per sequence, or one per position (sequences x (K + 1)); each distribution
    is renormalized over them, and a draft outside them is rejected."""
    banned_token_ids: list[int] | None = Field(default=None, examples=[[3]])
    """Tokens the target never emits (their probability 0)."""
    seeds: list[int] | None = Field(default=None, examples=[[1]])
    """One seed per sequence: the same seed and rows give the same answer."""


class VerifiedSequence(_Document):
    accepted: int
    """How many drafts were accepted (the first ``accepted`` of ``token_ids``)."""
    token_ids: list[int]
    """The accepted drafts, then the one token emitted after them (accepted + 1 ids)."""
    logprobs: list[float]
    """Each token's log-prob under the target (``logprobs_mode``)."""
    nodes: list[int]
    """The accepted drafts' indices (a tree's path; 0..accepted-1 for a chain)."""
    seed: int


class VerifyAnswer(Identity):
    logprobs_mode: Literal["raw", "processed"]
    """``raw``: every processor and the temperature; ``processed``: the filters too."""
    results: list[VerifiedSequence]
