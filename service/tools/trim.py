"""Trimmed vocabularies: a head that keeps only chosen rows of its matrices, and still speaks
the original token ids.

``lmhead trim MODEL --keep IDS --name NEW`` writes the kept rows (a tied head stays tied: ONE
matrix, fewer rows), the bias and transforms as they were, the final norm, the kept labels, and
``vocab_map.json`` (``{"vocab_size": original, "token_ids": [kept ids, ascending]}``). The
service reads the map into a ``TokenSpace``: requests name original ids (an id that was
trimmed is a 422), answers return original ids, and inside, column i is ``token_ids[i]``. Kept
ids stay in ascending order, so equal logits still rank the lower original id first, and a
trimmed head's answers equal the full head's restricted to the kept ids.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import numpy.typing as npt

from service.errors import InvalidInput
from service.heads.files import HeadWeights, save_head
from service.repository.disk import LABELS_FILE, VOCAB_MAP_FILE
from service.tools.checkpoints import CheckpointError
from service.tools.importer import EXTERNAL_DATA_ABOVE_BYTES, write_version
from service.tools.sources import opened_version

#: The ids to keep, or what makes them of the number of ids the version answers in.
Keep = npt.ArrayLike | Callable[[int], npt.ArrayLike]


def trim_version(
    repository: str | Path,
    name: str,
    version: int | None,
    keep: Keep,
    new_name: str,
    to_version: int | None = None,
) -> Path:
    """Write ``name``'s version (the newest by default) trimmed to the ``keep`` ids (original
    ids; repeats and order do not matter) as a version of ``new_name``. ``keep`` may be a
    function of the number of ids the version answers in (its rows, or a trimmed head's
    original vocabulary): the command line's ranges are checked against it, from the version
    read once, as the service would load it (``sources.opened_version``)."""
    with opened_version(repository, name, version) as source:
        space, weights, labels = source.space, source.weights, source.labels
        kept = np.unique(np.asarray(keep(space.size) if callable(keep) else keep).reshape(-1))
        if kept.dtype.kind not in "iu" or not len(kept):
            raise CheckpointError("--keep must name at least one integer token id")
        if kept[0] < 0 or kept[-1] >= space.size:
            raise CheckpointError(f"--keep ids must be in [0, {space.size})")
        try:
            columns = space.local(kept.astype(np.int64), "--keep")
        except InvalidInput as error:
            raise CheckpointError(str(error)) from None
        trimmed = HeadWeights(
            np.ascontiguousarray(weights.embedding[columns]),
            None if weights.output is None else np.ascontiguousarray(weights.output[columns]),
            None if weights.bias is None else weights.bias[columns],
            weights.transforms,
            weights.twin,
            weights.norm,  # over d_model, which trimming keeps: residual states still read
        )

        def write(staging: Path) -> None:
            external = trimmed.nbytes > EXTERNAL_DATA_ABOVE_BYTES
            save_head(trimmed, staging, external_data=external)
            mapping = {"vocab_size": space.size, "token_ids": space.original(columns).tolist()}
            (staging / VOCAB_MAP_FILE).write_text(json.dumps(mapping), encoding="utf-8")
            if labels is not None:
                kept_labels = [labels[i] if i < len(labels) else "" for i in columns.tolist()]
                text = "\n".join(kept_labels) + "\n"
                (staging / LABELS_FILE).write_text(text, encoding="utf-8")

        return write_version(Path(repository) / new_name, to_version, write, flag="--to-version")
