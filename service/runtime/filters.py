"""The sampling filters and draws of a decoding step, over each row's sorted prefix.

A run's processed logits come back from ``selection`` as each row's top ``width`` values in
order (descending, equal ones in id order) and the row's log-sum-exp. Every filter keeps a
prefix of that order, so the prefix is enough whenever the kept set provably ends inside it:

* ``top_k``: the first k (inside when k <= width);
* ``min_p``: probabilities at least ``min_p`` times the top one (inside when the prefix's last
  is already below);
* ``top_p``: the tokens whose mass before them, among those still kept and renormalized, is
  below p (inside when the prefix's kept mass reaches p; its total must be known: the whole
  distribution's, 1, before any other filter, or the kept set's, once it lies in the prefix).

``transformers`` applies top_k, top_p, min_p; ``vllm`` min_p, top_k, top_p. A row whose kept
set may reach past the prefix is ``known`` false: the caller sorts its whole row and asks
again (``service.runtime.step``). Without a filter nothing needs to be kept: the draw lands in
the prefix or the row is sorted whole.

Draws: ``n`` per row, draw j of row i the i-th value of stream j of the seed (Philox keyed by
the seed, jumped j times: stream 0 is ``SampleSpec.uniforms``), so a draw depends on (seed,
row, j) alone, never on the batch or the other draws; each inverts the CDF of the kept tokens
in the prefix's order (``service.heads.reference.draw``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from service.runtime.processors import Order
from service.runtime.vocabulary import SampleSpec

Floats = npt.NDArray[np.float32]
Doubles = npt.NDArray[np.float64]
Flags = npt.NDArray[np.bool_]
Indexes = npt.NDArray[np.intp]
STEPS: dict[Order, tuple[str, ...]] = {
    "transformers": ("top_k", "top_p", "min_p"),
    "vllm": ("min_p", "top_k", "top_p"),
}
#: Rows of a search are told apart by this offset (cumulative masses stay below 1 + rounding).
ROW_SPACING = 4.0


@dataclass(frozen=True)
class Kept:
    """What the filters keep of each row's prefix: the prefix's probabilities, ``keep``
    (rows, width), whether the kept set lies in the prefix (``known``; false: sort the whole
    row), the kept tokens' share of the row's probability (``mass``: the processed
    log-sum-exp is ``lse + log(mass)``), and whether any filter ran (``filtered``; none: the
    processed distribution is the raw one, ``mass`` 1, and ``known`` says whether the prefix
    holds every token)."""

    probs: Doubles
    keep: Flags
    known: Flags
    mass: Doubles
    filtered: bool


def filtered_prefix(
    values: Floats, lse: Floats, spec: SampleSpec | None, order: Order, vocab: int
) -> Kept:
    """The filters of ``spec`` (in ``order``) over rows' sorted prefixes: ``values``
    (rows, width) of a distribution over ``vocab`` tokens whose log-sum-exp is ``lse``."""
    width = values.shape[1]
    probs = np.exp(values.astype(np.float64) - lse.astype(np.float64)[:, None])
    keep = np.isfinite(values)
    known = ~keep[:, -1] | (width >= vocab)  # the prefix holds every token with mass
    ran = False
    lost = np.zeros(len(values), np.bool_)  # a step could not be taken from the prefix
    for step in STEPS[order] if spec is not None else ():
        assert spec is not None
        if step == "top_k" and spec.top_k is not None:
            keep[:, spec.top_k :] = False
            known |= spec.top_k <= width
        elif step == "min_p" and spec.min_p is not None:
            floor = spec.min_p * probs[:, 0]
            keep &= probs >= floor[:, None]
            known |= probs[:, -1] < floor
        elif step == "top_p" and spec.top_p is not None:
            mass = np.where(keep, probs, 0.0)
            if ran:  # the kept set's total is the prefix's only where the set lies in it
                lost |= ~known
            total = np.where(known, mass.sum(axis=1), np.nan if ran else 1.0)
            cumulative = np.cumsum(mass, axis=1) / total[:, None]
            with np.errstate(invalid="ignore"):
                keep &= (cumulative - mass / total[:, None]) < spec.top_p
                known |= cumulative[:, -1] >= spec.top_p
        else:
            continue
        ran = True
    if not ran:  # the processed distribution is the raw one, all of it
        return Kept(probs, keep, known, np.ones(len(values)), False)
    return Kept(probs, keep, known & ~lost, np.where(keep, probs, 0.0).sum(axis=1), True)


def streams(spec: SampleSpec, rows: int) -> Doubles:
    """(rows, n) uniforms: column j is stream j of the seed, row i its i-th value."""
    generator = np.random.Philox(key=spec.seed)
    draws = range(spec.draws)
    columns = [np.random.Generator(generator.jumped(j)).random(rows) for j in draws]
    return np.stack(columns, axis=1)


def drawn(kept: Kept, spec: SampleSpec, u: Doubles) -> tuple[Indexes, Flags]:
    """Each draw's index in its row's prefix (rows, n), and whether every draw of the row
    surely lies in the prefix (else sort the row whole and draw again, with the same u)."""
    rows, width = kept.keep.shape
    if spec.temperature == 0:  # greedy: the top token, whatever u
        return np.zeros(u.shape, np.intp), np.ones(rows, np.bool_)
    mass = np.where(kept.keep, kept.probs, 0.0)
    cumulative = np.cumsum(mass, axis=1)
    target = u * kept.mass[:, None]  # the kept set's own CDF (renormalized)
    spacing = ROW_SPACING * np.arange(rows)[:, None]
    index = np.searchsorted((cumulative + spacing).reshape(-1), target + spacing, side="right")
    index = np.minimum(index - np.arange(rows)[:, None] * width, width - 1)
    last_kept = width - 1 - np.argmax(kept.keep[:, ::-1], axis=1)  # u at the very top
    index = np.where(np.take_along_axis(kept.keep, index, axis=1), index, last_kept[:, None])
    inside = kept.known.copy()
    if not kept.filtered:  # nothing kept beyond the prefix's tokens: the draws must land in it
        inside |= (u < cumulative[:, -1:]).all(axis=1)
    return index.astype(np.intp), inside
