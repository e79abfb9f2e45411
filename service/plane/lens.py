"""Residual states and the logit lens on the data plane.

``final_states`` turns a request's residual rows into what the model's last layer hands its
head (the head's own final norm, ``HeadSession.normalize``), before anything else reads them:
top-k, allowed tokens, scoring and comparing then see final states, whatever path they take.

``read_lens`` reads every layer through the head in runs of a few positions at every layer
(``service.runtime.layer_runs``), each run as many rows as a top-k run of the version, and at
least every layer of one position (``costs.lens_run_rows``: a request whose run would pass
``LMHEAD_MAX_LOGITS_BYTES`` is refused before it starts): memory stays one run's whatever the
layers and tokens, and the runs go through the inference
executor one at a time, so other requests run in between. The matmul of a run costs what a
top-k run's does; the lens adds the full logits' fetch and one pass over them for the
entropies and KLs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from service.messages import LensResult
from service.plane.costs import lens_run_rows
from service.plane.lens_options import CheckedLens
from service.repository.loaded_version import LoadedVersion
from service.runtime.layer_runs import LensPart, lens_run
from service.runtime.vocabulary import Floats

T = TypeVar("T", bound=np.generic)


async def final_states(model: LoadedVersion, hidden: Floats, residual: bool) -> Floats:
    """``hidden`` (..., d_model) through the head's final norm when ``residual`` (checked by
    ``lens_options.residual``), in runs of the version's batch size; else as it is."""
    if not residual:
        return hidden
    rows = hidden.reshape(-1, model.d_model)
    step = model.rows_per_run
    normed = np.empty_like(rows)
    for start in range(0, len(rows), step):
        part = rows[start : start + step]
        normed[start : start + step] = await model.run_alone(
            len(part), model.session.normalize, part
        )
    return normed.reshape(hidden.shape)


async def read_lens(model: LoadedVersion, checked: CheckedLens, tokens: bool) -> LensResult:
    """Every layer's top-k, entropy, KL to the last layer and targets' log-probs and ranks."""
    states, k = checked.states, checked.k
    layers, positions, _ = states.shape
    step = lens_run_rows(model, layers) // layers  # positions per run, every layer of each
    parts: list[LensPart] = []
    for start in range(0, positions, step):
        chunk = slice(start, start + step)
        targets = None if checked.targets is None else checked.targets[chunk]
        part = await model.run_alone(
            layers * len(range(*chunk.indices(positions))),
            lens_run,
            model.session,
            states[:, chunk],
            checked.residual,
            k,
            targets,
        )
        parts.append(part)
    ids = np.concatenate([part.token_ids for part in parts], axis=1)
    result = LensResult(
        model.info,
        model.space.original(ids),
        _joined([part.logprobs for part in parts]),
        _joined([part.entropy for part in parts]),
        _joined([part.kl_to_last for part in parts]),
    )
    if checked.targets is not None:
        result = replace(
            result,
            target_ids=model.space.original(checked.targets),
            target_logprobs=_joined([part.target_logprobs for part in parts]),
            target_ranks=_joined([part.target_ranks for part in parts]),
        )
    if tokens:
        result = replace(result, tokens=model.tokens(ids.reshape(-1, ids.shape[-1])))
    return result


def _joined(arrays: Sequence[npt.NDArray[T] | None]) -> npt.NDArray[T]:
    """The runs' (layers, positions, ...) parts side by side along positions."""
    present = [array for array in arrays if array is not None]
    assert len(present) == len(arrays), "every run computed it"
    return np.concatenate(present, axis=1)
