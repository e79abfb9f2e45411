"""The contract held both ways, and errors that say what to do, on a real server: null is
"not given" on every front end, a request's options come from one place, each field takes the
shape the document gives it, k follows one rule on every head and verb, and the messages name
what to fix (a model on disk but not loaded, NaN in JSON, an output named by a bare string).
``test_openapi.py`` walks the document itself; these pin the cases the issue found."""

from __future__ import annotations

import io
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import pytest

from service.tools.trim import trim_version
from tests.conftest import D_MODEL, VOCAB, write_tied_and_untied
from tests.server import running_server

MAX_K = 2000  # above the heads' VOCAB tokens: a k between the two is the rule's case
KEPT = 50
ROWS = np.random.default_rng(5).standard_normal((2, D_MODEL)).round(3).tolist()
LAYERS = [ROWS, ROWS]  # (layers, tokens, d_model)
JSON_ANSWER = {"accept": "application/json"}


@pytest.fixture(scope="module")
def repository(
    tmp_path_factory: pytest.TempPathFactory,
    table: npt.NDArray[np.float32],
    output_weight: npt.NDArray[np.float32],
) -> Path:
    root = tmp_path_factory.mktemp("contract")
    write_tied_and_untied(root, table, output_weight)
    trim_version(root, "tied", None, np.arange(KEPT) * 3, "trimmed")
    return root


@pytest.fixture(scope="module")
def http(repository: Path) -> Iterator[httpx.Client]:
    with (
        running_server(repository, max_k=str(MAX_K)) as url,
        httpx.Client(base_url=url, timeout=30) as client,
    ):
        yield client


def _npy(array: Any, dtype: Any = np.float32) -> bytes:
    stream = io.BytesIO()
    np.save(stream, np.asarray(array, dtype))
    return stream.getvalue()


def _refused(answer: httpx.Response, status: int, *named: str) -> str:
    assert answer.status_code == status, answer.text
    body = answer.json()
    message: str = body["error"] if isinstance(body["error"], str) else body["error"]["message"]
    for name in named:
        assert name in message, message
    return message


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/models/tied/topk", {"hidden_states": ROWS}, "allowed_token_ids"),
        ("/v1/models/tied/topk", {"hidden_states": ROWS}, "banned_token_ids"),
        ("/v1/models/tied/topk", {"hidden_states": ROWS}, "k"),
        ("/v1/models/tied/logits", {"hidden_states": ROWS}, "allowed_token_ids"),
        ("/v1/models/tied/lens", {"hidden_states": LAYERS, "states": "final"}, "target_ids"),
        ("/v1/models/tied/score", {"hidden_states": ROWS, "target_ids": [1, 2]}, "k"),
        ("/v1/models/tied/score", {"hidden_states": ROWS, "target_ids": [1, 2]}, "candidate_ids"),
        ("/v1/compare", {"hidden_states": ROWS, "models": ["tied", "untied"]}, "target_ids"),
    ],
)
def test_null_in_a_json_body_is_not_given(
    http: httpx.Client, path: str, body: dict[str, Any], field: str
) -> None:
    """``"allowed_token_ids": null`` was refused as an unknown field by a message that listed
    it; ``"k": null`` on /score as no integer."""
    left_out = http.post(path, json=body, headers=JSON_ANSWER)
    with_null = http.post(path, json={**body, field: None}, headers=JSON_ANSWER)
    assert left_out.status_code == 200, left_out.text
    assert with_null.status_code == 200, with_null.text
    assert with_null.json() == left_out.json()


@pytest.mark.parametrize(
    ("path", "array", "field"),
    [
        ("/v1/models/tied/topk", ROWS, "allowed_token_ids"),
        ("/v1/models/tied/topk", ROWS, "banned_token_ids"),
        ("/v1/models/tied/topk", ROWS, "logit_bias"),
        ("/v1/models/tied/logits", ROWS, "allowed_token_ids"),
        ("/v1/models/tied/lens", LAYERS, "target_ids"),
    ],
)
def test_null_in_an_npy_query_is_not_given(
    http: httpx.Client, path: str, array: Any, field: str
) -> None:
    """``?allowed_token_ids=null`` was an unknown field."""
    headers = {"content-type": "application/x-npy", **JSON_ANSWER}
    query = {"states": "final"} if path.endswith("lens") else {}
    left_out = http.post(path, content=_npy(array), headers=headers, params=query)
    with_null = http.post(
        path, content=_npy(array), headers=headers, params={**query, field: "null"}
    )
    assert left_out.status_code == 200, left_out.text
    assert with_null.status_code == 200, with_null.text
    assert with_null.json() == left_out.json()


def _v2(parameters: dict[str, Any], **extra: Any) -> dict[str, Any]:
    hidden = {"name": "hidden_states", "shape": [2, D_MODEL], "datatype": "FP32", "data": ROWS}
    return {"inputs": [hidden], "parameters": parameters, **extra}


def test_null_v2_parameters_are_not_given(http: httpx.Client) -> None:
    nulls = dict.fromkeys(
        ("k", "temperature", "logprobs", "binary_data_output", "states", "allowed_token_ids"),
    )
    nulls |= dict.fromkeys(("banned_token_ids", "logit_bias", "logprobs_over", "sample"))
    left_out = http.post("/v2/models/tied/infer", json=_v2({}))
    with_null = http.post("/v2/models/tied/infer", json=_v2(nulls))
    assert left_out.status_code == 200, left_out.text
    assert with_null.status_code == 200, with_null.text
    assert with_null.json() == left_out.json()
    state_null = _v2({})
    state_null["inputs"][0]["parameters"] = {"states": None}
    assert http.post("/v2/models/tied/infer", json=state_null).json() == left_out.json()


@pytest.mark.parametrize(
    ("path", "body", "query"),
    [
        ("/v1/models/tied/topk", {"hidden_states": ROWS}, "states=residual"),
        ("/v1/models/tied/topk", {"hidden_states": ROWS}, "k=2"),
        ("/v1/models/tied/topk", {"hidden_states": ROWS}, "k=-5"),
        ("/v1/models/tied/topk", {"hidden_states": ROWS}, "bogus=1"),
        ("/v1/models/tied/logits", {"hidden_states": ROWS}, "temperature=2"),
        ("/v1/models/tied/lens", {"hidden_states": LAYERS}, "states=bogus"),
        ("/v1/models/tied/score", {"hidden_states": ROWS, "target_ids": [1, 2]}, "k=2"),
        ("/v1/models/tied/embed", {"input_ids": [1, 2]}, "bogus=1"),
        ("/v1/compare", {"hidden_states": ROWS, "models": ["tied", "untied"]}, "k=3"),
    ],
)
def test_query_parameters_beside_a_json_body_are_refused_by_name(
    http: httpx.Client, path: str, body: dict[str, Any], query: str
) -> None:
    """They were silently ignored: the defaults answered 200."""
    name = query.split("=")[0]
    answer = http.post(f"{path}?{query}", json=body)
    _refused(answer, 422, f"query parameter '{name}'", "beside a JSON body")


def test_the_version_query_beside_a_json_body_still_addresses_the_version(
    http: httpx.Client,
) -> None:
    answer = http.post("/v1/models/tied/topk?version=1", json={"hidden_states": ROWS})
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-lmhead-version"] == "1"


def test_an_npy_embed_takes_no_options(http: httpx.Client) -> None:
    headers = {"content-type": "application/x-npy"}
    answer = http.post(
        "/v1/models/tied/embed?bogus=1", content=_npy([1, 2], np.int64), headers=headers
    )
    _refused(answer, 422, "'bogus'", "/embed takes no options")


def test_banned_token_ids_is_one_flat_list(http: httpx.Client) -> None:
    """``[[21], [19]]`` was flattened: both tokens banned on both rows."""
    nested = http.post(
        "/v1/models/tied/topk", json={"hidden_states": ROWS, "banned_token_ids": [[21], [19]]}
    )
    _refused(nested, 422, "banned_token_ids", "one flat list")
    v2 = http.post("/v2/models/tied/infer", json=_v2({"banned_token_ids": [[21], [19]]}))
    _refused(v2, 400, "banned_token_ids", "one flat list")
    flat = http.post(
        "/v1/models/tied/topk",
        json={"hidden_states": ROWS, "banned_token_ids": [21, 19], "k": VOCAB},
    )
    assert flat.status_code == 200, flat.text
    for row in flat.json()["results"]:
        assert not {21, 19} & set(row["token_ids"])


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_standard_json_numbers_are_named(http: httpx.Client, literal: str) -> None:
    """Python's json.dumps writes them; the answer was "unexpected character at byte 20"."""
    row = ", ".join(["0.5"] * (D_MODEL - 1) + [literal])
    body = f'{{"hidden_states": [[{row}]]}}'.encode()
    headers = {"content-type": "application/json"}
    native = http.post("/v1/models/tied/topk", content=body, headers=headers)
    _refused(native, 400, "NaN or Infinity at byte", "JSON has no such numbers")
    assert native.json()["error"]["code"] == "malformed_body"
    header = f'{{"inputs": [{{"name": "hidden_states", "data": [{literal}]}}]}}'.encode()
    _refused(http.post("/v2/models/tied/infer", content=header), 400, "NaN or Infinity at byte")
    bare_word = http.post("/v1/models/tied/topk", content=b'{"k": nope}', headers=headers)
    assert "NaN" not in _refused(bare_word, 400, "not valid JSON")


def test_embed_names_what_it_takes_beside_an_unknown_field(http: httpx.Client) -> None:
    answer = http.post("/v1/models/tied/embed", json={"input_ids": [1], "bogus": 1})
    message = _refused(answer, 422, "unknown field 'bogus'", "input_ids")
    assert not message.rstrip().endswith("are")  # it listed nothing: "the options here are "


def test_a_v2_output_named_by_a_bare_string_says_so(http: httpx.Client) -> None:
    answer = http.post("/v2/models/tied/infer", json=_v2({}, outputs=["topk_token_ids"]))
    message = _refused(answer, 400, "outputs[0] must be an object", '{"name": "topk_token_ids"}')
    assert "None" not in message


def test_a_model_on_disk_but_not_loaded_says_so_and_names_the_load_call(
    http: httpx.Client, repository: Path
) -> None:
    """It answered 404 "not found", with no hint; the call it names loads it."""
    shutil.copytree(repository / "untied", repository / "late")
    load = "POST /v1/repository/models/late/load"
    for answer in (
        http.get("/v1/models/late"),
        http.post("/v1/models/late/topk", json={"hidden_states": ROWS}),
        http.get("/v2/models/late"),
    ):
        _refused(answer, 404, "'late' is in the repository but not loaded", load)
    unknown = http.get("/v1/models/nowhere")
    _refused(unknown, 404, "'nowhere' not found; models: ", "tied")
    method, path = load.split()
    assert http.request(method, path).status_code == 200
    assert http.get("/v1/models/late").json()["state"] == "READY"


def test_k_above_the_vocabulary_follows_one_rule_on_every_head_and_verb(
    http: httpx.Client,
) -> None:
    """docs/api.md: a k in [1, LMHEAD_MAX_K] above what a row can hold answers all of it,
    and the answer's k says how many; past LMHEAD_MAX_K it is refused, on every head."""
    k = VOCAB + 500
    topk = "/v1/models/{}/topk"
    for model, extra, held in (
        ("tied", {}, VOCAB),
        ("trimmed", {}, KEPT),
        ("tied", {"allowed_token_ids": [3, 7, 11]}, 3),
        ("tied", {"banned_token_ids": [7]}, VOCAB - 1),
    ):
        answer = http.post(topk.format(model), json={"hidden_states": ROWS, "k": k, **extra})
        assert answer.status_code == 200, answer.text
        assert answer.json()["k"] == held, (model, extra)
        assert {len(row["token_ids"]) for row in answer.json()["results"]} == {held}
    lens = http.post(
        "/v1/models/trimmed/lens", json={"hidden_states": LAYERS, "k": k, "states": "final"}
    )
    assert lens.json()["k"] == KEPT
    score = http.post(
        "/v1/models/tied/score", json={"hidden_states": ROWS, "target_ids": [1, 2], "k": k}
    )
    assert {len(row["ids"]) for row in score.json()["alternatives"]} == {VOCAB}
    compare = http.post(
        "/v1/compare", json={"hidden_states": ROWS, "models": ["tied", "untied"], "k": k}
    )
    assert compare.json()["k"] == VOCAB
    v2 = http.post("/v2/models/trimmed/infer", json=_v2({"k": k}))
    assert {tuple(output["shape"]) for output in v2.json()["outputs"]} == {(2, KEPT)}
    too_many = MAX_K + 1
    for model in ("tied", "trimmed"):
        refused = http.post(topk.format(model), json={"hidden_states": ROWS, "k": too_many})
        _refused(refused, 422, f"k must be between 1 and {MAX_K} (LMHEAD_MAX_K)")
    lens_refused = http.post(
        "/v1/models/trimmed/lens", json={"hidden_states": LAYERS, "k": too_many, "states": "final"}
    )
    _refused(lens_refused, 422, "LMHEAD_MAX_K")
    _refused(http.post("/v2/models/trimmed/infer", json=_v2({"k": too_many})), 400, "LMHEAD_MAX_K")


def test_query_parameters_no_route_reads_are_refused_by_name(http: httpx.Client) -> None:
    """/compare names its models in the body (``?version=`` addressed nothing); a V2 infer
    takes its options in the body's parameters (``?k=3`` was ignored), its version as usual."""
    compare = {"hidden_states": ROWS, "models": ["tied", "untied"]}
    _refused(http.post("/v1/compare?version=1", json=compare), 422, "query parameter 'version'")
    v2 = http.post("/v2/models/tied/infer?k=3", json=_v2({}))
    _refused(v2, 400, "query parameter 'k'", "V2 options go in the body's parameters")
    assert http.post("/v2/models/tied/infer?version=1", json=_v2({})).status_code == 200
