"""What ``Client.verify`` and ``AsyncClient.verify`` send (no I/O): one ``.npz`` body with
every array (the draft's probabilities are (sequences, K, vocab) floats: 131 MB as float32
for 64 x 4 x 128256, several times that as JSON text), the options in the query string
(``sample`` and ``logit_bias`` as JSON text)."""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np

from service.client.answers import JSON, NPZ
from service.client.calls import Call, model_path

#: Arrays of the body and the dtype each travels as.
ARRAYS = {
    "hidden_states": np.float32,
    "draft_token_ids": np.int64,
    "draft_probs": np.float32,
    "draft_hidden_states": np.float32,
    "draft_parents": np.int64,
    "allowed_token_ids": np.int64,
    "banned_token_ids": np.int64,
    "seeds": np.int64,
    "stop_token_ids": np.int64,
    "token_bitmask": np.int32,
}
#: Lists of lists: an entry of their values and one of their lengths each.
LISTS = ("prompt_token_ids", "output_token_ids", "bad_words_ids")


def verify_call(model: str, arrays: dict[str, Any], version: int | None, **options: Any) -> Call:
    """``arrays``: hidden_states, draft_token_ids and the optional ones (None: not sent);
    ``options``: temperature, states, sample, logit_bias, the decoding step's scalars in the
    query, its arrays and lists of lists (one per sequence) taken into the body."""
    for name in LISTS:
        lists = options.pop(name, None)
        if lists is not None:
            arrays[f"{name}_lengths"] = [len(tokens) for tokens in lists]
            arrays[name] = [token for tokens in lists for token in tokens]
    for name in ARRAYS:
        if name in options:
            arrays[name] = options.pop(name)
    unknown = sorted(set(arrays) - set(ARRAYS) - {*LISTS, *(f"{n}_lengths" for n in LISTS)})
    if unknown:
        raise TypeError(f"verify got unknown arrays {unknown}; it takes {sorted(ARRAYS)}")
    buffer = io.BytesIO()
    given = {
        name: np.asarray(value, ARRAYS.get(name, np.int64))
        for name, value in arrays.items()
        if value is not None
    }
    np.savez(buffer, **given)  # type: ignore[arg-type]
    params = {
        name: json.dumps(value) if isinstance(value, (dict, list)) else str(value)
        for name, value in options.items()
        if value is not None
    }
    path = model_path(model) + ("" if version is None else f"/versions/{version}") + "/verify"
    return Call("POST", path, buffer.getvalue(), {"content-type": NPZ, "accept": JSON}, params)


def verify_arrays_call(
    model: str,
    hidden: Any,
    ids: Any,
    probs: Any,
    parents: Any,
    seeds: Any,
    version: int | None,
    options: dict[str, Any],
) -> Call:
    """``verify``'s call: the arrays in an ``.npz`` body, the options in the query."""
    arrays = {"hidden_states": hidden, "draft_token_ids": ids, "draft_probs": probs}
    arrays |= {"draft_parents": parents, "seeds": seeds}
    arrays["draft_hidden_states"] = options.pop("draft_hidden_states", None)
    return verify_call(model, arrays, version, **options)
