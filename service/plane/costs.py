"""What a request costs, declared from its shape before anything runs: one place, every verb.

Each verb's checked request (``service.plane.options``) gives a ``Cost`` here, from shapes
alone: rows, layers x tokens, k, the vocabulary, the columns asked, the head's longest label.
``admit`` then admits or refuses it before the first run:

* ``run``: the (rows x vocab) float32 tensors of the request's largest single run. Above
  ``LMHEAD_MAX_LOGITS_BYTES`` it is refused (413): every verb's runs stay within that setting,
  which is what the worst case counts per inference thread (``budget.worst_case_extra_bytes``).
  A run is never charged to the in-flight budget (its term is the thread's), but it counts
  toward handing memory back once the service is idle (``budget.ran``).
* ``held``: what the request itself holds at its peak: its working arrays (rows through the
  norm, logits it keeps between runs) and its answer (the result's arrays, and their encoding
  as JSON, the largest the front ends write, labels and escapes included). Alone above
  ``LMHEAD_MAX_INFLIGHT_BYTES`` it is refused (413, it could never run); beside the requests in
  flight past it, 503 with Retry-After. The charge stays with the request until its answer
  has left.

The figures are upper bounds: a test sweeps request shapes for every verb and checks a served
request's measured peak against them (``tests/integration/test_declared_costs.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from service.budget import charge, ran
from service.errors import PayloadTooLarge, ServiceError
from service.limits import LOGIT_BYTES, Limits
from service.messages import TopKRequest
from service.plane.decoding import RAW_SLACK, width_of
from service.plane.decoding_compact import compact_extent
from service.plane.grouping import Kept
from service.plane.options import CheckedInfer, CheckedTopK
from service.plane.verify_checks import CheckedVerify
from service.plane.verify_rows import filters, raw_width
from service.repository.loaded_version import LoadedVersion
from service.runtime.processors import Processors
from service.runtime.sparse_masks import SPARSE
from service.runtime.vocabulary import Shape

#: JSON text of one value, its separator included: a float32 as orjson writes numpy's
#: (``-1.1754944e-38,``), a Python float (``-1.1754943508222875e-38,``).
F32_TEXT = 16
F64_TEXT = 25
#: An answer row's object: its keys, brackets and the few numbers beside its lists.
ROW_TEXT = 160
#: An answer's identity and options (model, version, k, shape, ...).
HEAD_TEXT = 1024
#: Copies of a JSON answer's text alive at once: the encoder calls' fragments and the pieces
#: they are joined into, all made before the head is sent and freed as they leave
#: (``service.api.codec.pieces``; measured up to 1.9x the text by the declared-costs sweep).
JSON_COPIES = 2
#: Bytes a Python list slot and a list's header take (token strings as lists of references).
SLOT_BYTES = 8
LIST_BYTES = 56
ID_BYTES = 8  # int64
F64_BYTES = 8
#: Full logits answered as JSON are held as the array, its values as text (at most
#: ``F32_TEXT`` each) and the body.
LOGITS_TEXT_COPIES = 2


@dataclass(frozen=True)
class Cost:
    """A request's declared memory: ``held`` by the request, ``run`` by its largest run."""

    held: int
    run: int = 0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.held + other.held, max(self.run, other.run))


def admit(cost: Cost, limits: Limits, what: str) -> None:
    """Refuse (413) a request whose run or whole cost no setting allows; charge the rest to
    the request's reservation (503 when the requests in flight leave no room)."""
    limits.run(cost.run, what)
    if cost.held > limits.max_inflight_bytes:
        raise PayloadTooLarge(
            f"{what}: the answer and its working memory would hold ~{cost.held} bytes; the "
            f"limit is LMHEAD_MAX_INFLIGHT_BYTES={limits.max_inflight_bytes} (send fewer rows, "
            "a smaller k, or fewer layers and tokens)"
        )
    charge(cost.held)
    ran(cost.run)


def admit_each(
    model: LoadedVersion,
    kept: list[Kept],
    k: int,
    first: TopKRequest,
    residual: bool,
    limits: Limits,
) -> tuple[list[Kept], list[tuple[int, ServiceError]]]:
    """Calls served as one (``DataPlane.topk_group``), each admitted by its own declared cost:
    a call the budget refuses fails alone. The admitted calls, and each refused one's error."""
    admitted, refused = [], []
    for index, hidden in kept:
        checked = CheckedTopK(hidden, k, 1.0)
        cost = topk(model, checked, logprobs=first.logprobs, tokens=first.tokens, residual=residual)
        try:
            admit(cost, limits, "topk")
        except ServiceError as error:
            refused.append((index, error))
        else:
            admitted.append((index, hidden))
    return admitted, refused


def _id_text(model: LoadedVersion) -> int:
    """A token id's text with its separator (``50256,``)."""
    return len(str(max(0, model.space.size - 1))) + 1


def _label_text(model: LoadedVersion, tokens: bool) -> int:
    """A token string's JSON with its separator; per entry, its list slot too."""
    return model.label_bytes + 1 + SLOT_BYTES if tokens and model.label_bytes else 0


def topk_answer(
    model: LoadedVersion, rows: int, k: int, logprobs: bool, tokens: bool, sampled: bool = False
) -> int:
    """A top-k answer: ids (the columns and the original ids), values, log-probs, log-sum-exp,
    token strings; as JSON text."""
    entries = rows * k
    arrays = entries * (2 * ID_BYTES + 2 * LOGIT_BYTES) + rows * (LOGIT_BYTES + ID_BYTES)
    per_entry = _id_text(model) + F32_TEXT + (F32_TEXT if logprobs else 0)
    per_entry += _label_text(model, tokens)
    per_row = ROW_TEXT + (LIST_BYTES if tokens else 0)
    if sampled:
        per_row += _id_text(model) + F64_TEXT + _label_text(model, tokens)
    text = entries * per_entry + rows * per_row + HEAD_TEXT
    return arrays + JSON_COPIES * text


def normed_rows(model: LoadedVersion, rows: int, residual: bool) -> int:
    """Rows read through the head's final norm are a copy of the request's."""
    return rows * model.d_model * LOGIT_BYTES if residual else 0


def run_bytes(model: LoadedVersion, rows: int, copies: int = 2) -> int:
    """One run of ``rows`` rows (at most the version's run size): its logits and the top-k's
    or log-softmax's temporary beside them."""
    return min(rows, model.rows_per_run) * model.vocab_size * LOGIT_BYTES * copies


def topk(
    model: LoadedVersion, checked: CheckedTopK, *, logprobs: bool, tokens: bool, residual: bool
) -> Cost:
    """``/topk`` and V2's top-k outputs. A shaped distribution (bias, bans, sampling) keeps
    one run's full logits, their biased copy and its log-softmax between runs (the exact
    fallback); allowed ids, the (rows x allowed) logits of their columns and their ids."""
    rows, shape = math.prod(checked.hidden.shape[:-1]), checked.shape
    sampled = shape is not None and shape.sample is not None
    held = topk_answer(model, rows, checked.k, logprobs, tokens, sampled)
    held += normed_rows(model, rows, residual)
    if shape is not None and shape.processors is not None:
        held += decoding(model, rows, checked.k, shape, tokens)
    elif shape is not None and shape.allowed is not None:
        held += rows * shape.allowed.shape[-1] * (LOGIT_BYTES + ID_BYTES) * 2
    elif shape is not None:
        held += 3 * run_bytes(model, rows, copies=1)
    return Cost(held, run_bytes(model, rows))


def decoding(model: LoadedVersion, rows: int, k: int, shape: Shape, tokens: bool) -> int:
    """The decoding step beside its top-k answer (``plane.decoding``): one run's logits kept
    and processed in place, the selection's log-softmax of them and the bitmask unpacked to a
    byte per token (one run at a time), the run's own top and the sparse reading's indexes
    (``runtime.sparse_step``); rows read through their allowed tokens, those tokens' rows
    of W, their logits and their step's arrays (``decoding_compact``); each row's sorted
    prefix and its float64 filters; the draws (``sample.n`` per row: ids, values,
    log-probs, uniforms, text); the options' arrays (``decoding_inputs``)."""
    run = min(rows, model.rows_per_run) * model.vocab_size
    spec = shape.sample
    width = width_of(k, shape, model.vocab_size)
    prefix = rows * width * (2 * LOGIT_BYTES + ID_BYTES + 4 * F64_BYTES + 2)
    raw = rows * (width + RAW_SLACK) * (LOGIT_BYTES + ID_BYTES)  # the run's own top
    # the sparse reading's indexes: a row forbidding up to vocab / SPARSE tokens (8 bytes each)
    forbidden = run * ID_BYTES // SPARSE
    held = 2 * run * LOGIT_BYTES + run + prefix + raw + forbidden
    extent = compact_extent(model, shape.processors, rows) if shape.processors else None
    if extent is not None:  # rows read through their allowed tokens (``decoding_compact``)
        few, longest, union = len(extent[0]), extent[1], extent[2]
        held += union * model.d_model * LOGIT_BYTES + few * union * LOGIT_BYTES  # W's rows
        held += few * longest * (3 * LOGIT_BYTES + ID_BYTES + 1 + 4 * F64_BYTES)
    if spec is not None:
        draws = rows * spec.draws
        per_draw = 2 * ID_BYTES + 2 * LOGIT_BYTES + F64_BYTES + _id_text(model) + F32_TEXT
        held += draws * (per_draw + _label_text(model, tokens))
    assert shape.processors is not None
    return held + decoding_inputs(shape.processors)


def decoding_inputs(processors: Processors) -> int:
    """The decoding options' arrays: histories (their ids, offsets, each run's flat indexes
    and their sorted copy), the bitmask over the head's columns and its inversion."""
    held = 0
    for lists in (processors.prompt, processors.output, processors.bad_words):
        if lists is not None:
            held += (4 * lists.values.size + lists.offsets.size) * ID_BYTES
    if processors.bitmask is not None:
        held += 2 * processors.bitmask.nbytes
    return held


def infer(model: LoadedVersion, checked: CheckedInfer, tokens: bool, residual: bool) -> Cost:
    """V2 infer: its top-k outputs (log-probs always), its full logits, its embeddings."""
    cost = Cost(0)
    if checked.topk is not None:
        cost += topk(model, checked.topk, logprobs=True, tokens=tokens, residual=residual)
        if checked.full_logits:
            rows = math.prod(checked.topk.hidden.shape[:-1])
            cost += logits(model, rows, model.vocab_size, residual=False, text=True)
    if checked.input_ids is not None:
        cost += embed(model, checked.input_ids.size)
    return cost


def logits(
    model: LoadedVersion,
    rows: int,
    columns: int,
    residual: bool,
    text: bool,
    processors: Processors | None = None,
) -> Cost:
    """``/logits``: (rows, columns) float32 held for the answer, and its body (JSON text when
    ``text``, else binary); the whole vocabulary's runs hold the same as a top-k's. With the
    decoding step's ``processors`` every row is held whole (the allowed columns taken from
    it), with a run's bitmask unpacked and the options' arrays."""
    values = rows * columns
    each = LOGITS_TEXT_COPIES * F32_TEXT if text else LOGIT_BYTES
    held = values * (LOGIT_BYTES + each) + HEAD_TEXT
    if columns < model.vocab_size:  # the allowed ids' columns are answered beside them
        held += values * (ID_BYTES + (_id_text(model) if text else ID_BYTES)) * 2
    if processors is not None:
        whole = rows * model.vocab_size * LOGIT_BYTES if columns < model.vocab_size else 0
        unpacked = min(rows, model.rows_per_run) * model.vocab_size
        held += whole + unpacked + decoding_inputs(processors)
    return Cost(held + normed_rows(model, rows, residual), run_bytes(model, rows))


def embed(model: LoadedVersion, ids: int) -> Cost:
    """``/embed`` and V2's embeddings: (ids, d_model) float32 and their JSON text."""
    values = ids * model.d_model
    return Cost(values * (LOGIT_BYTES + LOGITS_TEXT_COPIES * F32_TEXT) + HEAD_TEXT)


def score(model: LoadedVersion, rows: int, k: int, candidates: int, residual: bool) -> Cost:
    """``/score``: per row its target's logit, log-prob and rank, its ``k`` alternatives and
    its candidates' logits and log-probs (the target's as Python floats, the others as
    float32) in JSON; runs of ``score_rows``."""
    per_row = 3 * F64_TEXT + ROW_TEXT + (k + candidates) * (_id_text(model) + 2 * F32_TEXT)
    arrays = rows * (3 * ID_BYTES + (k + candidates) * 2 * (ID_BYTES + LOGIT_BYTES))
    held = arrays + JSON_COPIES * (rows * per_row + HEAD_TEXT) + normed_rows(model, rows, residual)
    copies = model.session.score_copies
    return Cost(held, run_bytes(model, rows, copies=copies))


def compare(heads: tuple[LoadedVersion, LoadedVersion], rows: int, residual: bool) -> Cost:
    """``/compare``: both heads' full logits held at once (the statistics' chunks are the
    statistics thread's term of the worst case)."""
    held = sum(rows * head.vocab_size * LOGIT_BYTES for head in heads)
    held += sum(normed_rows(head, rows, residual) for head in heads)
    largest = max(rows * head.vocab_size * LOGIT_BYTES * 2 for head in heads)
    return Cost(held + HEAD_TEXT, largest)


def lens(
    model: LoadedVersion, layers: int, tokens: int, k: int, targets: bool, strings: bool
) -> Cost:
    """``/lens``: per layer and position its top-k (ids, log-probs, token strings), entropy,
    KL and targets' log-prob and rank. A run holds every layer of at least one position: its
    logits and their log-softmax side by side (``lens_run_rows``)."""
    cells = layers * tokens
    entries = cells * k
    arrays = entries * (2 * ID_BYTES + LOGIT_BYTES) + cells * (2 * LOGIT_BYTES)
    text = entries * (_id_text(model) + F32_TEXT + _label_text(model, strings))
    text += cells * 2 * F32_TEXT + (cells * LIST_BYTES if strings else 0)
    if targets:
        arrays += cells * (LOGIT_BYTES + ID_BYTES)
        text += cells * (F32_TEXT + _id_text(model)) + tokens * _id_text(model)
    rows = lens_run_rows(model, layers)
    run = rows * model.vocab_size * LOGIT_BYTES * model.session.score_copies
    states = layers * tokens * model.d_model * LOGIT_BYTES  # the request's rows, as float32
    return Cost(arrays + JSON_COPIES * (text + HEAD_TEXT) + states, run)


def lens_run_rows(model: LoadedVersion, layers: int) -> int:
    """Rows of one lens run: every layer of as many positions as a top-k run of the version
    takes, and at least one position (its KL needs the last layer beside the others)."""
    positions = max(1, model.rows_per_run // layers)
    return positions * layers


def verify(
    model: LoadedVersion,
    sequences: int,
    positions: int,
    shape: Shape | None,
    *,
    draft_probs: bool,
    residual: bool,
) -> Cost:
    """``/verify``'s dense path (``plane.verify``: a tree with a draft distribution): every
    position's raw log-probs and processed probabilities kept whole until the rule runs (two
    (rows x vocab) float32), the rule's float64 copies (a residual row per sequence, its
    cumulative sum and the accepted tokens' rows), the draft's probabilities as float32
    beside the sent ones, the filters' kept mask and a run's step (its logits, the
    selection's log-softmax, the bitmask's bytes); the answer."""
    rows = sequences * positions
    vocab = model.vocab_size
    held = 2 * rows * vocab * LOGIT_BYTES + 4 * sequences * vocab * F64_BYTES
    held += rows * vocab  # the kept mask (filters) or the greedy top's temporaries
    if draft_probs:
        held += 2 * sequences * (positions - 1) * vocab * LOGIT_BYTES
    if shape is not None:
        stepped = replace(shape, processors=shape.processors or _NONE)
        held += decoding(model, rows, 1, stepped, False)
    held += normed_rows(model, rows, residual) + verify_answer(rows)
    return Cost(held, run_bytes(model, rows))


def verify_answer(rows: int) -> int:
    """A verification's answer: ids, positions, nodes and log-probs, a few numbers a row."""
    return rows * (3 * ID_BYTES + LOGIT_BYTES) * (1 + JSON_COPIES) + HEAD_TEXT


def verify_reads(
    model: LoadedVersion,
    sequences: int,
    positions: int,
    shape: Shape | None,
    *,
    rule: int,
    residual: bool,
) -> Cost:
    """``/verify`` read where the rule reads (``plane.verify_plain``: chains, and trees with
    drafts taken as certain): every run's full logits as the runs fetch them, kept until the
    rule (processed in place by the decoding step's run where options shape them: its
    arrays beside; a filtered row whose kept set passes its prefix keeps a byte per token),
    and ``rule`` (sequences x vocab) float32 rows: the stopping rows and the residual's
    temporaries (``verify_call``); the answer. A greedy read of the head's own
    distribution fetches no logits at all (``rule`` < 0)."""
    rows = sequences * positions
    vocab = model.vocab_size
    held = normed_rows(model, rows, residual) + verify_answer(rows)
    if rule < 0:  # the top-1 graph alone
        return Cost(held, run_bytes(model, rows))
    held += rows * vocab * LOGIT_BYTES + rule * sequences * vocab * LOGIT_BYTES
    if shape is not None and raw_width(shape, vocab)[1] > 1:  # the decoding step's run
        stepped = replace(shape, processors=shape.processors or _NONE)
        held += decoding(model, rows, 1, stepped, False)
        held += rows * vocab if filters(shape) else 0
    return Cost(held, run_bytes(model, rows))


def verify_call(
    model: LoadedVersion, drafts: list[LoadedVersion], checked: CheckedVerify, residual: bool
) -> Cost:
    """``/verify`` of ``checked`` on the path it takes (``CheckedVerify.dense``), with its
    draft head's runs and rows beside the target's when one is named. Read where the rule
    reads: the target's stopping rows, the residual's three temporaries and, with a draft
    distribution, its rows there (5 rows a sequence; greedy: none); ``draft_probs`` once
    more as float32 (its copy when sent as another type; the array itself in process); a
    draft head's logits and its whole rows where sequences reject."""
    sequences, positions = checked.hidden.shape[:2]
    shape = checked.shape
    if checked.dense:
        cost = verify(model, sequences, positions, shape, draft_probs=True, residual=residual)
        for head in drafts:
            cost += verify(
                head, sequences, positions - 1, shape, draft_probs=False, residual=residual
            )
        return cost
    plain = shape is None or raw_width(shape, model.vocab_size)[1] == 1
    q = checked.draft_probs is not None or bool(drafts)
    rule = -1 if checked.greedy and plain and not drafts else 0 if checked.greedy else 4 + q
    cost = verify_reads(model, sequences, positions, shape, rule=rule, residual=residual)
    if checked.draft_probs is not None:
        cost += Cost(checked.draft_probs.size * LOGIT_BYTES)
    for head in drafts:
        rows = 0 if checked.greedy else 1
        cost += verify_reads(head, sequences, positions - 1, shape, rule=rows, residual=residual)
    return cost


_NONE = Processors()
