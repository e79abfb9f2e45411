"""``LMHEAD_WORKERS`` > 1: front processes feeding one engine, against real servers.

Answers equal the numpy reference through 1, 2 and 3 fronts (native, V2 binary and gRPC);
only the engine holds onnxruntime and the heads, and it maps one request arena per front; the
limits answer exactly as one process does (the connection cap counts every front's); metrics
sum over the processes; swaps under load fail nothing; a killed front is replaced without
touching the engine; a killed engine fails readiness, then comes back; SIGTERM drains every
front and leaves no process and no shared memory behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import numpy.typing as npt
import psutil
import pytest

from service.client import Client
from service.errors import ServiceError
from service.heads.files import HeadWeights, save_head
from service.heads.reference import log_softmax, top_k
from service.tools.demo import demo_tokens
from tests.conftest import D_MODEL, VOCAB, reference_logits
from tests.server import (
    free_port,
    live_server,
    metric,
    poll,
    running_script,
    running_server,
    server_process,
)

HIDDEN = np.random.default_rng(20).standard_normal((5, D_MODEL)).astype(np.float32)
RTOL, ATOL = 1e-4, 1e-4
TOKENS = demo_tokens(VOCAB)
TOKEN = "workers-admin-token"
LIMITS = {  # one run takes 8 rows (logits and log-softmax within the byte limit)
    "max_rows": "40",
    "max_queue_rows": "40",
    "max_body_bytes": str(64 * 1024),
    "max_logits_bytes": str(16 * VOCAB * 4),
}


@pytest.fixture(scope="module")
def two(repository: Path) -> Iterator[str]:
    """Two fronts, the limits above and an admin token."""
    with running_server(repository, workers="2", admin_token=TOKEN, **LIMITS) as url:
        _all_fronts_connected(url, 2)
        yield url


@dataclass
class Tree:
    supervisor: psutil.Process
    engine: psutil.Process
    fronts: list[psutil.Process]


def tree(url: str) -> Tree:
    supervisor = server_process(url)
    children = supervisor.children(recursive=True)
    (engine,) = [p for p in children if p.name() == "lmhead-engine"]
    fronts = [p for p in children if p.name() == "lmhead-front"]
    return Tree(supervisor, engine, fronts)


def memfds(process: psutil.Process, name: str) -> set[str]:
    """The inodes of the shared-memory files named ``name`` that a process maps."""
    maps = Path(f"/proc/{process.pid}/maps").read_text().splitlines()
    return {line.split()[4] for line in maps if f"memfd:{name}" in line}


def maps_onnxruntime(process: psutil.Process) -> bool:
    return "onnxruntime" in Path(f"/proc/{process.pid}/maps").read_text()


def check_answers(url: str, repository: Path) -> None:
    """Top-k (npy and JSON), logits and embeddings of both heads equal the reference."""
    for model in ("tied", "untied"):
        logits = reference_logits(repository / model / "1", HIDDEN)
        values, ids = top_k(logits, 4)
        for binary in (True, False):
            with Client(url, binary=binary) as client:
                top = client.topk(model, HIDDEN, k=4, logprobs=True)
            assert (top.model, top.version, top.tied) == (model, 1, model == "tied")
            np.testing.assert_array_equal(top.token_ids, ids)
            np.testing.assert_allclose(top.logits, values, rtol=RTOL, atol=ATOL)
            assert top.logprobs is not None
            want = np.take_along_axis(log_softmax(logits), ids, axis=1)
            np.testing.assert_allclose(top.logprobs, want, rtol=RTOL, atol=ATOL)
        with Client(url) as client:  # strings looked up by the front from the engine's table
            named = client.topk(model, HIDDEN, k=4, tokens=True).tokens
            full = client.logits(model, HIDDEN).array
            embedded = client.embed(model, np.array([0, 7, VOCAB - 1])).array
        if model == "tied":
            assert named == [[TOKENS[i] for i in row] for row in ids.tolist()]
        np.testing.assert_allclose(full, logits, rtol=RTOL, atol=ATOL)
        assert embedded.shape == (3, D_MODEL)


@pytest.mark.parametrize("workers", [1, 3])
def test_answers_equal_the_reference(repository: Path, workers: int) -> None:
    with running_server(repository, workers=str(workers), front_nice="19") as url:
        if workers > 1:
            _all_fronts_connected(url, workers)
            processes = tree(url)  # LMHEAD_FRONT_NICE=19: the runs get the cores first
            assert [front.nice() for front in processes.fronts] == [19] * workers
        check_answers(url, repository)


def test_two_fronts_one_engine_holding_the_heads(two: str, repository: Path) -> None:
    """Only the engine loads onnxruntime; it maps each front's request arena, and each front
    maps its own and the answer arena the engine made for it. The fronts run at the
    engine's priority unless ``LMHEAD_FRONT_NICE`` says otherwise."""
    check_answers(two, repository)
    processes = tree(two)
    assert len(processes.fronts) == 2
    nice = processes.engine.nice()  # LMHEAD_FRONT_NICE=0 (the default): as the engine
    assert [front.nice() for front in processes.fronts] == [nice] * 2
    assert maps_onnxruntime(processes.engine)
    assert not any(maps_onnxruntime(front) for front in processes.fronts)
    front_arenas = set().union(*(memfds(f, "lmhead-requests") for f in processes.fronts))
    assert memfds(processes.engine, "lmhead-requests") == front_arenas
    assert len(front_arenas) == 2
    for front in processes.fronts:
        assert len(memfds(front, "lmhead-answers")) == 1
    assert metric(two, "lmhead_model_loads_total", model="tied", outcome="published") == 1


def test_fronts_of_the_lmhead_script_load_no_onnxruntime(repository: Path) -> None:
    """multiprocessing's spawn runs the ``lmhead`` script again in each front (``python -m
    service`` is exempt): its imports had every front map onnxruntime and onnx (front RSS
    ~99 MB)."""
    with running_script(repository, workers="2") as url:
        _all_fronts_connected(url, 2)
        processes = tree(url)
        check_answers(url, repository)
        assert maps_onnxruntime(processes.engine)
        for front in processes.fronts:
            maps = Path(f"/proc/{front.pid}/maps").read_text()
            assert "onnxruntime" not in maps
            assert "onnx_cpp2py_export" not in maps


def test_v2_binary_over_two_fronts(two: str, repository: Path) -> None:
    header = b'{"inputs":[{"name":"hidden_states","shape":[5,%d],"datatype":"FP32",' % D_MODEL
    header += b'"parameters":{"binary_data_size":%d}}],' % HIDDEN.nbytes
    header += b'"outputs":[{"name":"topk_token_ids","parameters":{"binary_data":true}}],'
    header += b'"parameters":{"k":3}}'
    answer = httpx.post(
        f"{two}/v2/models/untied/infer",
        content=header + HIDDEN.tobytes(),
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert answer.status_code == 200, answer.text
    length = int(answer.headers["Inference-Header-Content-Length"])
    ids = np.frombuffer(answer.content[length:], dtype=np.int64).reshape(5, 3)
    want = top_k(reference_logits(repository / "untied" / "1", HIDDEN), 3)[1]
    np.testing.assert_array_equal(ids, want)


def _bad_requests(url: str) -> list[tuple[int, object, str | None]]:
    """Requests each limit refuses; status, JSON body and Retry-After of each answer."""
    rows = np.zeros((41, D_MODEL), np.float32).tolist()
    v2_hidden = {
        "name": "hidden_states",
        "shape": [1, D_MODEL],
        "datatype": "FP32",
        "data": rows[0],
    }
    sent = [
        ("/v1/models/tied/topk", {"hidden_states": rows}),  # rows
        ("/v1/models/tied/logits", {"hidden_states": rows[:20]}),  # logits bytes
        ("/v1/models/tied/topk", {"hidden_states": [[0.5] * 20000]}),  # body bytes
        ("/v1/models/tied/topk", {"hidden_states": [[1.0] * 3]}),  # shape
        ("/v1/models/tied/topk", {"hidden_states": rows[:1], "temperature": 1e-9}),
        ("/v1/models/nope/topk", {"hidden_states": rows[:1]}),
        ("/v1/models/tied/embed", {"input_ids": [VOCAB]}),
        ("/v2/models/tied/versions/7/infer", {"inputs": [v2_hidden]}),
        ("/v2/models/tied/infer", {"inputs": []}),
    ]
    answers = []
    for path, body in sent:
        answer = httpx.post(url + path, json=body)
        answers.append((answer.status_code, answer.json(), answer.headers.get("retry-after")))
    return answers


def test_limits_answer_as_one_process(two: str, repository: Path) -> None:
    with running_server(repository, admin_token=TOKEN, **LIMITS) as one:
        expected = _bad_requests(one)
    answers = _bad_requests(two)
    assert [status for status, _, _ in answers] == [
        413,
        413,
        413,
        422,
        422,
        404,
        422,
        404,
        400,
    ]
    assert answers == expected


def test_the_connection_cap_holds_for_all_fronts_together(repository: Path) -> None:
    """``LMHEAD_MAX_CONNECTIONS`` caps every front's connections together, as it caps one
    process's: connections opened one after another (each asks once, then stays open) get 200
    up to the cap and 503 beyond it, whichever of the 3 fronts the kernel hands them to."""
    with running_server(repository, workers="3", max_connections="4") as url:
        _all_fronts_connected(url, 3)
        statuses = poll(lambda: _open_in_turn(url, 12), "4 connections served once idle")
        assert statuses == [200] * 4 + [503] * 8
        with Client(url) as client:  # the 4 closed: their places are free again
            assert poll(lambda: client.models() or None, "a connection after they closed")


def _open_in_turn(url: str, count: int) -> list[int] | None:
    """Open ``count`` connections one by one, each asking for liveness; the statuses, or None
    when one of the first 4 was refused (the readiness probes' connections still closing)."""
    host, port = url.removeprefix("http://").split(":")
    opened: list[socket.socket] = []
    statuses: list[int] = []
    try:
        for _ in range(count):
            opened.append(socket.create_connection((host, int(port)), timeout=10))
            opened[-1].sendall(b"GET /health/live HTTP/1.1\r\nHost: localhost\r\n\r\n")
            statuses.append(int(opened[-1].recv(65536).split(b" ", 2)[1]))
            if len(statuses) <= 4 and statuses[-1] != 200:
                return None
        return statuses
    finally:
        for sock in opened:
            sock.close()


def test_metrics_sum_over_every_process(two: str) -> None:
    before = metric(two, "lmhead_requests_total", model="untied", verb="topk", outcome="ok")
    http_before = metric(two, "lmhead_http_requests_total", endpoint="/v1/models/{name}/topk")
    for _ in range(12):  # a fresh connection each: they land on both fronts
        with Client(two) as client:
            client.topk("untied", HIDDEN[:1])
    after = metric(two, "lmhead_requests_total", model="untied", verb="topk", outcome="ok")
    http_after = metric(two, "lmhead_http_requests_total", endpoint="/v1/models/{name}/topk")
    assert (after - before, http_after - http_before) == (12, 12)
    assert metric(two, "lmhead_model_loaded", model="tied") == 1
    assert metric(two, "lmhead_requests_in_flight") == 0


def test_concurrent_calls_each_get_their_own_answer_or_error(two: str, repository: Path) -> None:
    """Calls a front sends the engine together are served as one where they can be: each
    still gets its own rows' answer, or its own 422, and its own metric."""
    rows = np.random.default_rng(21).standard_normal((4, D_MODEL)).astype(np.float32)
    bodies: list[dict[str, object]] = [{"hidden_states": [row.tolist()], "k": 4} for row in rows]
    bodies.insert(1, {"hidden_states": [[1e39] + [0.0] * (D_MODEL - 1)], "k": 4})
    bodies.insert(3, {"hidden_states": [[0.5] * (D_MODEL - 1)], "k": 4})
    labels = {"model": "untied", "verb": "topk"}
    before = {
        o: metric(two, "lmhead_requests_total", outcome=o, **labels)
        for o in ("ok", "invalid_input")
    }

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(
            base_url=two, limits=httpx.Limits(max_connections=8)
        ) as client:
            path = "/v1/models/untied/topk"
            return list(await asyncio.gather(*(client.post(path, json=body) for body in bodies)))

    answers = asyncio.run(burst())
    assert [answer.status_code for answer in answers] == [200, 422, 200, 422, 200, 200]
    assert "NaN, Inf or null" in answers[1].json()["error"]["message"]
    assert f"d_model={D_MODEL}" in answers[3].json()["error"]["message"]
    ids = top_k(reference_logits(repository / "untied" / "1", rows), 4)[1]
    served = [a.json()["results"][0]["token_ids"] for a in answers if a.status_code == 200]
    np.testing.assert_array_equal(np.array(served), ids)
    after = {
        o: metric(two, "lmhead_requests_total", outcome=o, **labels)
        for o in ("ok", "invalid_input")
    }
    assert {o: after[o] - before[o] for o in after} == {"ok": 4, "invalid_input": 2}
    assert metric(two, "lmhead_requests_in_flight") == 0


def test_concurrent_v2_calls_each_get_their_own_answer_or_error(two: str, repository: Path) -> None:
    """V2 infer calls a front sends together are served as one too: each its own answer."""
    rows = np.random.default_rng(22).standard_normal((3, D_MODEL)).astype(np.float32)
    datas = [row.tolist() for row in rows]
    datas.insert(1, [1e39] + [0.5] * (D_MODEL - 1))  # beyond float32: refused by the engine

    def body(data: list[float]) -> dict[str, object]:
        shape = [1, len(data)]
        tensor = {"name": "hidden_states", "shape": shape, "datatype": "FP32", "data": data}
        return {"inputs": [tensor], "parameters": {"k": 3}}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=two) as client:
            calls = [client.post("/v2/models/untied/infer", json=body(d)) for d in datas]
            return list(await asyncio.gather(*calls))

    answers = asyncio.run(burst())
    assert [answer.status_code for answer in answers] == [200, 400, 200, 200]  # V2: 400
    assert "NaN, Inf or null" in answers[1].json()["error"]
    ids = top_k(reference_logits(repository / "untied" / "1", rows), 3)[1]
    served = []
    for answer in (a for a in answers if a.status_code == 200):
        (output,) = [o for o in answer.json()["outputs"] if o["name"] == "topk_token_ids"]
        served.append(output["data"])
    np.testing.assert_array_equal(np.array(served), ids)


def test_control_api_and_its_token_through_the_fronts(two: str) -> None:
    with Client(two) as anonymous, pytest.raises(ServiceError, match="admin token"):
        anonymous.load("untied")
    with Client(two, token=TOKEN) as admin:
        assert admin.load("untied")["state"] == "READY"
        versions = {admin.topk("untied", HIDDEN[:1]).version for _ in range(6)}
    assert versions == {1}


@dataclass
class Traffic:
    answers: list[tuple[int, npt.NDArray[np.int64]]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)


def _send(url: str, traffic: Traffic, rows: npt.NDArray[np.float32], retries: int) -> None:
    with Client(url, retries=retries, backoff_s=0.05) as client:
        for _ in range(2000):  # bounded; the test stops it well before
            if traffic.stop.is_set():
                return
            try:
                top = client.topk("head", rows, k=3)
            except (ServiceError, httpx.TransportError) as error:
                traffic.failures.append(f"{type(error).__name__}: {error}")
                continue
            traffic.answers.append((top.version, top.token_ids))


def _publish(root: Path, version: int, tied: bool) -> npt.NDArray[np.int64]:
    rng = np.random.default_rng(version)
    table = rng.standard_normal((VOCAB, D_MODEL)).astype(np.float32)
    output = None if tied else rng.standard_normal((VOCAB, D_MODEL)).astype(np.float32)
    save_head(HeadWeights.from_arrays(table, output), root / "head" / ".incoming")
    (root / "head" / ".incoming").rename(root / "head" / str(version))
    return np.asarray(top_k(reference_logits(root / "head" / str(version), HIDDEN), 3)[1])


@pytest.fixture
def head(tmp_path: Path) -> tuple[Path, dict[int, npt.NDArray[np.int64]]]:
    return tmp_path, {1: _publish(tmp_path, 1, tied=True)}


def test_swaps_under_load_fail_nothing(
    head: tuple[Path, dict[int, npt.NDArray[np.int64]]],
) -> None:
    root, expected = head
    traffic = Traffic()
    with running_server(root, workers="2") as url:
        clients = [threading.Thread(target=_send, args=(url, traffic, HIDDEN, 0)) for _ in range(4)]
        for thread in clients:
            thread.start()
        with Client(url) as admin:
            for version, tied in ((2, False), (3, True)):
                least = 20 * version
                poll(lambda: len(traffic.answers) > least or None, "traffic")  # noqa: B023
                expected[version] = _publish(root, version, tied)
                assert admin.load("head")["versions"] == [version]
            seen = len(traffic.answers)
            poll(lambda: len(traffic.answers) > seen + 20 or None, "traffic after the swaps")
        traffic.stop.set()
        for thread in clients:
            thread.join()
    assert traffic.failures == []
    assert {version for version, _ in traffic.answers} == {1, 2, 3}
    for version, ids in traffic.answers:
        np.testing.assert_array_equal(ids, expected[version])
    assert traffic.answers[-1][0] == 3


def test_a_killed_front_is_replaced_and_the_engine_untouched(
    head: tuple[Path, dict[int, npt.NDArray[np.int64]]],
) -> None:
    root, expected = head
    traffic = Traffic()
    with running_server(root, workers="2") as url:
        before = _all_fronts_connected(url, 2)
        clients = [threading.Thread(target=_send, args=(url, traffic, HIDDEN, 5)) for _ in range(4)]
        for thread in clients:
            thread.start()
        poll(lambda: len(traffic.answers) > 50 or None, "traffic")
        victim = before.fronts[0]
        victim.kill()
        victim.wait(10)
        replaced = poll(lambda: _replaced(url, victim.pid), "a new front")
        count = len(traffic.answers)
        poll(lambda: len(traffic.answers) > count + 50 or None, "traffic after the restart")
        traffic.stop.set()
        for thread in clients:
            thread.join()
        assert replaced.engine.pid == before.engine.pid
        assert replaced.engine.create_time() == before.engine.create_time()
        assert metric(url, "lmhead_model_loads_total", model="head") == 1
        live = set().union(*(memfds(front, "lmhead-requests") for front in replaced.fronts))
        poll(lambda: memfds(replaced.engine, "lmhead-requests") == live or None, "unmapped")
    assert traffic.failures == []
    for version, ids in traffic.answers:
        np.testing.assert_array_equal(ids, expected[version])


def _all_fronts_connected(url: str, workers: int) -> Tree:
    """Once every front has handed its arena to the engine (each maps one): all serve."""

    def connected() -> Tree | None:
        processes = tree(url)
        arenas = memfds(processes.engine, "lmhead-requests")
        return processes if len(processes.fronts) == len(arenas) == workers else None

    return poll(connected, "every front connected")


def _replaced(url: str, dead: int) -> Tree | None:
    processes = tree(url)
    pids = [front.pid for front in processes.fronts]
    return processes if len(pids) == 2 and dead not in pids else None


def test_a_killed_engine_fails_readiness_then_comes_back(
    head: tuple[Path, dict[int, npt.NDArray[np.int64]]],
) -> None:
    root, expected = head
    with live_server(root, workers="2") as (url, log):
        poll(lambda: _ready(url), "ready")
        engine = _all_fronts_connected(url, 2).engine  # else one still starting hides the gap
        engine.kill()
        engine.wait(10)
        seen: list[int] = []
        try:
            refused = poll(lambda: _not_ready(url, seen), "readiness failing")
        except AssertionError as error:
            raise AssertionError(f"{error}; statuses {seen[:5]}...; log:\n{log()}") from None
        assert refused["error"]["code"] == "model_not_ready"
        assert "engine" in refused["error"]["message"]
        poll(lambda: _ready(url), "ready again")
        assert tree(url).engine.pid != engine.pid
        with Client(url) as client:
            np.testing.assert_array_equal(client.topk("head", HIDDEN, k=3).token_ids, expected[1])


def test_a_frozen_engine_fails_readiness_in_bounded_time(two: str) -> None:
    engine = tree(two).engine
    engine.suspend()  # alive to the supervisor, answering nothing
    try:
        answer = httpx.get(f"{two}/health/ready", timeout=30)
        assert answer.status_code == 503
        assert "engine process has not answered" in answer.json()["error"]["message"]
    finally:
        engine.resume()
    poll(lambda: _ready(two), "ready again")


def test_a_restarted_engine_serves_what_the_control_api_left(tmp_path: Path) -> None:
    """Loads, pins and unloads made through the control API outlive the engine: the one
    started after it serves the pinned tied version 1 (not the untied 2 on disk), keeps the
    unloaded model unloaded, and loads what was loaded by hand, before it says ready."""
    expected = _publish(tmp_path, 1, tied=True)
    _publish(tmp_path, 2, tied=False)
    save_head(
        HeadWeights.from_arrays(np.ones((VOCAB, D_MODEL), np.float32)), tmp_path / "other" / "1"
    )
    with running_server(tmp_path, workers="2", load_at_start="false") as url:
        with Client(url) as admin:
            assert admin.load("head", 1)["pinned_version"] == 1
            admin.load("other")
            admin.unload("other")
        old = tree(url).engine
        old.kill()
        old.wait(10)
        poll(lambda: _restarted(url, old.pid), "a new engine, ready")
        with Client(url) as client:
            top = client.topk("head", HIDDEN, k=3)
            with pytest.raises(ServiceError, match="unloaded"):
                client.topk("other", HIDDEN)
    assert top.version == 1
    np.testing.assert_array_equal(top.token_ids, expected)


def _restarted(url: str, dead: int) -> bool | None:
    try:
        engine = tree(url).engine
    except ValueError:  # between the two engines
        return None
    return engine.pid != dead and _ready(url)


def _not_ready(url: str, seen: list[int]) -> dict[str, dict[str, str]] | None:
    answer = httpx.get(f"{url}/health/ready")
    seen.append(answer.status_code)
    return answer.json() if answer.status_code == 503 else None


def test_sigterm_drains_every_front_and_leaves_nothing(repository: Path) -> None:
    """Requests in flight on both fronts are answered; then every process is gone, and no
    shared memory or runtime directory is left."""
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    port = free_port()
    env = {**os.environ, "LMHEAD_WORKERS": "2", "LMHEAD_REPOSITORY": str(repository)}
    command = [sys.executable, "-m", "service", "serve", "--port", str(port)]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        poll(lambda: _ready(url), "ready", timeout_s=60)
        processes = tree(url)
        (socket_path,) = {c.laddr for c in processes.engine.net_connections("unix") if c.laddr}
        runtime = Path(str(socket_path)).parent
        assert runtime.is_dir()
        traffic = Traffic()
        clients = [threading.Thread(target=_send_models, args=(url, traffic)) for _ in range(4)]
        for thread in clients:
            thread.start()
        poll(lambda: len(traffic.answers) > 20 or None, "traffic")
        process.send_signal(signal.SIGTERM)
        _, errors = process.communicate(timeout=60)
        traffic.stop.set()
        for thread in clients:
            thread.join()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, errors.decode()[-2000:]
    everyone = [processes.supervisor, processes.engine, *processes.fronts]
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in everyone)
    shm_after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert shm_after <= shm_before
    assert not runtime.exists()
    assert traffic.answers
    # Once a front has drained it refuses connections (a transport error); never a 5xx or 503.
    assert traffic.failures == []


def _ready(url: str) -> bool | None:
    try:
        return httpx.get(f"{url}/health/ready").status_code == 200 or None
    except httpx.TransportError:
        return None


def _send_models(url: str, traffic: Traffic) -> None:
    """Top-k until the service stops: answers, or a refused connection once it is gone."""
    with Client(url, retries=0) as client:
        for _ in range(2000):
            if traffic.stop.is_set():
                return
            try:
                traffic.answers.append((1, client.topk("tied", HIDDEN, k=2).token_ids))
            except httpx.TransportError as error:
                traffic.refused.append(f"{type(error).__name__}: {error}")
                return
            except ServiceError as error:
                traffic.failures.append(f"{type(error).__name__}: {error}")


def test_grpc_on_every_front(repository: Path) -> None:
    """Each front serves V2 over gRPC on the shared port too (grpc binds with SO_REUSEPORT)."""
    triton = pytest.importorskip("tritonclient.grpc")
    port = free_port()
    with running_server(repository, workers="2", grpc_port=str(port)) as url:
        fronts = {front.pid for front in _all_fronts_connected(url, 2).fronts}
        for _ in range(4):  # a connection each: both fronts answer
            client = triton.InferenceServerClient(f"127.0.0.1:{port}")
            hidden = triton.InferInput("hidden_states", list(HIDDEN.shape), "FP32")
            hidden.set_data_from_numpy(HIDDEN)
            outputs = [triton.InferRequestedOutput("topk_token_ids")]
            result = client.infer("tied", [hidden], outputs=outputs, parameters={"k": 3})
            client.close()
            want = top_k(reference_logits(repository / "tied" / "1", HIDDEN), 3)[1]
            np.testing.assert_array_equal(result.as_numpy("topk_token_ids"), want)
        assert {front.pid for front in tree(url).fronts} == fronts  # both bound, none restarted
        assert len(fronts) == 2


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_one_process_stops_cleanly_and_said_where_it_served(repository: Path, stop: int) -> None:
    """Ctrl-C, SIGTERM and SIGHUP drain and exit 0 without a traceback (uvicorn raises the
    signal again once down: a KeyboardInterrupt traceback, and death by SIGTERM where the
    split service exits 0; SIGHUP's default ended it at once), and the log named the address
    it listened on."""
    port = free_port()
    env = {**os.environ, "LMHEAD_WORKERS": "1", "LMHEAD_REPOSITORY": str(repository)}
    command = [sys.executable, "-m", "service", "serve", "--port", str(port)]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        poll(lambda: _ready(f"http://127.0.0.1:{port}"), "ready", timeout_s=60)
        process.send_signal(stop)
        _, errors = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    log = errors.decode()
    assert process.returncode == 0, log[-2000:]
    assert "Traceback" not in log
    assert f"lmhead serving on http://127.0.0.1:{port}" in log


def test_split_service_on_port_0_shares_one_port_and_says_which(repository: Path) -> None:
    """The supervisor takes the port (0: the kernel picks) and hands that one to every front
    (each front used to pick its own); its log says where it serves."""
    env = {**os.environ, "LMHEAD_WORKERS": "2", "LMHEAD_REPOSITORY": str(repository)}
    command = [sys.executable, "-m", "service", "serve", "--port", "0"]
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    lines: list[str] = []
    assert process.stderr is not None
    reader = threading.Thread(target=lambda: lines.extend(process.stderr or []), daemon=True)
    reader.start()
    try:
        line = poll(lambda: _serving_line(lines), "the serving line", timeout_s=60)
        port = int(line.split("127.0.0.1:")[1].split()[0])
        url = f"http://127.0.0.1:{port}"
        poll(lambda: _ready(url), "ready", timeout_s=60)
        supervisor = psutil.Process(process.pid)

        def listening() -> list[int] | None:
            fronts = [p for p in supervisor.children() if p.name() == "lmhead-front"]
            sockets = [c for f in fronts for c in f.net_connections("tcp")]
            found = [c.laddr.port for c in sockets if c.status == "LISTEN"]
            return found if len(found) == 2 else None

        assert poll(listening, "both fronts listening") == [port, port]
    finally:
        process.terminate()
        process.wait(timeout=60)
        reader.join(timeout=60)
        process.stderr.close()


def _serving_line(lines: list[str]) -> str | None:
    return next((line for line in lines if "lmhead serving on" in line), None)


def test_ctrl_c_while_the_split_service_starts_is_a_clean_stop(repository: Path) -> None:
    """Ctrl-C to the whole group while the engine is being spawned: exit 0, no traceback
    (the child got it inside its bootstrap, and the supervisor called that a failed start)."""
    env = {**os.environ, "LMHEAD_WORKERS": "2", "LMHEAD_REPOSITORY": str(repository)}
    command = [sys.executable, "-m", "service", "serve", "--port", str(free_port())]
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        supervisor = psutil.Process(process.pid)
        poll(lambda: supervisor.children() or None, "the engine's spawn", timeout_s=60)
        os.killpg(process.pid, signal.SIGINT)  # as a terminal sends Ctrl-C
        _, errors = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, errors.decode()[-2000:]
    assert "Traceback" not in errors.decode()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_port_in_use_is_refused_at_once(repository: Path, workers: str) -> None:
    """Fronts share their port with SO_REUSEPORT; the supervisor first checks nobody else
    holds it, so two services never split one port's traffic by accident. One process binds
    before it loads a model (uvicorn alone loaded every model, then failed to bind)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "LMHEAD_WORKERS": workers, "LMHEAD_REPOSITORY": str(repository)}
        command = [sys.executable, "-m", "service", "serve", "--port", str(port)]
        refused = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0
    assert f"cannot serve on 127.0.0.1:{port}" in refused.stderr
    assert "--port or LMHEAD_PORT" in refused.stderr  # what to change, in either mode
    assert "Traceback" not in refused.stderr
    assert "lmhead ready" not in refused.stderr  # nothing was loaded first


def test_a_supervisor_killed_outright_leaves_no_process_and_its_directory_goes_next_start(
    repository: Path,
) -> None:
    """SIGKILL of the supervisor: the engine and fronts stop (the kernel tells them), and the
    private directory it could not remove (journal, metrics files) is swept by the next
    split service; that one stops on SIGHUP (a closed terminal) as on SIGTERM."""
    port = free_port()
    with _split_process(repository, port) as process:
        killed = tree(f"http://127.0.0.1:{port}")
        runtime = _runtime_dir(killed)
        process.kill()
        process.wait(timeout=30)
        _, alive = psutil.wait_procs([killed.engine, *killed.fronts], timeout=60)
        assert alive == []
        assert runtime.is_dir()
    with _split_process(repository, port) as again:
        assert not runtime.exists()
        again.send_signal(signal.SIGHUP)
        again.wait(timeout=60)
    assert again.returncode == 0


@contextmanager
def _split_process(repository: Path, port: int) -> Iterator[subprocess.Popen[bytes]]:
    """``lmhead serve`` with two fronts as a process of its own (the test signals it), ready;
    with a temporary directory of its own: a split service started by another test run on
    this machine sweeps the stale ``lmhead-run-*`` directories of a shared one."""
    scratch = repository.parent / "tmp"
    scratch.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "LMHEAD_WORKERS": "2",
        "LMHEAD_REPOSITORY": str(repository),
        "TMPDIR": str(scratch),
    }
    command = [sys.executable, "-m", "service", "serve", "--port", str(port)]
    quiet = subprocess.DEVNULL
    process = subprocess.Popen(command, env=env, stdout=quiet, stderr=quiet)
    try:
        poll(lambda: _ready(f"http://127.0.0.1:{port}"), "ready", timeout_s=60)
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _runtime_dir(processes: Tree) -> Path:
    """The supervisor's private directory, where its engine's socket is."""
    (socket_path,) = {c.laddr for c in processes.engine.net_connections("unix") if c.laddr}
    return Path(str(socket_path)).parent


def _orphan(result: Path) -> None:
    """Spawned by ``_short_lived_parent``: waits until its parent is gone, then becomes a
    process of the service; it must end there, as no supervisor would ever stop it."""
    import multiprocessing

    from service.hosting.split.processes import become

    parent = multiprocessing.parent_process()
    assert parent is not None
    parent.join()  # the parent's sentinel: it has exited
    try:
        become("lmhead-test")
    except SystemExit:
        result.write_text("ended")
        raise
    result.write_text("lived on")


def _short_lived_parent(result: Path, pid_file: Path) -> None:
    import multiprocessing

    child = multiprocessing.get_context("spawn").Process(target=_orphan, args=(result,))
    child.start()
    pid_file.write_text(str(child.pid))
    os._exit(0)  # like a supervisor killed while its children start


def test_a_process_whose_supervisor_died_before_it_started_ends_itself(tmp_path: Path) -> None:
    """Killed in its first second, the supervisor left fronts answering 503 on the port for
    good (the kernel's parent-death signal is asked for only once a child runs)."""
    import multiprocessing

    result, pid_file = tmp_path / "result", tmp_path / "pid"
    spawn = multiprocessing.get_context("spawn")
    parent = spawn.Process(target=_short_lived_parent, args=(result, pid_file))
    parent.start()
    parent.join(timeout=60)
    with contextlib.suppress(psutil.NoSuchProcess):  # already gone is what it should be
        psutil.Process(int(pid_file.read_text())).wait(timeout=60)
    assert result.read_text() == "ended"


def test_the_directory_of_a_killed_supervisor_stays_while_its_engine_lives(
    repository: Path,
) -> None:
    """A supervisor started meanwhile swept the directory of one killed outright while its
    engine still drained there (journal, socket): every process of a service holds it."""
    from service.hosting.split.supervisor import RUNTIME_PREFIX
    from service.repository import staging

    port = free_port()
    with _split_process(repository, port) as process:
        processes = tree(f"http://127.0.0.1:{port}")
        runtime = _runtime_dir(processes)
        processes.engine.suspend()  # as an engine still draining
        process.kill()
        process.wait(timeout=30)
        psutil.wait_procs(processes.fronts, timeout=60)
        assert runtime.name not in staging.sweep(runtime.parent, RUNTIME_PREFIX)
        assert runtime.is_dir()
        processes.engine.resume()  # its parent-death SIGTERM is delivered now
        processes.engine.wait(timeout=60)
        assert runtime.name in staging.sweep(runtime.parent, RUNTIME_PREFIX)


def test_nohup_keeps_a_hang_up_out(repository: Path) -> None:
    """The service's SIGHUP handler replaced nohup's ignore: the terminal closing stopped it."""
    port = free_port()
    env = {**os.environ, "LMHEAD_REPOSITORY": str(repository)}
    command = [sys.executable, "-m", "service", "serve", "--port", str(port)]
    quiet = subprocess.DEVNULL

    def as_nohup() -> None:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    process = subprocess.Popen(command, env=env, stdout=quiet, stderr=quiet, preexec_fn=as_nohup)
    try:
        poll(lambda: _ready(f"http://127.0.0.1:{port}"), "ready", timeout_s=60)
        assert _sig_ignored(process.pid) & (1 << (signal.SIGHUP - 1))
    finally:
        process.terminate()
        process.wait(timeout=60)


def _sig_ignored(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    (line,) = [line for line in status if line.startswith("SigIgn:")]
    return int(line.split()[1], 16)
