"""``/verify``'s inputs checked before any math (``service.plane.verify`` runs them): the
states and drafts' shapes, the tree's parents, the draft's probabilities, the seeds, the
decoding step's options made per position, and a ``draft_model``'s states. Each refusal
names its field, the expected and the actual value, and never echoes data."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from service.errors import InvalidInput
from service.limits import Limits
from service.messages import DecodingOptions, TokenLists, VocabularyOptions
from service.plane.decoding_options import allowed_mask, refuse_empty_rows
from service.plane.options import token_ids, token_lists, vocabulary_shape
from service.repository.loaded_version import LoadedVersion
from service.runtime.processors import Histories, Processors, Words
from service.runtime.vocabulary import Floats, Ids, Shape
from service.verify_messages import VerifyRequest

#: How far a draft row's sum may be from 1.
SUM_TOLERANCE = 1e-3


@dataclass(frozen=True)
class CheckedVerify:
    """The inputs, checked and in the head's columns: ``hidden`` (S, K + 1, d_model),
    ``draft_ids`` (S, K), ``draft_probs`` (S, K, vocab) or None, ``parents`` (K,) or None
    (a chain), the distribution's ``shape``, the run's ``temperature``, ``greedy``, one seed
    per sequence."""

    hidden: Floats
    draft_ids: Ids
    draft_probs: npt.NDArray[np.float32] | None
    parents: Ids | None
    shape: Shape | None
    temperature: float
    greedy: bool
    seeds: Ids
    draft_hidden: Floats | None = None

    @property
    def filtered(self) -> bool:
        spec = None if self.shape is None else self.shape.sample
        return spec is not None and (spec.top_k, spec.top_p, spec.min_p) != (None,) * 3

    @property
    def dense(self) -> bool:
        """Whether every position's whole row is read (``plane.verify``): a tree with a draft
        distribution (``draft_probs`` or a ``draft_model``'s), whose rejections make residuals
        of whole rows at every node they pass. Chains, and trees of drafts taken as certain,
        read the drafts' probabilities and one whole row per sequence (``verify_plain``)."""
        given = self.draft_probs is not None or self.draft_hidden is not None
        return self.parents is not None and given


def check(
    request: VerifyRequest, model: LoadedVersion, limits: Limits, draft: LoadedVersion | None = None
) -> CheckedVerify:
    """Every input, before any math; each refusal names its field, expected and actual
    (``draft``: the ``draft_model``'s head, when one is named)."""
    hidden = limits.hidden_states(request.hidden_states, model.d_model)
    if hidden.ndim != 3:
        raise InvalidInput(
            f"hidden_states must have shape (sequences, K + 1, {model.d_model}), "
            f"got {list(hidden.shape)}"
        )
    sequences, positions = hidden.shape[:2]
    raw_ids = np.asarray(request.draft_token_ids)
    if raw_ids.shape != (sequences, positions - 1):
        raise InvalidInput(
            f"draft_token_ids must have shape [{sequences}, {positions - 1}] (hidden_states "
            f"holds K + 1 = {positions} positions), got {list(raw_ids.shape)[:8]}"
        )
    if positions < 2:
        raise InvalidInput(f"hidden_states must hold K + 1 >= 2 positions, got {positions}")
    draft_ids = token_ids(raw_ids, model.space, limits, "draft_token_ids")
    parents = _parents(request.draft_parents, positions - 1)
    probs = None
    if request.draft_probs is not None:
        probs = _draft_probs(request.draft_probs, draft_ids, model.vocab_size)
    greedy = request.temperature == 0
    temperature = 1.0 if greedy else limits.temperature(request.temperature)
    shape = None
    if request.vocabulary is not None:
        shape, temperature = _shape(
            request.vocabulary, raw_ids, parents, model, limits, temperature
        )
        greedy |= shape.sample is not None and shape.sample.temperature == 0
    seeds = _seeds(request.seeds, shape, sequences)
    checked = CheckedVerify(hidden, draft_ids, probs, parents, shape, temperature, greedy, seeds)
    return _with_draft_states(request, checked, model, draft, limits)


def _shape(
    options: VocabularyOptions,
    drafts: npt.NDArray[Any],
    parents: Ids | None,
    model: LoadedVersion,
    limits: Limits,
    temperature: float,
) -> tuple[Shape, float]:
    """The target's distribution at every position (sequences x (K + 1) rows): histories
    made per position; ``allowed_token_ids`` a mask among the processors (the tokens it
    leaves out at -inf, as the bitmask's: the distribution is renormalized over the allowed
    ones, at every position, for the target and a draft_model alike)."""
    sequences, positions = drafts.shape[0], drafts.shape[1] + 1
    rows = sequences * positions
    if options.logprobs_over is not None:
        raise InvalidInput(
            "logprobs_over does not apply to /verify: log-probs are over the tokens the "
            "options leave (logprobs_mode says raw or processed)"
        )
    decoding = options.decoding
    if decoding is not None:
        decoding = _per_position(decoding, drafts, parents, positions)
    allowed = options.allowed_token_ids
    if allowed is not None:
        decoding = decoding or DecodingOptions()  # the processors hold the allowed ids' mask
    options = replace(options, allowed_token_ids=None, decoding=decoding)
    shape, temperature = vocabulary_shape(options, rows, model.space, limits, temperature)
    if shape.sample is not None and shape.sample.n is not None:
        raise InvalidInput(
            f"sample.n does not apply to /verify (got {shape.sample.n}): a verification "
            "emits one token per sequence, the draw after its accepted drafts; leave n out"
        )
    if allowed is None:
        return shape, temperature
    assert shape.processors is not None
    mask = _allowed_mask(np.asarray(allowed), sequences, positions, model, limits)
    given = shape.processors.bitmask
    processors = replace(
        shape.processors, bitmask=mask if given is None else np.bitwise_and(given, mask)
    )
    banned = options.banned_token_ids
    if banned is not None:
        banned = token_ids(np.asarray(banned), model.space, limits, "banned_token_ids")
    refuse_empty_rows(processors, rows, shape_vocab(model), banned)
    return replace(shape, processors=processors), temperature


def shape_vocab(model: LoadedVersion) -> int:
    """The columns of the head's distribution (a trimmed head's kept tokens)."""
    space = model.space
    return len(space.kept) if space.kept is not None else space.size


def _allowed_mask(
    allowed: npt.NDArray[Any], sequences: int, positions: int, model: LoadedVersion, limits: Limits
) -> Words:
    """``allowed_token_ids`` as a bitmask over the head's columns with a row per position:
    one list for every position (n,), one per sequence (sequences, n), the same at its K + 1
    positions, or one per position (sequences * (K + 1), n)."""
    lists = len(allowed) if allowed.ndim == 2 else 1
    if allowed.ndim == 2 and lists not in (sequences, sequences * positions):
        raise InvalidInput(
            f"allowed_token_ids must be one list for every position, one per sequence "
            f"({sequences}) or one per position (sequences x (K + 1) = {sequences * positions}), "
            f"got {lists} lists"
        )
    columns = token_lists(allowed, lists, model.space, limits, "allowed_token_ids")
    mask = allowed_mask(columns, shape_vocab(model))
    if allowed.ndim == 2 and lists == sequences and positions > 1:
        mask = np.repeat(mask, positions, axis=0)
    return mask


def draft_rows(checked: CheckedVerify) -> Ids:
    """The target's rows whose options a draft_model's rows take: draft j of sequence s was
    drawn where node j's parent stands (a chain: position j), after the same drafts, so its
    distribution is processed as the target's at row s * (K + 1) + parents[j] + 1 is."""
    sequences, nodes = checked.draft_ids.shape
    tree = np.arange(-1, nodes - 1) if checked.parents is None else checked.parents
    starts = np.arange(sequences, dtype=np.int64)[:, None] * (nodes + 1)
    rows: Ids = (starts + tree[None, :] + 1).reshape(-1)
    return rows


def _with_draft_states(
    request: VerifyRequest,
    checked: CheckedVerify,
    model: LoadedVersion,
    draft: LoadedVersion | None,
    limits: Limits,
) -> CheckedVerify:
    """``draft_model``: a head naming the same tokens, its states (sequences, K, d_model),
    no ``draft_probs`` beside it; on a tree, siblings' states equal (they are draws from one
    distribution: the multi-draft rule is exact for that alone)."""
    if draft is None:
        if request.draft_hidden_states is not None:
            raise InvalidInput("draft_hidden_states needs draft_model: the head that reads them")
        return checked
    if checked.draft_probs is not None:
        raise InvalidInput(
            "draft_model takes no draft_probs beside it: the head gives the draft's distribution"
        )
    if draft.vocab_size != model.vocab_size or not draft.space.same_tokens(model.space):
        raise InvalidInput(
            f"draft_model {draft.name} must name the same tokens as {model.name}: vocabularies "
            f"of {draft.vocab_size} and {model.vocab_size} tokens (or trimmed to other ids)"
        )
    if request.draft_hidden_states is None:
        raise InvalidInput(f"draft_model needs draft_hidden_states (sequences, K, {draft.d_model})")
    states = limits.hidden_states(request.draft_hidden_states, draft.d_model, "draft_hidden_states")
    expected = (*checked.draft_ids.shape, draft.d_model)
    if states.shape != expected:
        raise InvalidInput(
            f"draft_hidden_states must have shape {list(expected)} (one state per draft, "
            f"{draft.name}'s d_model), got {list(states.shape)}"
        )
    if checked.parents is not None:
        _siblings_alike(states, checked.parents)
    return replace(checked, draft_hidden=states)


def _siblings_alike(states: Floats, parents: Ids) -> None:
    """A tree's siblings were drawn from one draft distribution, so their drafter states
    (each node's: the state where its parent stands) must be one state."""
    first: dict[int, int] = {}
    for node, parent in enumerate(parents.tolist()):
        sibling = first.setdefault(parent, node)
        if sibling != node and not np.array_equal(states[:, node], states[:, sibling]):
            raise InvalidInput(
                f"draft_hidden_states[:, {node}] must equal draft_hidden_states[:, {sibling}]: "
                f"nodes {sibling} and {node} are siblings (draft_parents), draws from one "
                "draft distribution, so they share the drafter's state"
            )


def draft_shape(checked: CheckedVerify) -> Shape:
    """The draft_model's distribution's options: the target's (bias, bans, filters), its
    processors' rows those of the target's rows the drafts were drawn at (``draft_rows``)."""
    shape = checked.shape or Shape()
    if shape.processors is None:
        return shape
    return replace(shape, processors=rows_of(shape.processors, draft_rows(checked)))


def rows_of(processors: Processors, index: Ids) -> Processors:
    """The processors of rows ``index`` (any order, repeats allowed): their histories and
    bitmask rows; what holds for every row (penalties, stop ids, bad words) as it is."""

    def lists(histories: Histories | None) -> Histories | None:
        if histories is None:
            return None
        lengths = histories.lengths[index]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        shift = np.repeat(histories.offsets[index] - offsets[:-1], lengths)
        return Histories(histories.values[np.arange(offsets[-1]) + shift], offsets)

    bitmask = processors.bitmask
    if bitmask is not None and len(bitmask) > 1:
        bitmask = bitmask[index]
    return replace(
        processors,
        prompt=lists(processors.prompt),
        output=lists(processors.output),
        bitmask=bitmask,
    )


def _per_position(
    options: DecodingOptions, drafts: npt.NDArray[Any], parents: Ids | None, positions: int
) -> DecodingOptions:
    """Histories given per sequence, made per position: the target's distribution at a
    drafted position follows the earlier drafts (on a tree, the node's ancestors), so each
    position's output history is the sequence's with those drafts appended (penalties and
    ``min_tokens`` count them, as the step after them would); the prompt repeats. A grammar's
    bitmask is given per position already ((sequences * (K + 1), words) or one row)."""
    nodes = positions - 1
    tree = np.arange(-1, nodes - 1) if parents is None else parents
    paths: list[list[int]] = [[]]  # position j + 1 follows node j: its ancestors and itself
    for node in range(nodes):
        paths.append([*paths[int(tree[node]) + 1], node])
    sequences = len(drafts)

    def expanded(lists: TokenLists | None, field: str, with_drafts: bool) -> TokenLists | None:
        if lists is None:
            return None
        lengths = np.asarray(lists.lengths, np.int64)
        if len(lengths) != sequences:
            raise InvalidInput(
                f"{field} must hold one list per sequence: got {len(lengths)} lists for "
                f"{sequences} sequences"
            )
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        values = np.asarray(lists.values)
        rows = []
        for sequence in range(sequences):
            own = values[offsets[sequence] : offsets[sequence + 1]].tolist()
            for path in paths:
                tail = drafts[sequence, path].tolist() if with_drafts else []
                rows.append(own + tail)
        return TokenLists.of(rows)

    return replace(
        options,
        prompt_token_ids=expanded(options.prompt_token_ids, "prompt_token_ids", False),
        output_token_ids=expanded(
            options.output_token_ids or TokenLists.of([[]] * sequences), "output_token_ids", True
        ),
    )


def _parents(raw: npt.NDArray[Any] | None, nodes: int) -> Ids | None:
    """``draft_parents``: (K,) ids, each -1 (the root's child) or an earlier node, so the
    drafts form a tree: a parent at or after its node would make a cycle or point forward."""
    if raw is None:
        return None
    parents = np.asarray(raw)
    if parents.shape != (nodes,) or parents.dtype.kind not in "iu":
        raise InvalidInput(
            f"draft_parents must be {nodes} integers (one per draft), got "
            f"{parents.dtype.name} of shape {list(parents.shape)[:8]}"
        )
    index = np.arange(nodes)
    bad = (parents < -1) | (parents >= index)
    if bad.any():
        node = int(np.flatnonzero(bad)[0])
        raise InvalidInput(
            f"draft_parents[{node}] must be -1 or an earlier node (< {node}): a later or own "
            f"index forms a cycle or points forward; got {int(parents[node])}"
        )
    return parents.astype(np.int64)


def _draft_probs(raw: npt.NDArray[Any], draft_ids: Ids, vocab: int) -> npt.NDArray[np.float32]:
    """(S, K, vocab) probabilities: finite, non-negative, each row summing to 1 within
    ``SUM_TOLERANCE``, and each draft's own token above 0 (a draft cannot sample a token it
    gives no mass)."""
    expected = (*draft_ids.shape, vocab)
    if raw.shape != expected or raw.dtype.kind != "f":
        raise InvalidInput(
            f"draft_probs must be floats of shape {list(expected)}, got "
            f"{raw.dtype.name} of shape {list(raw.shape)[:8]}"
        )
    probs = raw.astype(np.float32, copy=False)
    sums = probs.sum(axis=2)  # float32's pairwise sum: well within the tolerance
    if not (np.isfinite(sums).all() and probs.min() >= 0):  # NaN fails both
        raise InvalidInput("draft_probs must be finite and non-negative")
    off = np.abs(sums - 1.0) > SUM_TOLERANCE
    if off.any():
        s, k = (int(i) for i in np.argwhere(off)[0])
        raise InvalidInput(
            f"draft_probs[{s}][{k}] must sum to 1 (within {SUM_TOLERANCE:g}), "
            f"got {float(sums[s, k]):.6g}"
        )
    own = np.take_along_axis(probs, draft_ids[:, :, None], axis=2)[:, :, 0]
    if (own <= 0).any():
        s, k = (int(i) for i in np.argwhere(own <= 0)[0])
        raise InvalidInput(
            f"draft_probs[{s}][{k}] gives the drafted token {int(draft_ids[s, k])} "
            "probability 0: a draft must have had a chance to sample its own token"
        )
    return probs


def _seeds(raw: npt.NDArray[Any] | None, shape: Shape | None, sequences: int) -> Ids:
    """One seed per sequence: as sent; else ``sample.seed`` + the sequence's index; else
    random (63 bits), given back so the answer can be reproduced."""
    if raw is None:
        spec = None if shape is None else shape.sample
        first = secrets.randbits(62) if spec is None else spec.seed
        return (first + np.arange(sequences, dtype=np.int64)) % (2**63 - 1)
    seeds = np.asarray(raw)
    if seeds.shape != (sequences,) or seeds.dtype.kind not in "iu":
        raise InvalidInput(
            f"seeds must be {sequences} integers (one per sequence), got "
            f"{seeds.dtype.name} of shape {list(seeds.shape)[:8]}"
        )
    if (seeds < 0).any() or (seeds >= 2**63 - 1).any():
        raise InvalidInput("seeds must be in [0, 2**63 - 1)")
    return seeds.astype(np.int64)
