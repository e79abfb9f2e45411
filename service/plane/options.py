"""A request's options, checked once, in one place, before any math.

Front ends decode the wire without judging it; the data plane hands each decoded request and
the version it leased to one function here (``topk``, ``logits``, ``embed``, ``infer``,
``score``, ``compare``), which checks everything the request asks (shapes, ids, k, temperature,
allowed tokens, bias, bans, sampling, which distribution log-probs are over, the bytes of full
logits) and returns it as plain checked values: arrays in the head's columns, numbers in range,
and a ``Shape`` for the distribution. Only then does anything run; the math
(``service.plane.distribution``, ``service.plane.scoring``, ``service.runtime.vocabulary``)
takes checked values and never checks a request itself. Messages name the field, the expected
and the actual value, and never echo data (``Limits`` holds the numeric limits).
"""

from __future__ import annotations

import math
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from service.errors import InvalidInput, ServiceError
from service.limits import Limits
from service.messages import (
    CompareRequest,
    InferRequest,
    LogitsRequest,
    SampleOptions,
    ScoreRequest,
    TopKRequest,
    VocabularyOptions,
)
from service.plane import decoding_options
from service.plane.grouping import Kept
from service.repository.loaded_version import LoadedVersion
from service.runtime.processors import Processors
from service.runtime.vocabulary import OVERS, Bias, Floats, Ids, SampleSpec, Shape, TokenSpace

#: A logit_bias key as JSON object keys write token ids: ASCII digits, no sign or leading zero.
TOKEN_KEY = re.compile(r"0|[1-9][0-9]{0,17}")


@dataclass(frozen=True)
class CheckedTopK:
    """Top-k rows, k and temperature; ``shape`` when vocabulary options shape the distribution
    (None: the head's own)."""

    hidden: Floats
    k: int
    temperature: float
    shape: Shape | None = None


@dataclass(frozen=True)
class CheckedLogits:
    """Full logits of ``hidden``, or of the ``allowed`` columns only; after the decoding
    step's ``processors`` when asked."""

    hidden: Floats
    temperature: float
    allowed: Ids | None = None
    processors: Processors | None = None


@dataclass(frozen=True)
class CheckedInfer:
    """The V2 infer's parts: the embedding lookup's ids and/or the projection's top-k."""

    input_ids: Ids | None
    topk: CheckedTopK | None
    full_logits: bool


@dataclass(frozen=True)
class CheckedScore:
    """Rows (flat), one target column per row, the candidates' columns, and what to answer:
    ``within`` scores among the candidates only; ``k`` alternatives (0: none) from runs of
    top-``run_k``."""

    rows: Floats
    targets: Ids
    candidates: Ids | None
    within: bool
    k: int
    run_k: int


@dataclass(frozen=True)
class CheckedCompare:
    hidden: Floats
    targets: Ids | None
    k: int


def topk(request: TopKRequest, model: LoadedVersion, limits: Limits) -> CheckedTopK:
    """``/topk``: rows, k, temperature, then the vocabulary options (in that order)."""
    hidden = limits.hidden_states(request.hidden_states, model.d_model)
    k = limits.k(request.k, model.default_k)
    return _topk(hidden, k, request.temperature, request.vocabulary, model, limits)


def group_rows(
    requests: Sequence[TopKRequest], model: LoadedVersion, limits: Limits
) -> tuple[list[Kept], list[tuple[int, ServiceError]]]:
    """Calls served as one (``DataPlane.topk_group``): each call's rows checked alone, so a
    bad call fails by itself; the calls kept, and each bad one's error."""
    kept, failed = [], []
    for index, request in enumerate(requests):
        try:
            kept.append((index, limits.hidden_states(request.hidden_states, model.d_model)))
        except ServiceError as error:
            failed.append((index, error))
    return kept, failed


def group_options(first: TopKRequest, model: LoadedVersion, limits: Limits) -> tuple[int, float]:
    """The k and temperature every call of a group shares (``grouping.group_key``)."""
    return limits.k(first.k, model.default_k), limits.temperature(first.temperature)


def logits(request: LogitsRequest, model: LoadedVersion, limits: Limits) -> CheckedLogits:
    """``/logits``: rows and temperature; the allowed columns, or the whole row's bytes."""
    hidden = limits.hidden_states(request.hidden_states, model.d_model)
    temperature = limits.temperature(request.temperature)
    rows = math.prod(hidden.shape[:-1])
    processors = None
    if request.decoding is not None:  # the whole rows run, whatever the answer's columns
        limits.logits(rows, model.vocab_size)
        processors = decoding_options.processors(request.decoding, rows, model.space, limits)
    if request.allowed_token_ids is None:
        limits.logits(rows, model.vocab_size)
        return CheckedLogits(hidden, temperature, None, processors)
    allowed = token_lists(request.allowed_token_ids, rows, model.space, limits, "allowed_token_ids")
    return CheckedLogits(hidden, temperature, allowed, processors)


def embed(input_ids: npt.NDArray[Any], model: LoadedVersion, limits: Limits) -> Ids:
    """``/embed`` (and infer's ``input_ids``): ids in range, as columns."""
    return token_ids(input_ids, model.space, limits, "input_ids")


def infer(request: InferRequest, model: LoadedVersion, limits: Limits) -> CheckedInfer:
    """V2 infer: its ids, then its rows and their top-k options (one output may widen k)."""
    ids = None if request.input_ids is None else embed(request.input_ids, model, limits)
    if request.hidden_states is None:
        return CheckedInfer(ids, None, False)
    hidden = limits.hidden_states(request.hidden_states, model.d_model)
    k = limits.k(request.k, model.default_k)
    if request.at_least_default_k:
        k = max(k, model.default_k)
    if request.vocabulary is not None and request.full_logits:
        limits.temperature(request.temperature)
        raise InvalidInput(
            "the logits output cannot be combined with allowed_token_ids, "
            "logit_bias, banned_token_ids or sample (use /v1 .../logits)"
        )
    checked = _topk(hidden, k, request.temperature, request.vocabulary, model, limits)
    if request.full_logits:
        limits.logits(math.prod(hidden.shape[:-1]), model.vocab_size)
    return CheckedInfer(ids, checked, request.full_logits)


def score(request: ScoreRequest, model: LoadedVersion, limits: Limits) -> CheckedScore:
    """``/score``: rows, targets, candidates, then which distribution and how many
    alternatives; with ``logprobs_over='candidates'`` each target must be a candidate."""
    hidden = limits.hidden_states(request.hidden_states, model.d_model)
    targets = row_targets(request.target_ids, hidden, model.space, limits)
    rows = hidden.reshape(-1, model.d_model)
    candidates = None
    if request.candidate_ids is not None:
        candidates = token_lists(
            request.candidate_ids, len(rows), model.space, limits, "candidate_ids"
        )
    within = request.logprobs_over == "candidates"
    if within:
        if candidates is None:
            raise InvalidInput("logprobs_over='candidates' needs candidate_ids")
        if request.k:  # nothing runs over the vocabulary: there are no alternatives
            raise InvalidInput(
                "k does not apply with logprobs_over='candidates' (every candidate's "
                "log-prob is in the answer); leave k out"
            )
        every = np.broadcast_to(candidates, (len(rows), candidates.shape[-1]))
        if not (every == targets[:, None]).any(axis=1).all():
            raise InvalidInput(
                "with logprobs_over='candidates' each target_id must be among its row's "
                "candidate_ids"
            )
    elif request.logprobs_over not in (None, "vocabulary"):
        raise InvalidInput("logprobs_over must be 'candidates' or 'vocabulary'")
    run_k = limits.k(request.k, request.k) if request.k else 1
    return CheckedScore(rows, targets, candidates, within, request.k, run_k)


def compare(
    request: CompareRequest, heads: tuple[LoadedVersion, LoadedVersion], limits: Limits
) -> CheckedCompare:
    """``/compare``: two heads that can be compared, rows, targets, k, and both heads' full
    logits within the byte limit (both are held at once)."""
    a, b = heads
    a.check_comparable(b)
    hidden = limits.hidden_states(request.hidden_states, a.d_model)
    targets = None
    if request.target_ids is not None:
        targets = row_targets(request.target_ids, hidden, a.space, limits)
    k = limits.k(request.k, request.k)
    rows = math.prod(hidden.shape[:-1])
    for head in heads:
        limits.logits(rows, head.vocab_size, copies=2)
    return CheckedCompare(hidden, targets, k)


def _topk(
    hidden: Floats,
    k: int,
    temperature: float,
    vocabulary: VocabularyOptions | None,
    model: LoadedVersion,
    limits: Limits,
) -> CheckedTopK:
    """The temperature and vocabulary options of rows and a k already checked."""
    temperature = limits.temperature(temperature)
    if vocabulary is None:
        return CheckedTopK(hidden, k, temperature)
    rows = math.prod(hidden.shape[:-1])
    shape, temperature = vocabulary_shape(vocabulary, rows, model.space, limits, temperature)
    if shape.allowed is not None:
        k = min(k, shape.allowed.shape[-1])
    return CheckedTopK(hidden, k, temperature, shape)


def vocabulary_shape(
    options: VocabularyOptions, rows: int, space: TokenSpace, limits: Limits, temperature: float
) -> tuple[Shape, float]:
    """Allowed ids, bias, bans, log-probs' distribution and sampling, checked, in the head's
    columns, and the temperature of the run (the sampling one, when given)."""
    vocab = len(space.kept) if space.kept is not None else space.size
    allowed = None
    if options.allowed_token_ids is not None:
        allowed = token_lists(options.allowed_token_ids, rows, space, limits, "allowed_token_ids")
    banned = _banned(options.banned_token_ids, space, limits)
    bias = Bias.of(_bias_table(options.logit_bias, space, limits), banned)
    if bias is not None and allowed is None and bias.banned >= vocab:
        raise InvalidInput(f"banned_token_ids bans all {vocab} tokens; leave at least one")
    if bias is not None and allowed is not None:
        allowed_banned = np.isin(allowed, bias.ids[np.isneginf(bias.values)])
        if allowed_banned.all(axis=-1).any():
            raise InvalidInput("every allowed token of a row is banned; leave at least one")
    name = options.logprobs_over or ("candidates" if allowed is not None else "vocabulary")
    over = OVERS.get(name)
    if over is None:
        raise InvalidInput(f"logprobs_over must be 'candidates' or 'vocabulary', got {name!r}")
    if over == "candidates" and allowed is None:
        raise InvalidInput("logprobs_over='candidates' needs allowed_token_ids")
    sample = None
    if options.sample is not None:
        sample, temperature = _sample_spec(options.sample, vocab, limits, temperature)
    processors = decoding_options.of_vocabulary(options, rows, space, limits, allowed, banned)
    if bias is not None:  # added to the logits before temperature, as in transformers and
        bias = bias.at(temperature)  # vLLM: the run's logits are already divided by it
    return Shape(allowed, bias, over, sample, processors), temperature


def _banned(raw: npt.NDArray[Any] | None, space: TokenSpace, limits: Limits) -> Ids | None:
    """``banned_token_ids``: one flat list, banned on every row, as the document gives it
    (``[[21393], [19560]]`` was flattened: both tokens banned on both rows)."""
    if raw is None:
        return None
    if raw.ndim != 1:
        raise InvalidInput(
            "banned_token_ids must be one flat list of ids, banned on every row; got "
            f"{raw.ndim} levels of lists (allowed_token_ids takes one list per row)"
        )
    return token_ids(raw, space, limits, "banned_token_ids")


def token_ids(raw: npt.NDArray[Any], space: TokenSpace, limits: Limits, field: str) -> Ids:
    """Ids a request names, checked (``Limits.token_ids``) and turned into the head's columns
    (the same numbers unless the head is trimmed)."""
    return space.local(limits.token_ids(raw, space.size, field), field)


def row_targets(
    raw: npt.NDArray[Any], hidden: npt.NDArray[Any], space: TokenSpace, limits: Limits
) -> Ids:
    """``target_ids``: one id per row of ``hidden``, checked, as columns (flat)."""
    if raw.shape != hidden.shape[:-1]:
        raise InvalidInput(
            f"target_ids must have shape {list(hidden.shape[:-1])} (one per row), "
            f"got {list(raw.shape)[:8]}"
        )
    return token_ids(raw, space, limits, "target_ids").reshape(-1)


def token_lists(raw: Ids, rows: int, space: TokenSpace, limits: Limits, field: str) -> Ids:
    """One list of ids for every row (n,), or one list per row (rows, n), as columns."""
    if raw.ndim not in (1, 2) or raw.shape[-1] > space.size:
        raise InvalidInput(
            f"{field} must be one list of ids for every row, or one list per row, "
            f"of at most {space.size} ids"
        )
    ids = token_ids(raw, space, limits, field)
    if ids.ndim == 2 and ids.shape[0] != rows:
        lists = ids.shape[0]
        raise InvalidInput(
            f"{field} must be one list of ids for all rows, or one list per row: "
            f"got {lists} list{'s' if lists != 1 else ''} for {rows} rows"
        )
    _refuse_repeats(raw, field)
    return ids


def _refuse_repeats(raw: npt.NDArray[Any], field: str) -> None:
    """A token named twice in one list would count twice in the candidates' softmax (its
    log-prob and rank, and its odds of being drawn, all off), so a list names each once."""
    ordered = np.sort(np.atleast_2d(raw), axis=-1)
    repeated = ordered[:, 1:] == ordered[:, :-1]
    if repeated.any():
        row, column = np.argwhere(repeated)[0]
        raise InvalidInput(f"{field} names token {int(ordered[row, column])} twice; once each")


def _bias_table(
    raw: dict[object, object] | None, space: TokenSpace, limits: Limits
) -> dict[int, float]:
    """Bias per column: keys are original token ids, values numbers in the bias range."""
    if not raw:
        return {}
    limits.logit_bias(len(raw))
    table: dict[int, float] = {}
    for key, value in raw.items():
        token = _integer(key)
        if token is None or not 0 <= token < space.size:
            raise InvalidInput(f"logit_bias keys must be token ids in [0, {space.size})")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidInput("logit_bias values must be numbers")
        table[token] = limits.bias(float(value))
    columns = space.local(np.fromiter(table, np.int64, len(table)), "logit_bias")
    return dict(zip(columns.tolist(), table.values(), strict=True))


def _integer(key: object) -> int | None:
    """A logit_bias key: an int, or a token id written as JSON object keys are ("50256"):
    ASCII digits without sign, spaces or leading zeros, so two keys never name one token."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and TOKEN_KEY.fullmatch(key):
        return int(key)
    return None


def _sample_spec(
    options: SampleOptions, vocab: int, limits: Limits, temperature: float
) -> tuple[SampleSpec, float]:
    sampling = options.temperature
    if sampling is not None and temperature != 1.0 and sampling != temperature:
        raise InvalidInput("give the temperature once: sample.temperature or temperature")
    if sampling is not None and sampling != 0:
        temperature = limits.temperature(sampling, "sample.temperature (or 0: greedy)")
    if options.top_k is not None:
        limits.k(options.top_k, options.top_k, "sample.top_k")
    if options.top_p is not None and not 0.0 < options.top_p <= 1.0:
        raise InvalidInput(f"sample.top_p must be in (0, 1], got {options.top_p}")
    if options.min_p is not None and not 0.0 <= options.min_p <= 1.0:
        raise InvalidInput(f"sample.min_p must be in [0, 1], got {options.min_p}")
    seed = options.seed if options.seed is not None else secrets.randbits(63)
    if not 0 <= seed < 2**63:
        raise InvalidInput(f"sample.seed must be in [0, 2**63), got {seed}")
    spec = SampleSpec(
        0.0 if sampling == 0 else temperature,
        options.top_k,
        options.top_p,
        options.min_p,
        seed,
        decoding_options.draws(options.n),
    )
    return spec, temperature
