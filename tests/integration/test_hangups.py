"""Clients that hang up cost the engine no more than the runs already started for them: a
request whose client has gone (an HTTP disconnect, a gRPC cancel or deadline) is dropped
where it stands, on one process and through the fronts of LMHEAD_WORKERS > 1.

Rows computed are read from ``lmhead_batch_rows`` (the sum of every run's rows). Each request
here is 4096 rows, which the service runs in chunks of 16 (the logits byte limit below), one
run at a time (one inference thread): all of them used to be computed for nobody.

Two bounds: once the service has counted the calls cancelled (``lmhead_requests_total``
with outcome ``cancelled``, counted where the call's rows leave the queue), at most the runs
started or chained then: one chunk of each call, and one more; and between the hang-up and
that count, a small part of what the calls asked for. Rows computed while the test itself
reads the metrics and closes its sockets are the clients' (they are still there): counting
from before the close failed on a loaded machine (22 runs in a scrape's round trip).
"""

from __future__ import annotations

import io
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from service.heads.files import HeadWeights, save_head
from tests.server import free_port, metric, metric_in, poll, running_server

VOCAB, D_MODEL = 16000, 256
CHUNK = 16  # rows per run: LMHEAD_MAX_LOGITS_BYTES / (2 x vocab x 4 bytes)
ROWS = 4096
CLIENTS = 4
SETTINGS = {
    "max_logits_bytes": str(2 * VOCAB * 4 * CHUNK),
    "inference_threads": "1",
    "max_rows": str(ROWS),
    "max_queue_rows": str(4 * ROWS),
    "max_body_bytes": str(8 * 2**20),
}


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hangups")
    table = np.random.default_rng(3).standard_normal((VOCAB, D_MODEL), dtype=np.float32)
    save_head(HeadWeights.from_arrays(table), root / "big" / "1")
    return root


def _npy(rows: int) -> bytes:
    buffer = io.BytesIO()
    hidden = np.random.default_rng(rows).standard_normal((rows, D_MODEL), dtype=np.float32)
    np.save(buffer, hidden)
    return buffer.getvalue()


def _computed(url: str) -> float:
    return metric(url, "lmhead_batch_rows_sum", model="big")


def _settled(url: str) -> float:
    """Rows computed once nothing is in flight and every started run has been answered: with
    one inference thread, a small request's answer comes after every run started before it."""
    poll(lambda: metric(url, "lmhead_requests_in_flight") == 0 or None, "no request in flight")
    answer = httpx.post(f"{url}/v1/models/big/topk", json={"hidden_states": [[0.0] * D_MODEL]})
    assert answer.status_code == 200
    return _computed(url) - 1


def _send(url: str, body: bytes) -> socket.socket:
    """A whole request sent on a new connection, its answer not read."""
    host, port = url.removeprefix("http://").split(":")
    head = (
        f"POST /v1/models/big/topk HTTP/1.1\r\nHost: localhost\r\n"
        f"Content-Type: application/x-npy\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    connection = socket.create_connection((host, int(port)))
    connection.sendall(head + body)
    return connection


def _seen_gone(url: str, before: float, calls: int) -> float:
    """Once the service has counted ``calls`` more calls cancelled than ``before``: the rows
    computed, read from the same scrape (the rows of that moment or later, so rows counted
    after it were computed after the hang-ups were seen)."""

    def scrape() -> float | None:
        text = httpx.get(f"{url}/metrics").text
        gone = metric_in(text, "lmhead_requests_total", outcome="cancelled", model="big")
        if gone < before + calls:
            return None
        return metric_in(text, "lmhead_batch_rows_sum", model="big")

    return poll(scrape, "the hang-ups counted")


def _cancelled(url: str) -> float:
    return metric(url, "lmhead_requests_total", outcome="cancelled", model="big")


def _check_stopped(url: str, at_gone: float, at_seen: float, calls: int) -> None:
    """Rows computed once the service saw the calls go: the runs started (or chained) then,
    one chunk of each at most; since they went (``at_gone``), a small part of the asked."""
    settled = _settled(url)
    after = settled - at_seen
    assert after <= 2 * calls * CHUNK, f"{after:.0f} rows computed after the calls went"
    asked = calls * ROWS
    assert settled - at_gone < asked / 4, f"{settled - at_gone:.0f} of {asked} rows run"


def _in_flight(url: str, calls: int) -> float:
    """Once ``calls`` requests are being served: the rows computed so far."""
    poll(lambda: metric(url, "lmhead_requests_in_flight") >= calls or None, "calls in flight")
    return _computed(url)


@pytest.fixture(scope="module", params=["one process", "two fronts"])
def served(request: pytest.FixtureRequest, repository: Path) -> Iterator[tuple[str, str]]:
    port = free_port()
    workers = "2" if request.param == "two fronts" else "1"
    with running_server(repository, workers=workers, grpc_port=str(port), **SETTINGS) as url:
        yield url, f"127.0.0.1:{port}"


def test_rows_of_clients_that_hung_up_are_not_computed(served: tuple[str, str]) -> None:
    """The probe's clients: 4096-row requests whose clients close once they are served."""
    url, _ = served
    _settled(url)
    gone = _cancelled(url)
    body = _npy(ROWS)
    connections = [_send(url, body) for _ in range(CLIENTS)]
    at_hang_up = _in_flight(url, CLIENTS)
    for connection in connections:
        connection.close()
    _check_stopped(url, at_hang_up, _seen_gone(url, gone, CLIENTS), CLIENTS)
    assert metric(url, "lmhead_http_requests_total", status="499") >= CLIENTS


def test_cancelled_grpc_calls_are_not_computed(served: tuple[str, str]) -> None:
    """The probe's gRPC storm: calls cancelled by their clients while they are served."""
    url, address = served
    _settled(url)
    hidden = np.random.default_rng(1).standard_normal((ROWS, D_MODEL), dtype=np.float32)
    tensor = pb.ModelInferRequest.InferInputTensor(
        name="hidden_states", datatype="FP32", shape=[ROWS, D_MODEL]
    )
    request = pb.ModelInferRequest(
        model_name="big", inputs=[tensor], raw_input_contents=[hidden.tobytes()]
    )
    calls = 8
    size = [("grpc.max_send_message_length", 16 * 2**20)]
    gone = _cancelled(url)
    with grpc.insecure_channel(address, options=size) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        futures = [stub.ModelInfer.future(request) for _ in range(calls)]
        at_cancel = _in_flight(url, calls)
        for future in futures:
            future.cancel()
        at_seen = _seen_gone(url, gone, calls)
    _check_stopped(url, at_cancel, at_seen, calls)
