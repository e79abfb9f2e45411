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
from service.messages import DecodingOptions, TokenLists
from service.plane.options import token_ids, vocabulary_shape
from service.repository.loaded_version import LoadedVersion
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
        options = request.vocabulary
        if options.allowed_token_ids is not None:
            raise InvalidInput("allowed_token_ids: /verify takes bans and bias, not allowed ids")
        rows = sequences * positions
        if options.decoding is not None:
            decoding = _per_position(options.decoding, raw_ids, parents, positions)
            options = replace(options, decoding=decoding)
        shape, temperature = vocabulary_shape(options, rows, model.space, limits, temperature)
        if shape.sample is not None and shape.sample.n is not None:
            raise InvalidInput(
                f"sample.n: /verify draws one token per sequence, got {shape.sample.n}"
            )
        greedy |= shape.sample is not None and shape.sample.temperature == 0
    seeds = _seeds(request.seeds, shape, sequences)
    checked = CheckedVerify(hidden, draft_ids, probs, parents, shape, temperature, greedy, seeds)
    return _with_draft_states(request, checked, model, draft, limits)


def _with_draft_states(
    request: VerifyRequest,
    checked: CheckedVerify,
    model: LoadedVersion,
    draft: LoadedVersion | None,
    limits: Limits,
) -> CheckedVerify:
    """``draft_model``: a head naming the same tokens, its states (sequences, K, d_model),
    no ``draft_probs`` beside it, a chain, and no per-row decoding options (their rows are
    the target's positions)."""
    if draft is None:
        if request.draft_hidden_states is not None:
            raise InvalidInput("draft_hidden_states needs draft_model: the head that reads them")
        return checked
    if checked.draft_probs is not None or checked.parents is not None:
        raise InvalidInput("draft_model takes neither draft_probs nor draft_parents")
    if checked.shape is not None and checked.shape.processors is not None:
        raise InvalidInput("draft_model: the decoding step's per-row options are not taken")
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
    return replace(checked, draft_hidden=states)


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
