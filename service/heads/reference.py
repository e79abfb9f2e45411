"""Reference math for language-model heads, in plain numpy.

Every number the service returns is checked against these functions in the tests, so they
favour clarity and exactness over speed. They are the tests' oracle only: the service computes
with ``service.runtime.logmath`` and never imports this module (a serving path that shared
the oracle's code would pass the tests whatever that code got wrong); ``service`` re-exports
the two projections as the documented reference API. The numerics contract lives here:

* projection: ``logits = hidden_states @ matrix.T`` with ``matrix`` shaped (vocab_size, d_model);
* top-k: values sorted descending, ties broken toward the lower token id, k clamped to the vocab;
* log-softmax: ``logits - logsumexp(logits)``, computed stably (max subtracted) in float64.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.floating]
IntArray = npt.NDArray[np.int64]


def output_projection_tied(
    hidden_states: npt.ArrayLike, embedding_table: npt.NDArray[np.floating]
) -> FloatArray:
    """Project hidden states onto the vocabulary through the input embedding table itself.

    A tied model has one matrix for both roles, so this reads ``embedding_table`` directly: no
    copy and no cached transpose (``.T`` is a view). A change made to the table in place, as a
    training step would make, shows in the very next call.
    """
    hidden = _check_operands(hidden_states, embedding_table, "embedding_table")
    return hidden @ embedding_table.T


def output_projection_untied(
    hidden_states: npt.ArrayLike, output_weight: npt.NDArray[np.floating]
) -> FloatArray:
    """Project hidden states through an output matrix of its own (``lm_head``).

    The weight is independent of any input embedding table: the caller owns two matrices and
    changing one has no effect on the other.
    """
    hidden = _check_operands(hidden_states, output_weight, "output_weight")
    return hidden @ output_weight.T


def _check_operands(
    hidden_states: npt.ArrayLike, matrix: npt.NDArray[np.floating], matrix_name: str
) -> FloatArray:
    """Validate shapes and dtypes and say exactly what is wrong when they do not fit."""
    if not isinstance(matrix, np.ndarray):
        raise ValueError(f"{matrix_name} must be a numpy array, got {type(matrix).__name__}")
    if matrix.ndim != 2:
        raise ValueError(
            f"{matrix_name} must be 2-D (vocab_size, d_model), got shape {matrix.shape}"
        )
    if matrix.size == 0:
        raise ValueError(f"{matrix_name} is empty: shape {matrix.shape}")
    if not np.issubdtype(matrix.dtype, np.floating):
        raise ValueError(f"{matrix_name} must have a floating dtype, got {matrix.dtype}")
    hidden = np.asarray(hidden_states)
    if not np.issubdtype(hidden.dtype, np.floating):
        raise ValueError(f"hidden_states must have a floating dtype, got {hidden.dtype}")
    if hidden.ndim == 0 or hidden.size == 0:
        raise ValueError(f"hidden_states is empty: shape {hidden.shape}, expected (..., d_model)")
    if hidden.shape[-1] != matrix.shape[1]:
        raise ValueError(
            f"d_model mismatch: hidden_states has last dimension {hidden.shape[-1]} but "
            f"{matrix_name} has d_model {matrix.shape[1]} (shape {matrix.shape})"
        )
    return hidden


def top_k(logits: npt.ArrayLike, k: int) -> tuple[FloatArray, IntArray]:
    """Return the k largest logits per row and their token ids, along the last axis.

    Values are sorted descending; equal values keep the lower token id first (a stable sort
    of the negated values); k is clamped to the vocabulary size.
    """
    scores = np.asarray(logits)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    k = min(k, scores.shape[-1])
    order = np.argsort(-scores, axis=-1, kind="stable")[..., :k].astype(np.int64)
    return np.take_along_axis(scores, order, axis=-1), order


def logsumexp(logits: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """Stable log-sum-exp over the last axis, in float64."""
    scores = np.asarray(logits, dtype=np.float64)
    peak = scores.max(axis=-1, keepdims=True)
    total: npt.NDArray[np.float64] = np.log(np.exp(scores - peak).sum(axis=-1)) + peak[..., 0]
    return total


def log_softmax(logits: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """Log-probabilities over the last axis: ``logits - logsumexp(logits)``, in float64."""
    scores = np.asarray(logits, dtype=np.float64)
    return scores - logsumexp(scores)[..., None]


# -- the decoding step: processors, filters, draws (tests' oracle of ``runtime.processors``) --
#
# One row at a time, in float64, as the engines define each step (the sources are named in
# ``docs/decoding.md``). The order, for both ``processor_order`` values:
#
# 1. masks: allowed ids, banned ids, the grammar bitmask, bad words, min_tokens' stop ids
#    (-inf: they commute with everything after);
# 2. logit_bias, then the repetition penalty (prompt and output tokens), then frequency and
#    presence penalties (output tokens): bias before penalties, as in vLLM v1;
# 3. temperature divides;
# 4. filters: ``transformers`` top_k, top_p, min_p; ``vllm`` min_p, top_k, top_p.
#
# ``raw`` log-probs are those of step 3 (every processor and the temperature, no filter),
# ``processed`` those of step 4 (filtered tokens at -inf, the rest renormalized).

ORDERS = ("transformers", "vllm")


def repetition_penalized(
    logits: npt.ArrayLike, seen: list[list[int]], penalty: float
) -> npt.NDArray[np.float64]:
    """CTRL's repetition penalty (vLLM, transformers): each token a row has seen (prompt or
    output, counted once) has a positive logit divided by ``penalty``, a negative one
    multiplied by it."""
    out = np.array(logits, dtype=np.float64)
    for row, tokens in enumerate(seen):
        for token in set(tokens):
            value = out[row, token]
            out[row, token] = value / penalty if value > 0 else value * penalty
    return out


def presence_frequency_penalized(
    logits: npt.ArrayLike, outputs: list[list[int]], presence: float, frequency: float
) -> npt.NDArray[np.float64]:
    """OpenAI's penalties (vLLM): ``logit - frequency * count - presence * (count > 0)``,
    ``count`` a token's occurrences in the row's output (never its prompt)."""
    out = np.array(logits, dtype=np.float64)
    for row, tokens in enumerate(outputs):
        for token in set(tokens):
            out[row, token] -= frequency * tokens.count(token) + presence
    return out


def min_tokens_banned(
    logits: npt.ArrayLike, outputs: list[list[int]], min_tokens: int, stop_ids: list[int]
) -> npt.NDArray[np.float64]:
    """Every stop id at -inf in a row whose output is shorter than ``min_tokens``."""
    out = np.array(logits, dtype=np.float64)
    for row, tokens in enumerate(outputs):
        if len(tokens) < min_tokens:
            out[row, stop_ids] = -np.inf
    return out


def bad_words_banned(
    logits: npt.ArrayLike, outputs: list[list[int]], bad_words: list[list[int]]
) -> npt.NDArray[np.float64]:
    """vLLM's bad words: a sequence's last token at -inf where the row's output ends with the
    sequence's other tokens (a one-token sequence: always)."""
    out = np.array(logits, dtype=np.float64)
    for row, tokens in enumerate(outputs):
        for word in bad_words:
            *prefix, last = word
            if not prefix or tokens[len(tokens) - len(prefix) :] == prefix:
                out[row, last] = -np.inf
    return out


def bitmask_allows(bitmask: npt.ArrayLike, vocab_size: int) -> npt.NDArray[np.bool_]:
    """Which tokens an int32 (rows, ceil(vocab / 32)) bitmask allows, as xgrammar, llguidance
    and outlines-core write it: token j is bit j % 32 of word j // 32 (least significant bit
    first), 1 = allowed."""
    words = np.asarray(bitmask).astype(np.int64) & 0xFFFFFFFF
    tokens = np.arange(vocab_size)
    return ((words[:, tokens // 32] >> (tokens % 32)) & 1).astype(np.bool_)


def bitmask_of(allowed: npt.ArrayLike) -> npt.NDArray[np.int32]:
    """The int32 bitmask of (rows, vocab) booleans (``bitmask_allows``' inverse)."""
    flags = np.asarray(allowed, dtype=np.bool_)
    width = -(-flags.shape[1] // 32)
    words = np.zeros((flags.shape[0], width), np.int64)
    for token in range(flags.shape[1]):
        words[:, token // 32] |= flags[:, token].astype(np.int64) << (token % 32)
    return np.where(words >= 2**31, words - 2**32, words).astype(np.int32)


def filtered(
    logits: npt.ArrayLike,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    order: str = "transformers",
) -> npt.NDArray[np.float64]:
    """Logits (already divided by the temperature) with the tokens the filters drop at -inf.

    Each filter keeps a prefix of the row sorted by value, descending, equal values in id
    order: ``top_k`` its k first; ``top_p`` the tokens whose mass before them, among the
    tokens still kept and renormalized, is below p; ``min_p`` the tokens of probability at
    least ``min_p`` times the most likely one's. ``order``: ``transformers`` applies top_k,
    top_p, min_p; ``vllm`` min_p, top_k, top_p."""
    out = np.array(logits, dtype=np.float64)
    steps = {"transformers": ("top_k", "top_p", "min_p"), "vllm": ("min_p", "top_k", "top_p")}
    for row in range(out.shape[0]):
        ranked = np.lexsort((np.arange(out.shape[1]), -out[row]))
        keep = np.isfinite(out[row, ranked])
        for step in steps[order]:
            probs = np.where(keep, np.exp(out[row, ranked] - out[row, ranked[0]]), 0.0)
            probs /= probs.sum()
            if step == "top_k" and top_k is not None:
                keep[top_k:] = False
            elif step == "top_p" and top_p is not None:
                before = np.concatenate([[0.0], np.cumsum(probs)[:-1]])
                keep &= before < top_p
            elif step == "min_p" and min_p is not None:
                keep &= probs >= min_p * probs[0]
        out[row, ranked[~keep]] = -np.inf
    return out


def decoding_step(
    logits: npt.ArrayLike,
    *,
    temperature: float = 1.0,
    allowed: list[list[int]] | None = None,
    bias: dict[int, float] | None = None,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    repetition: float = 1.0,
    presence: float = 0.0,
    frequency: float = 0.0,
    min_tokens: int = 0,
    stop_ids: list[int] | None = None,
    bad_words: list[list[int]] | None = None,
    bitmask: npt.ArrayLike | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    order: str = "transformers",
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """The raw and processed log-probs of one decoding step, (rows, vocab), in the order the
    block above gives. ``allowed``: a list per row; ``bitmask``: one row for every row, or
    one per row; ``bias`` may hold -inf (banned ids)."""
    out = np.array(logits, dtype=np.float64)
    rows, vocab = out.shape
    lists = outputs if outputs is not None else [[] for _ in range(rows)]
    if allowed is not None:
        for row, tokens in enumerate(allowed):
            kept = np.zeros(vocab, np.bool_)
            kept[tokens] = True
            out[row, ~kept] = -np.inf
    if bitmask is not None:
        allows = bitmask_allows(np.atleast_2d(bitmask), vocab)
        out[~np.broadcast_to(allows, out.shape)] = -np.inf
    out = bad_words_banned(out, lists, bad_words or [])
    out = min_tokens_banned(out, lists, min_tokens, stop_ids or [])
    for token, value in (bias or {}).items():
        out[:, token] += value
    seen = [(prompts[row] if prompts else []) + lists[row] for row in range(rows)]
    out = repetition_penalized(out, seen, repetition)
    out = presence_frequency_penalized(out, lists, presence, frequency) / temperature
    return log_softmax(out), log_softmax(filtered(out, top_k, top_p, min_p, order))


def draw(logprobs: npt.ArrayLike, u: float) -> int:
    """The token a uniform ``u`` draws from one row of log-probs: the inverse of the CDF in
    the row's sorted order (values descending, equal ones in id order), so the same u draws
    the same token from any prefix that holds the kept tokens."""
    row = np.asarray(logprobs, dtype=np.float64)
    ranked = np.lexsort((np.arange(len(row)), -row))
    cumulative = np.cumsum(np.exp(row[ranked]))
    index = min(int(np.count_nonzero(cumulative <= u)), len(row) - 1)
    while not np.isfinite(row[ranked[index]]):  # u at the very top, rounded: the last kept
        index -= 1
    return int(ranked[index])
