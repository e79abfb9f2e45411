"""A head's distribution reshaped on request: restricted vocabularies, logit bias and sampling.

Everything here is numpy on small arrays; the data plane (``service.plane.distribution``)
decides which rows of W and which graph outputs to fetch. Three facts keep it exact without a
(rows x vocab) tensor on the host:

* **Candidate logits** are ``h @ W[ids].T`` with the head's transforms (``CandidateLogits``):
  the same numbers the graph computes for those tokens, at the cost of n rows instead of vocab.
* **Bias** on a set B of tokens leaves every other logit alone, so the biased top-k lies within
  the unbiased top-(k + |B|) plus B itself (``biased_topk``), and the biased log-sum-exp is
  the full one with B's terms swapped (``swap_lse``). When B held almost all the mass the swap
  cancels; such rows are flagged and recomputed from full logits.
* **Sampling** draws one uniform u per row from a counter-based generator keyed by the seed,
  so u depends on (seed, row position) alone, and inverts the CDF of the kept tokens in
  descending order (``sample_sorted``). Any prefix of that order that holds the kept set gives
  the same token as the whole vocabulary; a row whose kept set may reach past the fetched
  prefix is flagged and recomputed from full logits with the same u. Filters follow Hugging
  Face's order: ``top_k``, then ``top_p`` on the renormalised remainder, then ``min_p``
  relative to the most likely token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import numpy.typing as npt

from service.errors import InvalidInput, LogitsOverflow
from service.runtime.gemm import matmul_transposed, top_of_product
from service.runtime.logmath import logsumexp
from service.runtime.processors import Processors

if TYPE_CHECKING:  # onnx stays out of the processes that only name the type (the fronts)
    from service.runtime.rows import RowSource

Floats = npt.NDArray[np.float32]
Ids = npt.NDArray[np.int64]
#: How far B's logits from their rows of W may sit from the graph's own (relative; float32
#: products by two kernels, on two devices); it bounds what the swap below may trust.
LOGIT_RTOL = 1e-5
#: The swapped log-sum-exp is trusted when its error bound is below this (absolute).
LSE_TOLERANCE = 1e-4
#: Which distribution log-probs are over: the allowed tokens only, or the whole vocabulary.
Over = Literal["candidates", "vocabulary"]
OVERS: dict[str, Over] = {"candidates": "candidates", "vocabulary": "vocabulary"}


@dataclass(frozen=True)
class TokenSpace:
    """The token ids a request names and an answer returns, against the head's own columns.

    A head trimmed to part of a vocabulary (``service.tools.trim``) keeps ``kept`` (column ->
    original id, ascending, so lower ids still win ties); everything inside the service works
    in columns, and ids cross this map once on the way in and once on the way out.
    """

    size: int
    """Ids a request may name: [0, size)."""
    kept: Ids | None = None

    def local(self, ids: Ids, field: str) -> Ids:
        """Columns of already range-checked original ids; 422 for an id that was trimmed."""
        if self.kept is None:
            return ids
        position = np.searchsorted(self.kept, ids)
        found = self.kept[np.minimum(position, len(self.kept) - 1)] == ids
        if not found.all():
            missing = int(np.asarray(ids)[~found].reshape(-1)[0])
            raise InvalidInput(
                f"{field}: token {missing} is not in this trimmed head's vocabulary "
                f"({len(self.kept)} of {self.size} tokens kept)"
            )
        return position.astype(np.int64)

    def original(self, columns: Ids) -> Ids:
        return columns if self.kept is None else self.kept[columns]

    def same_tokens(self, other: TokenSpace) -> bool:
        """Whether each column is the same token in both (two heads may then be compared)."""
        if self.kept is None or other.kept is None:
            return self.kept is None and other.kept is None and self.size == other.size
        return self.size == other.size and bool(np.array_equal(self.kept, other.kept))


#: Rows of W copied for per-row products of chosen ids, at most (``CandidateLogits``).
PER_ROW_BYTES = 32 * 2**20
#: Rows of W copied at once: below glibc's mmap threshold (``allocator.settle_allocator``
#: fixes it at 1 MiB), so each copy reuses heap pages; a 4 MB copy is a fresh mapping,
#: faulted in each time (0.95 ms against 0.10).
CHUNK_BYTES = 960 * 2**10


@dataclass(frozen=True)
class CandidateLogits:
    """Logits of chosen tokens from their rows of W: what the graph gives for those columns.

    ``input_scale`` multiplies the hidden state, the bias is added, ``logit_scale`` multiplies
    and ``softcap`` caps the logits, then the temperature divides them (``service.heads.graph``).
    """

    rows: RowSource
    input_scale: float = 1.0
    logit_scale: float = 1.0
    softcap: float | None = None
    bias: Floats | None = None

    @property
    def plain(self) -> bool:
        """No transform after the product: its top-k can be taken in the product's own run."""
        return self.bias is None and self.logit_scale == 1.0 and self.softcap is None

    def top(
        self, hidden: Floats, ids: Ids, temperature: Floats, k: int
    ) -> tuple[Floats, Ids, Floats]:
        """Top-k (values, ids) and log-sum-exp of the logits of ``ids`` (one list for every
        row, ascending, so TopK's column order is id order on ties) of a ``plain`` head."""
        scaled = hidden * np.float32(self.input_scale)
        step = max(k, CHUNK_BYTES // (scaled.shape[1] * 4))
        if len(ids) <= step:
            values, columns, lse = top_of_product(scaled, self.rows.rows(ids), temperature, k)
            return values, ids[columns], lse
        # a chunk of W's rows at a time (each copy below the mmap threshold), then the
        # chunks' tops merged (a stable sort: equal values stay in id order) and their
        # log-sum-exps added
        tops, found, sums = [], [], []
        for at in range(0, len(ids), step):
            part = ids[at : at + step]
            top, columns, lse = top_of_product(
                scaled, self.rows.rows(part), temperature, min(k, len(part))
            )
            tops.append(top)
            found.append(part[columns])
            sums.append(lse.astype(np.float64))
        values, chosen = np.concatenate(tops, axis=1), np.concatenate(found, axis=1)
        order = np.argsort(-values, axis=1, kind="stable")[:, :k]
        merged = np.logaddexp.reduce(np.stack(sums), axis=0).astype(np.float32)
        picked: Ids = np.take_along_axis(chosen, order, axis=1)
        return np.take_along_axis(values, order, axis=1), picked, merged

    def _per_row(self, scaled: Floats, ids: Ids, union: int | None) -> Floats:
        """(rows, n) products for ids given per row: each id's row of W once and one product
        with every row, where the rows share their ids; where they share few (a grammar's
        masks at different points), each row with its own ids' rows (rows x n dot products,
        not rows x union), while those rows' copy stays small. ``union``: how many distinct
        ids there are, when the caller knows."""
        own_bytes = ids.size * scaled.shape[1] * 4
        unique = inverse = None
        if union is None:
            unique, inverse = np.unique(ids, return_inverse=True)
            union = len(unique)
        if len(ids) * union > 2 * ids.size and own_bytes <= PER_ROW_BYTES:
            return self._own_products(scaled, ids)
        if unique is None or inverse is None:
            unique, inverse = np.unique(ids, return_inverse=True)
        step = max(1, CHUNK_BYTES // (scaled.shape[1] * 4))
        raw = np.concatenate(  # rows x unique, a chunk of W's rows at a time
            [
                matmul_transposed(scaled, self.rows.rows(unique[at : at + step]))
                for at in range(0, len(unique), step)
            ],
            axis=1,
        )
        return np.take_along_axis(raw, inverse.reshape(ids.shape), axis=1)

    def _own_products(self, scaled: Floats, ids: Ids) -> Floats:
        """Each row's dot products with its own ids' rows of W, a few rows at a time."""
        products = np.empty(ids.shape, np.float32)
        step = max(1, CHUNK_BYTES // (ids.shape[1] * scaled.shape[1] * 4))
        for at in range(0, len(ids), step):
            part = ids[at : at + step]
            own = self.rows.rows(part.reshape(-1)).reshape(*part.shape, -1)
            products[at : at + step] = np.matmul(own, scaled[at : at + step, :, None])[..., 0]
        return products

    def __call__(
        self, hidden: Floats, ids: Ids, temperature: Floats, union: int | None = None
    ) -> Floats:
        """(rows, n) logits for ids shared by every row (n,) or given per row (rows, n)
        (``union``: how many distinct ids those are, when the caller knows)."""
        scaled = hidden * np.float32(self.input_scale)
        if ids.ndim == 1:  # every row the same ids: their rows in that order, one product
            logits = matmul_transposed(scaled, self.rows.rows(ids))
        else:
            logits = self._per_row(scaled, ids, union)
        if self.bias is not None:
            logits = logits + self.bias[ids]
        if self.logit_scale != 1.0:
            logits = logits * np.float32(self.logit_scale)
        if self.softcap is not None:
            cap = np.float32(self.softcap)
            logits = np.tanh(logits / cap) * cap
        if (temperature != 1.0).any():
            logits = logits / temperature[:, None]
        return np.ascontiguousarray(logits, dtype=np.float32)


@dataclass(frozen=True)
class Bias:
    """Additive bias per token id (sorted ids); banned tokens carry -inf."""

    ids: Ids
    values: Floats

    @classmethod
    def of(cls, bias: dict[int, float] | None, banned: Ids | None) -> Bias | None:
        table = dict(bias or {})
        for token in [] if banned is None else banned.reshape(-1).tolist():
            table[int(token)] = -np.inf
        if not table:
            return None
        ids = np.array(sorted(table), np.int64)
        return cls(ids, np.array([table[token] for token in ids.tolist()], np.float32))

    def at(self, temperature: float) -> Bias:
        """This bias on logits divided by ``temperature`` ((z + b) / T = z / T + b / T), so a
        bias weighs the same at every temperature and temperature never reorders tokens."""
        return Bias(self.ids, (self.values / np.float32(temperature)).astype(np.float32))

    @property
    def banned(self) -> int:
        return int(np.isneginf(self.values).sum())


def refuse_overflow(
    ceiling: npt.NDArray[np.floating],
    *floors: npt.NDArray[np.floating],
    temperature: float = 1.0,
) -> None:
    """Raise ``LogitsOverflow`` unless a run's outputs are all finite. Finite hidden states
    can still make logits past float32's range (1e36 times a unit row of W): Inf logits, then
    NaN log-probs and KL, sent as JSON null. Each array is (rows, ...); ``ceiling`` bounds
    every output of its row from above (the log-sum-exp bounds every logit), so its largest
    value and the others' smallest being finite makes them all finite: a few reductions per
    answer, not a mask."""
    spread = float(ceiling.max())
    for floor in floors:
        spread -= float(floor.min())  # NaN and Inf carry through
    if math.isfinite(spread):
        return
    finite = np.isfinite(ceiling.reshape(len(ceiling), -1)).all(axis=1)
    for floor in floors:
        finite &= np.isfinite(floor.reshape(len(floor), -1)).all(axis=1)
    at = "" if temperature == 1.0 else f" at temperature {temperature:g}"
    raise LogitsOverflow(
        f"hidden_states row {int(np.argmin(finite))} makes logits overflow{at} (|logit| past "
        "float32's 3.4e38, or float16's 65504 for a half-precision head on a GPU); send final, "
        "post-norm hidden states"
    )


def top_sorted(logits: Floats, ids: Ids, k: int) -> tuple[Floats, Ids]:
    """The k largest of (rows, n) logits, descending, with their ids ((n,) or (rows, n));
    equal logits in id order, as the graph's TopK gives them (not in column order: a biased
    token, or an allowed list's order, must not decide a tie).

    For k < n the k are found by partition first and only they are sorted: a full sort of
    64 rows x 1,000 allowed tokens took ~4.8 ms, as long as the demo head's whole run. A row
    whose k-th value is tied beyond the k (which of the equal ones is in depends on ids) is
    sorted whole."""
    every = np.broadcast_to(ids, logits.shape) if ids.ndim == 1 else ids
    n = logits.shape[1]
    k = min(k, n)
    if k >= n or k * 4 > n:
        return _sorted_by_logit_then_id(logits, every, k)
    chosen = np.argpartition(logits, n - k, axis=1)[:, n - k :]  # the k largest, unordered
    values = np.take_along_axis(logits, chosen, axis=1)
    picked = np.take_along_axis(every, chosen, axis=1)
    kth = values.min(axis=1, keepdims=True)
    boundary_ties = np.count_nonzero(logits >= kth, axis=1) > k
    values, picked = _sorted_by_logit_then_id(values, picked, k)
    for row in np.flatnonzero(boundary_ties).tolist():
        whole = _sorted_by_logit_then_id(logits[row : row + 1], every[row : row + 1], k)
        values[row], picked[row] = whole[0][0], whole[1][0]
    return values, picked


def _sorted_by_logit_then_id(logits: Floats, ids: Ids, k: int) -> tuple[Floats, Ids]:
    order = np.lexsort((ids, -logits), axis=1)[:, :k]
    return np.take_along_axis(logits, order, axis=1), np.take_along_axis(ids, order, axis=1)


def biased_topk(values: Floats, ids: Ids, raw_b: Floats, bias: Bias, k: int) -> tuple[Floats, Ids]:
    """Top-k of biased logits from the unbiased top-(k + |B|) (``values``/``ids``, rows x K)
    and the exact unbiased logits of B (``raw_b``, rows x |B|)."""
    masked = np.where(np.isin(ids, bias.ids), -np.inf, values).astype(np.float32)
    biased = (raw_b + bias.values).astype(np.float32)
    every = np.concatenate([ids, np.broadcast_to(bias.ids, raw_b.shape)], axis=1)
    return top_sorted(np.concatenate([masked, biased], axis=1), every, k)


def swap_lse(lse: Floats, raw_b: Floats, bias: Bias) -> tuple[Floats, npt.NDArray[np.bool_]]:
    """The log-sum-exp with B's terms biased, and which rows to trust: B's share of the mass
    is computed from logits that may differ from the graph's by ``LOGIT_RTOL`` of the row's
    scale, an error the subtraction from 1 keeps while the true remainder may be far smaller
    (a row whose mass all sat in B, at large logits, measured on CUDA). A row whose bound on
    the swapped value passes ``LSE_TOLERANCE`` is recomputed from full logits.

    B's biased terms are summed in log space: a bias of +100 at temperature 0.1 is e^1000 of
    the unbiased mass, past float64 (whose exp ends at e^709)."""
    shifted = raw_b.astype(np.float64) - lse.astype(np.float64)[:, None]
    share = np.exp(shifted).sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        outside = np.log(np.maximum(1.0 - share, 0.0))
        total = np.logaddexp(outside, logsumexp(shifted + bias.values.astype(np.float64)))
        swapped = lse + total
        error = share * LOGIT_RTOL * np.maximum(1.0, np.abs(lse)) * np.exp(-total)
    return swapped.astype(np.float32), error < LSE_TOLERANCE


def apply_bias(logits: Floats, ids: Ids | None, bias: Bias) -> Floats:
    """Full or candidate logits with B's bias added (``ids``: the columns' token ids, None for
    the full vocabulary)."""
    out: Floats = logits.copy()
    if ids is None:
        out[:, bias.ids] += bias.values
        return out
    every = np.broadcast_to(ids, logits.shape)
    position = np.searchsorted(bias.ids, every)  # bias.ids are sorted (``Bias.of``)
    found = bias.ids[np.minimum(position, len(bias.ids) - 1)] == every
    out += np.where(found, bias.values[np.minimum(position, len(bias.ids) - 1)], 0.0)
    return out


@dataclass(frozen=True)
class SampleSpec:
    """How to draw tokens; ``temperature`` 0 means greedy. One per row, or ``n`` per row
    (``sample.n``, given: the answer has an axis of draws; ``service.runtime.filters``)."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int = 0
    n: int | None = None

    @property
    def draws(self) -> int:
        return 1 if self.n is None else self.n

    def uniforms(self, rows: int) -> npt.NDArray[np.float64]:
        """One u per row: Philox keyed by the seed, so row i draws the same u whatever else
        is in the batch or the request."""
        return np.random.Generator(np.random.Philox(key=self.seed)).random(rows)


def sample_sorted(
    values: Floats, lse: Floats, spec: SampleSpec, u: npt.NDArray[np.float64], vocab: int
) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.bool_]]:
    """Index into each row of descending ``values`` (rows x K, a prefix of the row's sorted
    logits, ``lse`` the row's whole log-sum-exp) of the drawn token, and whether the kept set
    surely lies within the prefix (else recompute the row with the whole sorted row). With
    ``top_k``, the prefix holds the k tokens or the whole row (``top_p`` after ``top_k`` is
    taken on the k's mass, which a shorter prefix does not know): the callers fetch that many."""
    width = values.shape[1]
    if spec.temperature == 0:
        return np.zeros(len(values), np.intp), np.ones(len(values), np.bool_)
    probs = np.exp(values.astype(np.float64) - lse.astype(np.float64)[:, None])
    kept = np.ones_like(probs, dtype=np.bool_)
    inside = np.full(len(values), width >= vocab)
    if spec.top_k is not None:
        kept[:, spec.top_k :] = False
        inside |= spec.top_k <= width
    mass = np.where(kept, probs, 0.0)
    if spec.top_p is not None:
        total = mass.sum(axis=1, keepdims=True) if spec.top_k is not None else 1.0
        cumulative = np.cumsum(mass, axis=1) / total
        kept &= (cumulative - mass / total) < spec.top_p
        inside |= cumulative[:, -1] >= spec.top_p
    if spec.min_p is not None:
        kept &= probs >= spec.min_p * probs[:, :1]
        inside |= probs[:, -1] < spec.min_p * probs[:, 0]
    mass = np.where(kept, probs, 0.0)
    cumulative = np.cumsum(mass, axis=1)
    if spec.top_k is None and spec.top_p is None and spec.min_p is None:
        inside |= u < cumulative[:, -1]  # the draw lands in the prefix; the tail is not needed
        target = u
    else:
        target = u * cumulative[:, -1]
    index = np.minimum((cumulative <= target[:, None]).sum(axis=1), width - 1)
    last_kept = width - 1 - np.argmax(kept[:, ::-1], axis=1)  # u at the very top, rounded
    index = np.where(kept[np.arange(len(values)), index], index, last_kept)
    return index.astype(np.intp), inside


@dataclass(frozen=True)
class Shape:
    """The distribution a request asks for, checked (``service.plane.options`` builds it):
    allowed columns, bias and bans, which distribution log-probs are over, and sampling;
    ``processors``: the decoding step's (penalties, stop rules, a bitmask, ...), which need
    each row whole (``service.plane.decoding``)."""

    allowed: Ids | None = None
    """(n,) for every row or (rows, n) per row; sorted by nothing."""
    bias: Bias | None = None
    over: Over = "vocabulary"
    sample: SampleSpec | None = None
    processors: Processors | None = None
