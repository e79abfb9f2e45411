"""Memory bounds, connection limits and hostile input, against a real server (issue 13,
classes 2, 3 and 4): every limit answers with a clear 4xx/503 and nothing else suffers."""

from __future__ import annotations

import contextlib
import io
import json
import re
import select
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import numpy.typing as npt
import orjson
import pytest

from service.budget import worst_case_extra_bytes
from service.heads.files import HeadWeights, save_head
from service.heads.reference import top_k
from service.settings import Settings
from tests.conftest import D_MODEL, VOCAB, reference_logits
from tests.server import peak_resident, poll, running_server, server_process

RUN_ROWS = 64
NPY = {"content-type": "application/x-npy"}
LOGITS_BYTES = RUN_ROWS * 2 * VOCAB * 4  # one run of 64 rows: logits and log-softmax
LIMITS = {
    "max_logits_bytes": str(LOGITS_BYTES),
    "max_inflight_bytes": str(8 * 2**20),
    "max_body_bytes": str(4 * 2**20),
    "shadow_max_pending": "2",
    "max_connections": "12",
    "max_header_bytes": "4096",
    "header_timeout_s": "1",
    "body_timeout_s": "1",
}


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory, table: npt.NDArray[np.float32]) -> Path:
    root = tmp_path_factory.mktemp("limits")
    save_head(HeadWeights.from_arrays(table), root / "tied" / "1")
    save_head(HeadWeights.from_arrays(table), root / "twin" / "1")
    shadow = {"shadow": {"model": "twin", "fraction": 1.0}}
    (root / "tied" / "config.json").write_text(json.dumps(shadow))
    return root


@pytest.fixture(scope="module")
def url(repository: Path) -> Iterator[str]:
    with running_server(repository, **LIMITS) as base_url:
        yield base_url


def _rows(count: int, seed: int = 0) -> npt.NDArray[np.float32]:
    return np.random.default_rng(seed).standard_normal((count, D_MODEL)).astype(np.float32)


def _metric(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    match = re.search(rf"^{name}{{{wanted}}} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_big_requests_run_in_chunks_within_the_byte_limit(url: str, repository: Path) -> None:
    """300 rows with room for 64 per run: five runs, each within the limit; answers exact."""
    hidden = _rows(300, seed=1)
    answer = httpx.post(f"{url}/v1/models/twin/topk", json={"hidden_states": hidden.tolist()})
    assert answer.status_code == 200
    ids = [row["token_ids"] for row in answer.json()["results"]]
    expected = top_k(reference_logits(repository / "twin" / "1", hidden), 5)[1]
    np.testing.assert_array_equal(ids, expected)
    text = httpx.get(f"{url}/metrics").text
    labels = {"model": "twin", "version": "1"}
    runs = _metric(text, "lmhead_batch_rows_count", **labels)
    assert runs >= 5
    assert _metric(text, "lmhead_batch_rows_bucket", le="64.0", **labels) == runs


def test_shadow_traffic_never_materialises_logits_past_the_limit(url: str) -> None:
    big = httpx.post(f"{url}/v1/models/tied/topk", json={"hidden_states": _rows(500).tolist()})
    small = httpx.post(f"{url}/v1/models/tied/topk", json={"hidden_states": _rows(4).tolist()})
    assert big.status_code == small.status_code == 200
    pair = {"primary": "tied", "shadow": "twin"}

    def counted() -> str | None:
        text = httpx.get(f"{url}/metrics").text
        ran = _metric(text, "lmhead_shadow_requests_total", outcome="ran", **pair)
        return text if ran >= 1 else None

    text = poll(counted, "the small request's shadow run")
    assert _metric(text, "lmhead_shadow_requests_total", outcome="too_large", **pair) == 1


@pytest.mark.xdist_group("measure")  # a server's memory (tests/conftest.py)
def test_memory_stays_within_the_documented_bound_under_hostile_load(
    repository: Path,
) -> None:
    """12 clients sending 14 MB JSON bodies (each ~3x that decoded: +300 MB without a budget)
    and full-logits requests: past the in-flight budget they get 503 with Retry-After, and the
    server's peak resident memory stays within the documented worst case."""
    settings = {
        **LIMITS,
        "max_connections": "100",
        "max_logits_bytes": str(2**20),
        "max_rows": "16000",
        "max_body_bytes": str(16 * 2**20),
        "max_inflight_bytes": str(64 * 2**20),  # one body's decoding is charged ~42 MB
        "provider": "cpu",  # host memory is what is measured
    }
    big_body = orjson.dumps({"hidden_states": _rows(16000, seed=3).tolist(), "k": 3})
    logits_body = orjson.dumps({"hidden_states": _rows(250, seed=4).tolist()})
    with running_server(repository, **settings) as url:
        server = server_process(url)
        models_loaded = server.memory_info().rss

        def send(index: int) -> int:
            body, path = (big_body, "topk") if index % 3 else (logits_body, "logits")
            answer = httpx.post(
                f"{url}/v1/models/twin/{path}",
                content=body,
                headers={"content-type": "application/json"},
                timeout=120,
            )
            if answer.status_code == 503:
                assert answer.json()["error"]["code"] == "server_busy"
                assert answer.headers["retry-after"] == "1"
            return answer.status_code

        with ThreadPoolExecutor(12) as clients:
            statuses = list(clients.map(send, range(36)))
        peak = peak_resident(server)
        # Which requests of the storm got in is timing (3-12 of 36 here, 1 once in CI); that
        # the budget came back whole is not: a request alone is served afterwards.
        assert send(0) == 200
    assert set(statuses) <= {200, 503}
    assert 503 in statuses  # the budget did refuse some
    bound = worst_case_extra_bytes(Settings(**settings))  # type: ignore[arg-type]
    print(f"\npeak - loaded: {(peak - models_loaded) / 2**20:.0f} MB, bound {bound / 2**20:.0f} MB")
    assert peak - models_loaded <= bound


def test_json_that_decodes_past_the_budget_is_413_before_decoding(url: str) -> None:
    """``[[0],[0],...]``: 4 bytes of JSON per Python list, ~30x its bytes once decoded (63 MiB
    took +2 GB). Charged by its commas and brackets before decoding, it is refused whole;
    the same rows as ``.npy`` are served."""
    rows = 900_000  # 3.6 MB, under the 4 MiB body limit; ~108 MB decoded, the budget is 8
    body = b'{"hidden_states":[' + b"[0]," * (rows - 1) + b"[0]]}"
    server = server_process(url)
    before = server.memory_info().rss
    answer = httpx.post(
        f"{url}/v1/models/tied/topk", content=body, headers={"content-type": "application/json"}
    )
    assert answer.status_code == 413
    message = answer.json()["error"]["message"]
    assert "LMHEAD_MAX_INFLIGHT_BYTES" in message
    assert ".npy" in message
    assert server.memory_info().rss - before < 50 * 2**20
    assert httpx.post(
        f"{url}/v1/models/tied/topk", json={"hidden_states": _rows(2).tolist()}
    ).is_success


def _exchange(url: str, raw: bytes, timeout: float = 10.0) -> tuple[int, bytes, bool]:
    """Send raw bytes on a fresh connection; the status, the body and whether it was closed."""
    head, body, closed = _exchange_head(url, raw, timeout)
    return int(head.split(b" ", 2)[1]), body, closed


def _exchange_head(url: str, raw: bytes, timeout: float = 10.0) -> tuple[bytes, bytes, bool]:
    """``_exchange`` with the answer's status line and headers as sent."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        if raw:  # (nothing: a connection refused at once answers without being asked)
            sock.sendall(raw)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(re.search(rb"content-length: (\d+)", head, re.IGNORECASE).group(1))  # type: ignore[union-attr]
        while len(body) < length:
            body += sock.recv(65536)
        try:
            closed = sock.recv(1) == b""
        except ConnectionResetError:
            closed = True
    return head, body, closed


def test_oversized_headers_are_431_and_the_connection_closed(url: str) -> None:
    def refused() -> float:
        text = httpx.get(f"{url}/metrics").text
        found = re.search(
            r'^lmhead_http_refused_total{code="headers_too_large"} (\S+)$', text, re.M
        )
        return float(found.group(1)) if found else 0.0

    before = refused()
    raw = b"GET /health/live HTTP/1.1\r\nHost: localhost\r\nX-Pad: " + b"a" * 8000 + b"\r\n\r\n"
    for _ in range(2):
        status, body, closed = _exchange(url, raw)
        assert (status, closed) == (431, True)
        assert json.loads(body)["error"]["code"] == "headers_too_large"
    assert refused() - before == 2  # counted: the app never saw them


def test_a_head_or_body_that_never_completes_is_408(url: str) -> None:
    status, _, closed = _exchange(url, b"POST /v1/models/tied/topk HTTP/1.1\r\nHost: localhost\r\n")
    assert (status, closed) == (408, True)
    stalled = (
        b"POST /v1/models/tied/topk HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1000\r\n\r\n{"
    )
    status, _, closed = _exchange(url, stalled)
    assert (status, closed) == (408, True)


def test_connections_beyond_the_cap_get_503_and_others_are_served(url: str) -> None:
    host, port = url.removeprefix("http://").split(":")
    idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(12)]
    try:
        status, body, closed = _exchange(url, b"")
        assert (status, closed) == (503, True)
        assert json.loads(body)["error"]["code"] == "too_many_connections"
    finally:
        for sock in idle:
            sock.close()

    def served() -> int | None:
        answer = httpx.get(f"{url}/health/live")
        return answer.status_code if answer.status_code == 200 else None

    assert poll(served, "a connection once the idle ones closed") == 200


def test_a_connection_stays_usable_after_error_answers(url: str) -> None:
    """An error answer keeps the keep-alive connection: the next request on it succeeds."""
    good = json.dumps({"hidden_states": _rows(1).tolist()}).encode()
    bad = b'{"hidden_states": [[1.0]]}'
    host, port = url.removeprefix("http://").split(":")
    with (
        socket.create_connection((host, int(port)), timeout=10) as sock,
        sock.makefile("rb") as reader,
    ):
        for body, expected in ((bad, 422), (b"{", 400), (good, 200)):
            head = (
                b"POST /v1/models/twin/topk HTTP/1.1\r\nHost: localhost\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
            )
            sock.sendall(head + body)
            status = int(reader.readline().split(b" ", 2)[1])
            length = 0
            while (line := reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            reader.read(length)
            assert status == expected


@pytest.mark.parametrize(
    ("header", "value"),
    [("content-type", "application/" + "x" * 20000), ("accept", "text/" + "y" * 20000)],
)
def test_long_media_types_are_refused_without_being_echoed(
    url: str, header: str, value: str
) -> None:
    answer = httpx.post(
        f"{url}/v1/models/twin/topk",
        content=json.dumps({"hidden_states": _rows(1).tolist()}),
        headers={header: value[:3000]},
    )
    assert answer.status_code in (406, 415)
    assert len(answer.text) < 400


def test_a_number_beyond_float_range_is_422(url: str) -> None:
    body = b'{"hidden_states": [[1e999' + b", 0.5" * (D_MODEL - 1) + b"]]}"
    answer = httpx.post(
        f"{url}/v1/models/twin/topk", content=body, headers={"content-type": "application/json"}
    )
    assert answer.status_code == 422
    assert "beyond float range" in answer.json()["error"]["message"]


def _answers(url: str, raw: bytes) -> list[int]:
    """Every status answered on one connection to ``raw`` (sent at once), until it closes."""
    host, port = url.removeprefix("http://").split(":")
    data = b""
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(raw)
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(1 << 16):
                data += chunk
    return [int(line.split(b" ")[1]) for line in re.findall(rb"HTTP/1\.1 \d{3}", data)]


def test_a_pipelining_flood_is_cut_off_and_others_are_served(url: str) -> None:
    """uvicorn queued every pipelined request it read (one client: 129k queued, +600 MB in
    10 s); past 32 waiting, the requests read are answered, then a 503, and the connection
    closes; other clients are served."""
    one = b"GET /health/live HTTP/1.1\r\nHost: localhost\r\n\r\n"
    last = b"GET /health/live HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    statuses = _answers(url, one * 400 + last)
    assert len(statuses) <= 35  # the one running, 33 read ahead, the refusal
    assert set(statuses[:-1]) == {200}
    assert statuses[-1] == 503  # once the requests read before it are answered
    assert httpx.get(f"{url}/health/live").status_code == 200


def test_a_refusal_is_never_read_as_an_earlier_requests_answer(url: str) -> None:
    """Behind a request still unanswered, a refusal waits for its answer (the 431 was read as
    the first request's answer; then the connection closed without it); after an answer, a
    head that stalls is a 408 (it was closed without one). A request httptools cannot parse
    behind a valid one: the valid one's answer, then a JSON 400 (uvicorn wrote a text 400 at
    once, and the valid answer was lost)."""
    first = b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n"
    oversized = (
        b"GET /health/live HTTP/1.1\r\nHost: localhost\r\nX-Pad: " + b"a" * 8000 + b"\r\n\r\n"
    )
    assert _answers(url, first + oversized) == [200, 431]
    broken = (
        b"POST /v1/models/tied/topk HTTP/1.1\r\nHost: localhost\r\n"
        b"Transfer-Encoding: chunked\r\n\r\nzz\r\n"
    )
    assert _answers(url, first + broken) == [200, 400]
    assert _answers(url, first + b"BROKEN LINE\r\n\r\n") == [200, 400]
    assert _answers(url, b"GET /health/live HTTP/1.1\r\nHost: localhost\r\n\r\nGET /he") == [
        200,
        408,
    ]


def test_http_framing_refusals_are_json_and_keep_no_stale_state(url: str) -> None:
    """RFC 9110/9112 cases a probe found answered wrongly: transfer codings other than
    chunked were ignored (a gzip body read as text), HTTP/1.1 without Host was served, HEAD
    was 405, a trailing slash was a 307 to the client's own Host, and a 413 to a client
    waiting for ``100 Continue`` kept the connection open, so its next request was read as
    the refused body (now closed, and said so in ``connection: close``)."""
    one = b"\r\nContent-Type: application/json\r\n"
    gzip = (
        b"POST /v1/models/tied/topk HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: gzip, chunked"
    )
    status, body, closed = _exchange(url, gzip + one + b"\r\n0\r\n\r\n")
    assert (status, orjson.loads(body)["error"]["code"], closed) == (501, "not_implemented", True)
    status, body, closed = _exchange(url, b"GET /health/live HTTP/1.1\r\n\r\n")
    assert (status, orjson.loads(body)["error"]["code"], closed) == (400, "malformed_request", True)
    status, body, closed = _exchange(url, b"BREW / HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert status == 400
    assert orjson.loads(body)["error"]["message"].startswith("malformed HTTP request")
    head = httpx.head(f"{url}/v1/models")
    assert (head.status_code, head.content) == (200, b"")
    assert int(head.headers["content-length"]) == len(httpx.get(f"{url}/v1/models").content)
    slash = httpx.post(f"{url}/v1/models/tied/topk/", json={"hidden_states": _rows(1).tolist()})
    assert (slash.status_code, slash.json()["error"]["code"]) == (404, "not_found")
    assert httpx.get(f"{url}/v1/models/tied%0a").status_code == 400
    expecting = (
        b"POST /v1/models/tied/topk HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/json\r\n"
        b"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n" % (64 * 2**20)
    )
    raw_head, body, closed = _exchange_head(url, expecting)
    assert (raw_head.split(b" ", 2)[1], closed) == (b"413", True)
    assert b"\r\nconnection: close" in raw_head.lower()  # the client is told, not just cut off
    assert "LMHEAD_MAX_BODY_BYTES" in orjson.loads(body)["error"]["message"]
    unknown = expecting.replace(b"/topk", b"/nothing").replace(b"%d" % (64 * 2**20), b"100")
    raw_head, body, closed = _exchange_head(url, unknown)  # any answer given before the body
    assert (raw_head.split(b" ", 2)[1], closed) == (b"404", True)
    assert b"\r\nconnection: close" in raw_head.lower()


def test_a_body_refused_after_100_continue_keeps_the_connection(url: str) -> None:
    """Once ``100 Continue`` went out the client sends its body, so an answer given before
    the body's end (413 past the limit) keeps the connection like any other request, and
    the rest is absorbed (it was closed without a word while the client still sent)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/models/tied/topk HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Type: application/json"
            b"\r\nTransfer-Encoding: chunked\r\nExpect: 100-continue\r\n\r\n"
        )
        assert sock.recv(64).startswith(b"HTTP/1.1 100 Continue")
        for _ in range(5):  # 5 MiB of a body whose limit is 4 MiB
            sock.sendall(b"%x\r\n%s\r\n" % (2**20, b" " * 2**20))
        buffered = b""
        while b"\r\n\r\n" not in buffered:
            buffered += sock.recv(65536)
        head = buffered.partition(b"\r\n\r\n")[0].lower()
        assert head.startswith(b"http/1.1 413")
        assert b"connection: close" not in head
        sock.sendall(b"0\r\n\r\nGET /health/live HTTP/1.1\r\nHost: localhost\r\n\r\n")
        while buffered.count(b"HTTP/1.1 ") < 2 or not buffered.endswith(b"}"):
            chunk = sock.recv(65536)
            assert chunk, "the connection was closed"
            buffered += chunk
        assert buffered.rpartition(b"HTTP/1.1 ")[2].startswith(b"200 OK")


def _npy(array: npt.NDArray[np.float32]) -> bytes:
    stream = io.BytesIO()
    np.save(stream, array)
    return stream.getvalue()


def test_an_answer_never_read_keeps_its_budget_until_the_client_is_dropped(
    repository: Path,
) -> None:
    """An answer a client does not read sat in the server's write buffer, outside the
    in-flight budget and with no timeout (+250 MB per client, for ever). It now keeps its
    request's share of the budget until it leaves, and a client reading none of it for
    ``body_timeout_s`` is dropped."""
    settings = {
        **LIMITS,
        "max_rows": "8000",
        "max_logits_bytes": str(2**27),
        "max_inflight_bytes": str(100 * 2**20),  # one answer's declared ~69 MB, not two
        "body_timeout_s": "1",
    }
    body = _npy(_rows(8000, seed=5))
    head = (
        b"POST /v1/models/tied/logits HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/x-npy\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    with running_server(repository, **settings) as url, socket.socket() as stalled:
        host, port = url.removeprefix("http://").split(":")
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect((host, int(port)))
        stalled.sendall(head + body)
        select.select([stalled], [], [], 30)  # the answer is written: its first bytes came
        busy = httpx.post(f"{url}/v1/models/tied/logits", content=body, headers=NPY, timeout=30)
        assert (busy.status_code, busy.json()["error"]["code"]) == (503, "server_busy")

        def served() -> int | None:
            answer = httpx.post(f"{url}/v1/models/tied/logits", content=body, headers=NPY)
            return answer.status_code if answer.status_code == 200 else None

        # the stalled client is dropped, and its share comes back
        assert poll(served, "the unread answer's budget back", timeout_s=30) == 200
        received = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := stalled.recv(1 << 20):
                received += chunk
        assert len(received) < 8000 * VOCAB * 4  # it never got the whole answer


def test_a_body_trickling_in_is_408(url: str) -> None:
    """Re-armed at every read, the body timer let one byte every 20 s hold a connection for
    ever (40 such clients took every slot of a cap of 40)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/models/tied/topk HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Type: application/json\r\n"
            b"Content-Length: 100000\r\n\r\n"
        )
        data, deadline = b"", time.monotonic() + 10  # the timeout is 1 s
        while b"\r\n\r\n" not in data and time.monotonic() < deadline:
            # a byte every 0.2 s: ~5 per 1 s window, under the 1024 a window must bring
            readable, _, _ = select.select([sock], [], [], 0.2)
            if readable:
                data += sock.recv(65536)
            else:
                sock.sendall(b" ")
    assert data.startswith(b"HTTP/1.1 408")


def test_pipelined_posts_past_the_limit_are_answered_then_refused(url: str) -> None:
    """The refused request stayed queued, its body never delivered: the connection and a
    task hung for good once the requests before it were answered."""
    body = orjson.dumps({"hidden_states": _rows(1).tolist()})
    one = (
        b"POST /v1/models/tied/topk HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    ) + body
    statuses = _answers(url, one * 40)
    assert set(statuses[:-1]) == {200}
    assert statuses[-1] == 503


def test_an_upgrade_request_ends_the_connection_after_its_answer(url: str) -> None:
    """httptools stops at an Upgrade request's head: its body was then read as a next request
    (a request smuggled behind a proxy that reuses connections), or the request served without
    it; one with a body is refused, one without is answered and the connection closed."""
    smuggled = b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n"
    upgrade = (
        b"POST /v1/models/tied/topk HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade\r\n"
        b"Upgrade: foo\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        % len(smuggled)
    )
    assert _answers(url, upgrade + smuggled) == [400]  # served without its body, before
    status, refused, closed = _exchange(url, upgrade + smuggled)
    assert (status, closed) == (400, True)
    assert "without Upgrade" in orjson.loads(refused)["error"]["message"]
    gzip = (
        b"POST /v1/models/tied/topk HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: gzip\r\n\r\n"
    )
    assert _answers(url, gzip) == [501]  # httptools' own refusal of it came first (400)


def test_a_refusal_behind_a_long_answer_waits_for_all_of_it(repository: Path) -> None:
    """The deferred refusal's backstop aborted the connection ``body_timeout_s`` after it was
    decided: an earlier answer still being read (at a good rate) was cut short."""
    settings = {
        **LIMITS,
        "max_logits_bytes": str(2**25),
        "max_body_bytes": str(2**20),
        "max_inflight_bytes": str(2**26),  # the answer's declared cost, ~16 MB
        # A 3 s window: the reader below keeps 6x the floor (1 MiB a window) over ~8 s, and a
        # stall of a loaded machine's scheduler has to last windows, not one second, to drop it
        "body_timeout_s": "3",
    }
    body = _npy(_rows(4096, seed=6))
    valid = (
        b"POST /v1/models/tied/logits HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/x-npy\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    ) + body
    expected = 4096 * VOCAB * 4
    with running_server(repository, **settings) as url, socket.socket() as client:
        host, port = url.removeprefix("http://").split(":")
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        client.connect((host, int(port)))
        client.sendall(valid + b"GARBAGE\r\n\r\n")
        data, deadline = b"", time.monotonic() + 60
        # ~2 MB/s: ~8 s for the answer, past the 3 s backstop (at 1 s windows, a loaded
        # 2-core machine's pauses cut the reader short twice in three full runs)
        while time.monotonic() < deadline:
            chunk = client.recv(65536)
            if not chunk:
                break
            data += chunk
            time.sleep(0.03)
    assert data.count(b"HTTP/1.1 200") == 1
    assert len(data) > expected  # the whole answer came
    assert b"HTTP/1.1 400" in data[expected:]  # then the refusal, then the close
