"""Where a one-row request's microseconds go, for ``bench.latency``: the server's event loop under
cProfile, by stage, and the Python client's own encode and decode timed in process.

The profiled server is ``python -m cProfile -m service serve`` on the 1024 x 64 head, one
client sending one row at a time; cProfile sees the event loop's thread only (the run is on
the inference thread, or inline) and inflates small functions about 2x, so the stages are
shares of the loop's Python time, not CPU time (``bench.latency`` measures that without it).
"""

from __future__ import annotations

import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import httpx
import numpy as np
import uvloop

from bench.loadgen import closed_loop
from tests.server import free_port

FORMATS = ("json", "npy", "v2-json", "v2-binary")
#: (stage, functions as (path suffix, name)); a stage's time is its functions' cumulative time.
STAGES: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("socket read, HTTP head parse (httptools, limits)", (("connection.py", "data_received"),)),
    ("body read (ASGI receive)", (("codec/wire.py", "read_body"),)),
    ("option checks (wire and plane)", (("codec/wire.py", "options"), ("plane/options.py", "topk"),
                                         ("plane/options.py", "infer"))),
    ("decode: body parse (+ checks above)", (("codec/native.py", "decode_topk"),
                                              ("codec/v2.py", "decode_http"))),
    ("admission: budget, lease, declared costs", (("plane/dataplane.py", "admit"),
                                                  ("plane/dataplane.py", "_admit"),
                                                  ("plane/serving.py", "__enter__"))),
    ("queue and batcher (submit, collect, launch, answer; a lone run)",
     (("runtime/batcher.py", "submit"), ("runtime/batcher.py", "_serve"),
      ("runtime/batcher.py", "_answer"))),
    ("answer encoding", (("codec/native.py", "encode_topk"), ("codec/v2.py", "encode_http"))),
    ("answer sent (ASGI send, socket write)", (("codec/pieces.py", "__call__"),
                                               ("coalesced_writes.py", "_flush"))),
    ("metrics (Prometheus)", (("service/metrics.py", ""),)),
)  # fmt: skip
WHOLE = (("connection.py", "data_received"), ("hosting/app.py", "__call__"))


def profile_table(repository: Path, count: int) -> list[str]:
    """One profiled server per body, ``count`` one-row requests each, stage by stage."""
    columns = {kind: _profiled(repository, kind, count) for kind in FORMATS}
    lines = [
        f"Where the event loop's Python time goes (cProfile, {count} one-row requests per body "
        "after 100, 1024 x 64 head, 1 client; us per request, cProfile's inflation included; "
        "stages may nest: option checks sit inside decode):",
        "",
        "| stage | " + " | ".join(FORMATS) + " |",
        "|---|" + "---|" * len(FORMATS),
    ]
    for label, functions in (*STAGES, ("whole request on the loop", WHOLE)):
        cells = [f"{_cumulative(columns[kind], functions):.0f}" for kind in FORMATS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _profiled(repository: Path, kind: str, count: int) -> tuple[pstats.Stats, int]:
    from bench.latency import raw_request  # one module's request, not a copy

    port = free_port()
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "serve.prof"
        command = [sys.executable, "-m", "cProfile", "-o", str(out), "-m", "service", "serve"]
        command += ["--repository", str(repository), "--host", "127.0.0.1", "--port", str(port)]
        env = {**os.environ, "LMHEAD_LOG_LEVEL": "warning"}
        process = subprocess.Popen(command, env=env)
        try:
            _ready(f"http://127.0.0.1:{port}", process)
            raw = raw_request("127.0.0.1", port, kind, "small")
            loop = (("127.0.0.1", port, raw, 1), {"max_seconds": 60.0})
            uvloop.run(closed_loop(*loop[0], **loop[1], max_requests=100))  # type: ignore[arg-type]
            uvloop.run(closed_loop(*loop[0], **loop[1], max_requests=count))  # type: ignore[arg-type]
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
        return pstats.Stats(str(out)), count + 100


def _ready(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/health/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)  # polling a start-up
    raise RuntimeError("the profiled server did not get ready")


def _cumulative(profile: tuple[pstats.Stats, int], functions: tuple[tuple[str, str], ...]) -> float:
    stats, requests = profile
    total = 0.0
    for (path, _, name), row in stats.stats.items():  # type: ignore[attr-defined]
        for suffix, wanted in functions:
            if path.endswith(suffix) and (wanted in ("", name)):
                total += row[3]  # cumulative seconds
    return total / requests * 1e6


def client_costs(repository: Path, calls: int = 2000) -> list[str]:
    """``Client.topk``'s own work per call in binary mode, without I/O: building the request
    (``.npy`` body, query) and reading an ``.npz`` answer into ``TopK``."""
    from service.client.answers import read_topk
    from service.client.calls import Calls

    lines = [
        "The Python client's own work per one-row call, binary mode, no I/O (us, median of "
        f"{calls}):",
        "",
        "| head | encode the request | decode the answer |",
        "|---|---|---|",
    ]
    for model, d_model in (("small", 64), ("gpt2", 768)):
        hidden = np.random.default_rng(1).standard_normal((1, d_model), dtype=np.float32)
        answer = _answer(hidden)
        call = partial(Calls(binary=True, token=None).topk, model, hidden, 10, False, 1.0)
        encode = _median_us(partial(call, False, None, {}), calls)
        decode = _median_us(partial(read_topk, answer), calls)
        lines.append(f"| {model} | {encode:.1f} | {decode:.1f} |")
    return lines


def _answer(hidden: np.ndarray) -> httpx.Response:
    """An ``.npz`` top-10 answer of one row with the headers the service sends."""
    from service.api.codec.wire import npz_bytes

    arrays: dict[str, np.ndarray] = {
        "token_ids": np.arange(10, dtype=np.int64)[None],
        "logits": np.linspace(3, 1, 10, dtype=np.float32)[None],
        "logsumexp": np.ones(len(hidden), np.float32),
    }
    headers = {"content-type": "application/x-npz", "x-lmhead-model": "small"}
    headers |= {"x-lmhead-version": "1", "x-lmhead-tied": "true"}
    return httpx.Response(200, headers=headers, content=npz_bytes(arrays))


def _median_us(call: Callable[[], object], calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e6
