"""The client's reading of answers, on answers built by hand: errors raised as their class,
Retry-After honoured within bounds, and bodies that are not the call's answer named."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from service.client.answers import UnreadableAnswer, read_json, read_topk
from service.client.calls import Calls, checked, retry_after
from service.errors import InvalidInput, ModelNotFound, ServiceError

REQUEST = httpx.Request("POST", "http://127.0.0.1:8000/v1/models/m/topk")


def _answer(status: int, **kwargs: object) -> httpx.Response:
    return httpx.Response(status, request=REQUEST, **kwargs)  # type: ignore[arg-type]


def test_a_service_error_is_raised_as_its_class_with_the_message() -> None:
    body = {"error": {"code": "invalid_input", "message": "k must be between 1 and 100"}}
    with pytest.raises(InvalidInput, match="k must be between") as raised:
        checked(_answer(422, json=body))
    assert raised.value.status == 422


def test_a_v2_error_string_is_raised_by_its_status() -> None:
    """V2 errors carry no code: the status picks the class where it names one."""
    with pytest.raises(ModelNotFound, match="no model 'm'"):
        checked(_answer(404, json={"error": "no model 'm'"}))
    with pytest.raises(ServiceError, match="queue is full") as raised:  # 503: several kinds
        checked(_answer(503, json={"error": "the queue is full"}))
    assert raised.value.status == 503


def test_an_error_page_that_is_not_json_keeps_its_status_and_text() -> None:
    with pytest.raises(ServiceError, match="Bad Gateway") as raised:
        checked(_answer(599, text="<html>Bad Gateway</html>"))
    assert raised.value.status == 599


def test_a_success_is_returned_as_it_is() -> None:
    answer = _answer(200, json={"models": []})
    assert checked(answer) is answer


@pytest.mark.parametrize(
    ("header", "expected"),
    [("3", 3.0), ("0", 0.5), ("600", 5.0), ("nan", 0.5), ("soon", 0.5), (None, 0.5)],
)
def test_retry_after_is_honoured_between_the_backoff_and_ten_times_it(
    header: str | None, expected: float
) -> None:
    headers = {} if header is None else {"retry-after": header}
    assert retry_after(_answer(503, headers=headers), 0.5) == expected


def test_a_body_without_the_answer_is_an_unreadable_answer() -> None:
    answer = _answer(200, text="<html>a proxy's page</html>", headers={"content-type": "text/html"})
    with pytest.raises(UnreadableAnswer, match="not what the call returns") as raised:
        read_json(answer, has="models")
    assert raised.value.status == 502
    assert read_json(_answer(200, json={"models": [1]}), "models") == [1]


def test_options_left_none_are_never_sent() -> None:
    """None is "not given": not in the query of an .npy call, nor in a JSON body, nested
    objects included (``logprobs_over=None`` went as the text "null")."""
    calls = Calls(binary=True, token=None)
    options = {"allowed_token_ids": None, "logprobs_over": None, "sample": {"seed": None}}
    binary = calls.topk("m", np.ones((1, 4)), None, False, 1.0, False, None, options)
    assert binary.params == {"logprobs": "false", "temperature": "1.0", "sample": "{}"}
    as_json = Calls(binary=False, token=None).topk(
        "m", np.ones((1, 4)), 3, False, 1.0, False, None, options
    )
    assert as_json.content is not None
    sent = json.loads(as_json.content)
    assert sorted(sent) == ["hidden_states", "k", "logprobs", "sample", "temperature"]
    assert sent["sample"] == {}
    score = calls.score("m", [[1.0]], [1], None, k=None, candidate_ids=None)
    assert score.content is not None
    assert sorted(json.loads(score.content)) == ["hidden_states", "target_ids"]


def test_token_strings_are_nested_as_the_ids() -> None:
    """A (2, 3)-row answer: ``tokens[b][t]`` holds row (b, t)'s strings, as ``token_ids``."""
    rows = [
        {"token_ids": [i, i + 1], "logits": [1.0, 0.5], "tokens": [f"t{i}", None]} for i in range(6)
    ]
    body = {"model": "m", "version": 1, "tied": True, "k": 2, "shape": [2, 3], "results": rows}
    top = read_topk(_answer(200, json=body))
    assert top.token_ids.shape == (2, 3, 2)
    assert top.tokens == [
        [["t0", None], ["t1", None], ["t2", None]],
        [["t3", None], ["t4", None], ["t5", None]],
    ]
    flat = read_topk(_answer(200, json=body | {"shape": [6]}))
    assert flat.tokens == [row["tokens"] for row in rows]
