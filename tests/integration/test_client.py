"""``service.client`` against a real server: every call equals the float64 reference, errors come
back as their classes, retries ride out a 503 and a server that is still starting."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import pytest

from service.client import AsyncClient, Client, UnreadableAnswer
from service.client.calls import Calls, retry_after
from service.errors import (
    InvalidInput,
    ModelNotFound,
    ModelNotReady,
    ServiceError,
    Unauthorized,
    VersionNotFound,
)
from service.heads.reference import log_softmax, top_k
from service.tools.demo import demo_tokens
from tests.conftest import D_MODEL, VOCAB, reference_logits
from tests.server import free_port, running_server, running_server_on

HIDDEN = np.random.default_rng(41).standard_normal((2, 3, D_MODEL)).astype(np.float32)
RTOL, ATOL = 1e-4, 1e-4
TOKEN = "client-test-token"


@pytest.fixture(scope="module")
def url(repository: Path) -> Iterator[str]:
    with running_server(repository, admin_token=TOKEN) as base_url:
        yield base_url


@pytest.mark.parametrize("binary", [True, False])
@pytest.mark.parametrize("model", ["tied", "untied"])
def test_topk_equals_the_reference(url: str, repository: Path, model: str, binary: bool) -> None:
    with Client(url, binary=binary) as client:
        top = client.topk(model, HIDDEN, k=4, logprobs=True)
    logits = reference_logits(repository / model / "1", HIDDEN.reshape(-1, D_MODEL))
    values, ids = top_k(logits, 4)
    assert (top.model, top.version, top.tied) == (model, 1, model == "tied")
    assert top.token_ids.shape == (2, 3, 4)
    np.testing.assert_array_equal(top.token_ids.reshape(-1, 4), ids)
    np.testing.assert_allclose(top.logits.reshape(-1, 4), values, rtol=RTOL, atol=ATOL)
    assert top.logprobs is not None
    want = np.take_along_axis(log_softmax(logits), ids, axis=1)
    np.testing.assert_allclose(top.logprobs.reshape(-1, 4), want, rtol=RTOL, atol=ATOL)


def test_tokens_sampling_and_options_pass_through(url: str) -> None:
    with Client(url) as client:
        restricted = client.logits("tied", HIDDEN, allowed_token_ids=[40, 5, 9])
        top = client.topk("tied", HIDDEN[0], k=2, tokens=True)
        sampled = client.topk("tied", HIDDEN[0], k=2, allowed_token_ids=[5, 9], sample={"seed": 1})
    labels = demo_tokens(VOCAB)
    assert top.tokens == [[labels[i] for i in row] for row in top.token_ids.tolist()]
    assert restricted.array.shape == (*HIDDEN.shape[:-1], 3)  # the columns asked for
    with Client(url) as client:
        full = client.logits("tied", HIDDEN).array
    np.testing.assert_allclose(restricted.array, full[..., [40, 5, 9]], rtol=RTOL, atol=ATOL)
    assert sampled.sampled_token_ids is not None
    assert set(sampled.sampled_token_ids.tolist()) <= {5, 9}
    over: dict[bool, list[Any]] = {}  # a word option went as JSON text ("vocabulary", quoted)
    for binary in (True, False):
        with Client(url, binary=binary) as client:
            over[binary] = [
                client.topk(
                    "tied",
                    HIDDEN[:2],
                    k=2,
                    logprobs=True,
                    allowed_token_ids=[5, 9, 40],
                    logprobs_over=name,
                ).logprobs
                for name in ("vocabulary", "candidates")
            ]
    np.testing.assert_allclose(over[True], over[False], rtol=1e-5, atol=1e-6)
    vocabulary, candidates = over[True]
    assert (vocabulary < candidates).all()  # normalised over more tokens, each gets less


def test_logits_embed_score_compare_and_metadata(
    url: str, repository: Path, table: npt.NDArray[np.float32]
) -> None:
    rows = HIDDEN.reshape(-1, D_MODEL)
    targets = np.arange(len(rows)) * 7
    with Client(url) as client:
        logits = client.logits("untied", rows)
        embedded = client.embed("tied", np.array([[3, 4]]))
        scored = client.score("untied", rows, targets, k=2)
        compared = client.compare("tied", "untied", rows, k=3)
        names = {entry["name"] for entry in client.models()}
        described = client.model("tied")
        ready = client.ready()
    expected = reference_logits(repository / "untied" / "1", rows)
    np.testing.assert_allclose(logits.array, expected, rtol=RTOL, atol=ATOL)
    assert (logits.model, logits.tied) == ("untied", False)
    np.testing.assert_array_equal(embedded.array, table[[[3, 4]]])
    with Client(url) as client, pytest.raises(InvalidInput, match="integers"):
        client.embed("tied", [1.9, 2.7])  # not ids 1 and 2: the service says what is wrong
    want = log_softmax(expected)[np.arange(len(rows)), targets]
    got = [row["logprob"] for row in scored["results"]]
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    assert compared["rows"] == len(rows)
    assert names >= {"tied", "untied"}
    assert described["name"] == "tied"
    assert ready


def test_service_errors_come_back_as_their_classes(url: str) -> None:
    with Client(url) as client:
        with pytest.raises(InvalidInput, match=f"d_model={D_MODEL}"):
            client.topk("tied", np.zeros((1, D_MODEL + 1), np.float32))
        with pytest.raises(ModelNotFound, match="nope"):
            client.topk("nope", HIDDEN)
        with pytest.raises(Unauthorized):
            client.load("tied")
        holes = HIDDEN.copy()
        holes[0, 0] = np.nan
        with pytest.raises(ValueError, match="cannot carry NaN or Inf"):  # said before sending
            client.compare("tied", "untied", holes)
        with pytest.raises(InvalidInput, match="NaN"):  # a .npy body carries it; the service
            client.topk("tied", holes)  # says what is wrong with it
    with Client(url, token=TOKEN) as admin:
        assert admin.load("tied")["state"] == "READY"
        with pytest.raises(VersionNotFound):  # V2's control errors carry no code: by status
            admin.load("tied", 9)  # it was ModelNotFound
    with Client(url) as client, pytest.raises(ServiceError) as refused:
        client.topk("tied/../untied", HIDDEN)  # one path segment: it was a path, served untied
    assert refused.value.status == 404


def test_binary_mode_sends_what_json_mode_sends(url: str) -> None:
    """Thousands of ids did not fit in a URL (431); integer rows were refused; the seed of a
    draw was lost (neither answer kept it); ``ready`` raised while the service was down."""
    many = list(range(VOCAB))
    rows = np.rint(HIDDEN[:2] * 4).astype(np.int64)  # integers, as JSON reads any number
    answers = []
    for binary in (True, False):
        with Client(url, binary=binary) as client:
            answers.append(client.topk("tied", rows, k=3, allowed_token_ids=many, sample={}))
            banned = client.topk("tied", rows, k=3, banned_token_ids=many[:-3])
            assert set(banned.token_ids.reshape(-1).tolist()) <= set(many[-3:])
    calls = Calls(binary=True, token=None)  # 4096 ids: over the service's header limit
    long = calls.topk("tied", rows, 3, False, 1.0, False, None, {"banned_token_ids": [1] * 4096})
    assert long.headers is not None
    assert long.headers["content-type"] == "application/x-npz"  # in the body, binary
    from_npz, from_json = answers
    np.testing.assert_array_equal(from_npz.token_ids, from_json.token_ids)
    assert from_npz.seed is not None
    assert from_json.seed is not None
    with Client(url) as client:
        again = client.topk("tied", rows, k=3, sample={"seed": from_npz.seed})
    np.testing.assert_array_equal(again.sampled_token_ids, from_npz.sampled_token_ids)
    with Client("http://127.0.0.1:9", retries=0) as nobody:
        assert nobody.ready() is False


def test_a_503_is_retried_then_raised(repository: Path) -> None:
    """An unloaded model answers 503: the client tries 1 + 2 times, then raises its class."""
    with (
        running_server(repository) as base_url,
        Client(base_url, retries=2, backoff_s=0.01) as client,
    ):
        client.unload("untied")
        with pytest.raises(ModelNotReady, match="unloaded"):
            client.topk("untied", HIDDEN[0, :2])
        metrics = httpx.get(f"{base_url}/metrics").text
    refused = [
        line
        for line in metrics.splitlines()
        if line.startswith("lmhead_http_requests_total{")
        and 'status="503"' in line
        and "topk" in line  # not the readiness probes of start-up
    ]
    assert sum(float(line.split()[-1]) for line in refused) == 3


def test_calls_ride_out_a_server_that_is_still_starting(repository: Path) -> None:
    """The client is called before the server exists: refused connections, then 503 while the
    models load, then the answer, all within its retries."""
    port = free_port()
    answers: list[object] = []

    def call() -> None:
        with Client(f"http://127.0.0.1:{port}", retries=9, backoff_s=0.05) as client:
            answers.append(client.topk("untied", HIDDEN[0], k=1))

    caller = threading.Thread(target=call)
    caller.start()
    with running_server_on(port, repository):
        caller.join(timeout=60)
    (answer,) = answers
    assert answer.token_ids.shape == (3, 1)  # type: ignore[attr-defined]


def test_the_async_client_under_concurrency(url: str, repository: Path) -> None:
    rows = np.random.default_rng(3).standard_normal((32, D_MODEL)).astype(np.float32)

    async def scenario() -> list[npt.NDArray[np.int64]]:
        async with AsyncClient(url) as client:
            answers = await asyncio.gather(*(client.topk("tied", row[None], k=3) for row in rows))
            assert await client.ready()
        return [answer.token_ids[0] for answer in answers]

    got = np.array(asyncio.run(scenario()))
    np.testing.assert_array_equal(
        got, top_k(reference_logits(repository / "tied" / "1", rows), 3)[1]
    )


def test_the_client_imports_no_onnxruntime_and_no_server() -> None:
    heavy = "('onnxruntime', 'fastapi', 'uvicorn', 'onnx')"
    code = f"import sys, service.client; print(sorted(m for m in {heavy} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_the_async_client_speaks_metadata_compare_and_control(url: str) -> None:
    rows = HIDDEN.reshape(-1, D_MODEL)

    async def scenario() -> tuple[dict[str, object], dict[str, object], dict[str, object]]:
        async with AsyncClient(url, token=TOKEN) as client:
            described = await client.model("untied")
            compared = await client.compare("tied", "untied", rows, k=2)
            loaded = await client.load("untied")
        return described, compared, loaded

    described, compared, loaded = asyncio.run(scenario())
    assert (described["name"], compared["rows"], loaded["state"]) == ("untied", 6, "READY")


@pytest.mark.parametrize(
    ("header", "wait"), [("0.2", 0.2), ("0", 0.1), ("30", 1.0), ("nan", 0.1), ("inf", 0.1)]
)
def test_retry_after_is_bounded_whatever_the_header(header: str, wait: float) -> None:
    """Retry-After within [backoff, 10 x backoff]: "nan" parses as a float and compares false
    with everything (it crashed the sync client and hung the async one)."""
    answer = httpx.Response(503, headers={"retry-after": header})
    assert retry_after(answer, 0.1) == pytest.approx(wait)


class _NotLmhead(BaseHTTPRequestHandler):
    """Something else on the port (a proxy's page, another service): 200 and HTML to all."""

    body = b"<html>welcome to the proxy</html>"

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        body = self.body
        self.send_response(200)
        self.send_header("content-type", self.headers.get("accept", "text/html"))
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 (http.server's names)
        self._answer()

    def do_POST(self) -> None:  # noqa: N802
        self._answer()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def not_lmhead() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotLmhead)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_success_that_is_no_answer_is_a_service_error(not_lmhead: str) -> None:
    """Every call, sync and async, raises ``UnreadableAnswer`` (a ``ServiceError``) naming the
    call and the content type, not the parser's ``ValueError``/``KeyError``/``BadZipFile``."""
    rows = HIDDEN[0]
    calls: list[Callable[[Client], object]] = [
        lambda c: c.topk("m", rows),
        lambda c: c.topk("m", rows, tokens=True),
        lambda c: c.logits("m", rows),
        lambda c: c.embed("m", [1, 2]),
        lambda c: c.score("m", rows, [1, 2, 3]),
        lambda c: c.compare("a", "b", rows),
        lambda c: c.models(),
        lambda c: c.model("m"),
        lambda c: c.load("m"),
        lambda c: c.unload("m"),
        lambda c: c.lens("m", HIDDEN),
        lambda c: c.lens("m", HIDDEN, tokens=True),
    ]
    with Client(not_lmhead, retries=0) as client:
        for call in calls:
            with pytest.raises(UnreadableAnswer, match=r"200 answer to (GET|POST) /v"):
                call(client)
        for body in (b"{}", b"[1, 2]"):  # JSON, but not the call's answer: it was returned
            _NotLmhead.body = body
            for call in (calls[4], calls[5], calls[7], calls[8], calls[11]):
                with pytest.raises(UnreadableAnswer):
                    call(client)
        _NotLmhead.body = b"<html>welcome to the proxy</html>"

    async def scenario() -> None:
        async with AsyncClient(not_lmhead, retries=0) as client:
            with pytest.raises(UnreadableAnswer, match="application/x-npz"):
                await client.topk("m", rows)
            with pytest.raises(UnreadableAnswer, match="/lens"):
                await client.lens("m", HIDDEN)
            with pytest.raises(ServiceError, match="/v1/models"):
                await client.models()

    asyncio.run(scenario())


@pytest.mark.parametrize("binary", [True, False])
def test_options_left_none_are_not_sent(url: str, binary: bool) -> None:
    """None means "not given": ``allowed_token_ids=None`` failed (a null the service refused),
    ``logprobs_over=None`` went as the text "null"."""
    nones: dict[str, Any] = dict.fromkeys(
        ("allowed_token_ids", "banned_token_ids", "logit_bias", "logprobs_over", "sample")
    )
    with Client(url, binary=binary) as client:
        plain = client.topk("tied", HIDDEN, k=3, logprobs=True)
        with_nones = client.topk("tied", HIDDEN, k=3, logprobs=True, **nones)
        drawn = client.topk("tied", HIDDEN, k=3, sample={"seed": 4, "top_p": None})
        seeded = client.topk("tied", HIDDEN, k=3, sample={"seed": 4})
        scored = client.score("tied", HIDDEN[0], [1, 2, 3], k=None, candidate_ids=None)
        logits = client.logits("tied", HIDDEN, allowed_token_ids=None)
    np.testing.assert_array_equal(with_nones.token_ids, plain.token_ids)
    assert with_nones.logprobs is not None
    assert plain.logprobs is not None
    np.testing.assert_array_equal(with_nones.logprobs, plain.logprobs)
    assert drawn.sampled_token_ids is not None
    assert seeded.sampled_token_ids is not None
    np.testing.assert_array_equal(drawn.sampled_token_ids, seeded.sampled_token_ids)
    assert "alternatives" not in scored
    assert logits.array.shape == (*HIDDEN.shape[:-1], VOCAB)


def test_token_strings_keep_the_shape_of_the_ids(url: str) -> None:
    """(batch, tokens, d) rows: ``tokens[b][t]`` is row (b, t)'s strings, as ``token_ids[b, t]``
    (they came back flat, one list per row)."""
    with Client(url) as client:
        top = client.topk("tied", HIDDEN, k=2, tokens=True)
    labels = demo_tokens(VOCAB)
    assert top.token_ids.shape == (2, 3, 2)
    assert top.tokens == [
        [[labels[i] for i in ids] for ids in row] for row in top.token_ids.tolist()
    ]
