"""The decoding step served (``bench.decoding --served``): the same requests through HTTP as
the Python client sends them (``service.client.calls``: the step's arrays in an ``.npz`` body,
a plain top-k as ``.npy``), one closed-loop client, interleaved windows, median latency; 1,000
allowed ids in an ``.npz`` body against the whole demo head; and the client's own time (the
call built, the answer read) with 1,000 allowed ids against none."""

from __future__ import annotations

import asyncio
import io
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlencode

import httpx
import numpy as np
import numpy.typing as npt

from bench.loadgen import build_request, closed_loop
from service.client.answers import read_topk
from service.client.calls import Call, Calls
from service.heads.files import HeadWeights, save_head
from service.messages import TopKRequest
from tests.server import running_server

ROUNDS, WINDOW_S, ALLOWED = 3, 1.5, 1000
HEAD = "head"
Requests = Callable[[npt.NDArray[np.float32]], dict[str, TopKRequest]]


def served_report(sizes: list[tuple[int, ...]], requests: Requests) -> list[str]:
    lines = [
        f"Served (HTTP, as the Python client sends them; one closed-loop client, {ROUNDS} "
        f"interleaved windows of {WINDOW_S:g} s, median latency):",
        "",
        "| head | request | ms | vs plain |",
        "|---|---|---|---|",
    ]
    for vocab, d_model in sizes:
        lines += _served_rows(vocab, d_model, requests)
    lines += ["", *_client_time()]
    return lines


def _calls(asked: dict[str, TopKRequest], vocab: int) -> dict[str, Call]:
    """Each request as the client's call: the same options, names as the wire has them."""
    calls = Calls(binary=True, token=None)
    built = {}
    for name, request in asked.items():
        options = _wire_options(request)
        built[name] = calls.topk(
            HEAD, request.hidden_states, request.k, True, 1.0, False, None, options
        )
    plain = asked["plain top-k"]
    allowed = np.random.default_rng(2).choice(vocab, ALLOWED, replace=False)
    built[f"{ALLOWED} allowed ids (.npz)"] = calls.topk(
        HEAD, plain.hidden_states, plain.k, True, 1.0, False, None, {"allowed_token_ids": allowed}
    )
    return built


def _wire_options(request: TopKRequest) -> dict[str, object]:
    vocabulary = request.vocabulary
    if vocabulary is None or vocabulary.decoding is None:
        return {}
    step = vocabulary.decoding
    options: dict[str, object] = {}
    for name in ("prompt_token_ids", "output_token_ids"):
        lists = getattr(step, name)
        if lists is not None:
            ends = np.cumsum(lists.lengths)
            options[name] = np.split(lists.values, ends[:-1])
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        options[name] = getattr(step, name)
    options["token_bitmask"] = step.token_bitmask
    if vocabulary.sample is not None:
        options["sample"] = {"seed": vocabulary.sample.seed, "top_p": vocabulary.sample.top_p}
    return options


def _served_rows(vocab: int, d_model: int, requests: Requests) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="lmhead-bench-") as directory:
        repository = Path(directory)
        rng = np.random.default_rng(1)
        table = (rng.standard_normal((vocab, d_model), dtype=np.float32) * 0.05).astype(np.float32)
        save_head(HeadWeights.from_arrays(table), repository / HEAD / "1")
        calls = _calls(requests(table), vocab)
        del table
        with running_server(repository, max_k="1000") as url:
            host, port = url.removeprefix("http://").split(":")
            raw = {
                name: build_request(
                    host,
                    int(port),
                    call.path + ("?" + urlencode(call.params) if call.params else ""),
                    call.content or b"",
                    call.headers or {},
                )
                for name, call in calls.items()
            }
            medians: dict[str, list[float]] = {name: [] for name in raw}
            for _ in range(ROUNDS):
                for name, request in raw.items():
                    run = asyncio.run(
                        closed_loop(
                            host, int(port), request, 1, max_seconds=WINDOW_S, max_requests=2000
                        )
                    )
                    medians[name].append(statistics.median(run.latencies) * 1e3)
    times = {name: statistics.median(values) for name, values in medians.items()}
    plain = times["plain top-k"]
    return [
        f"| {vocab} x {d_model} | {name} | {ms:.2f} | {ms / plain:.2f}x |"
        for name, ms in times.items()
    ]


def _client_time() -> list[str]:
    """The client's own milliseconds per call (built, then its answer read), 64 rows of the
    demo head's width, with and without 1,000 allowed ids."""
    calls = Calls(binary=True, token=None)
    rows = np.random.default_rng(3).standard_normal((64, 512), dtype=np.float32)
    allowed = np.random.default_rng(2).choice(32000, ALLOWED, replace=False)
    answer = _canned_answer()
    timed = {}
    for name, options in (("none", {}), (f"{ALLOWED} allowed ids", {"allowed_token_ids": allowed})):
        runs = []
        for _ in range(400):
            start = time.perf_counter()
            calls.topk(HEAD, rows, 10, True, 1.0, False, None, options)
            read_topk(answer)
            runs.append(time.perf_counter() - start)
        timed[name] = statistics.median(runs[50:]) * 1e3
    none, some = timed["none"], timed[f"{ALLOWED} allowed ids"]
    return [
        f"The client's own time per call (the call built, its .npz answer read; 64 rows): "
        f"{none:.3f} ms with no allowed ids, {some:.3f} ms with {ALLOWED} "
        f"(+{some - none:.3f} ms)."
    ]


def _canned_answer() -> httpx.Response:
    """A 64-row top-10 ``.npz`` answer as the service sends it."""
    buffer = io.BytesIO()
    np.savez(
        buffer,
        token_ids=np.zeros((64, 10), np.int64),
        logits=np.zeros((64, 10), np.float32),
        logprobs=np.zeros((64, 10), np.float32),
        logsumexp=np.zeros(64, np.float32),
    )
    request = httpx.Request("POST", "http://localhost/v1/models/head/topk")
    headers = {
        "content-type": "application/x-npz",
        "x-lmhead-model": HEAD,
        "x-lmhead-version": "1",
        "x-lmhead-tied": "true",
    }
    return httpx.Response(200, content=buffer.getvalue(), headers=headers, request=request)
