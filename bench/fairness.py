"""Benchmark fairness between models: one-row requests to one head while one big request
(4096 rows, k=1000, log-probs) runs on another, through two fronts (``LMHEAD_WORKERS=2``).

Two services start side by side on the demo heads (32000 x 512): today's, which cuts a big
request into runs of ``LMHEAD_MAX_BATCH_ROWS`` (128) rows, and one that runs it in chunks of
1048 rows (``LMHEAD_MAX_BATCH_ROWS=1048``: the runs it was cut into before, by the logits byte
limit alone). In each window two closed-loop clients send one-row JSON top-k requests to
``demo-untied`` while another process sends the big request to ``demo-tied`` (as ``.npy``,
then as JSON); the one-row requests' latencies while it runs are the measure, against what the
acceptance allows: one run of the big request plus their own, both timed on the bare session.
Windows alternate between the two services, ``--rounds`` times.

    python -m bench.fairness [--rounds 3] [--output FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import orjson
from prometheus_client.parser import text_string_to_metric_families

from bench.loadgen import build_request, timed_requests
from bench.machine import describe_machine
from service.runtime.session import HeadSession
from service.tools.demo import write_demo_models
from tests.server import running_server

ROWS, K, CLIENTS, WARM_S = 4096, 1000, 2, 1.0
SETTINGS = {"workers": "2", "max_rows": str(ROWS), "max_body_bytes": str(64 * 2**20)}
SERVICES = {
    "runs of 128 rows (today)": {},
    "runs of 1048 rows (before)": {"max_batch_rows": "1048"},
}


@dataclass
class Window:
    latencies: list[float]  # one-row requests during the big one (s)
    big_s: float
    waits: dict[float, float]  # the engine's queue waits of the one-row model: count <= bound


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--send", nargs=3, metavar=("FILE", "HOST", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.send:  # the big request's own process
        return _send(Path(args.send[0]), args.send[1], int(args.send[2]))
    with tempfile.TemporaryDirectory() as scratch:
        repository = Path(scratch)
        write_demo_models(repository)
        bare = _bare_runs(repository)
        bodies = _bodies(repository)
        text = _report(bare, _measure(repository, bodies, args.rounds))
    print(text)
    if args.output:
        args.output.write_text(text + "\n", encoding="utf-8")
    return 0


def _bare_runs(repository: Path) -> dict[str, float]:
    """Median seconds of the runs the acceptance counts, on the bare session."""
    timings: dict[str, float] = {}
    for name, rows, k in (("one row", 1, 5), ("128 rows", 128, K), ("1048 rows", 1048, K)):
        model = "demo-untied" if rows == 1 else "demo-tied"
        session = HeadSession(repository / model / "1" / "model.onnx", tied=model == "demo-tied")
        hidden = np.random.default_rng(rows).standard_normal((rows, 512), dtype=np.float32)
        session.project(hidden, k)
        runs = []
        for _ in range(7):
            start = time.perf_counter()
            session.project(hidden, k)
            runs.append(time.perf_counter() - start)
        timings[name] = statistics.median(runs)
    return timings


def _bodies(repository: Path) -> dict[str, tuple[Path, str]]:
    hidden = np.random.default_rng(0).standard_normal((ROWS, 512), dtype=np.float32)
    npy, json = repository / "big.npy", repository / "big.json"
    buffer = io.BytesIO()
    np.save(buffer, hidden)
    npy.write_bytes(buffer.getvalue())
    options = orjson.OPT_SERIALIZE_NUMPY
    json.write_bytes(
        orjson.dumps({"hidden_states": hidden, "k": K, "logprobs": True}, option=options)
    )
    return {
        "npy": (npy, f"/v1/models/demo-tied/topk?k={K}&logprobs=true"),
        "json": (json, "/v1/models/demo-tied/topk"),
    }


def _measure(
    repository: Path, bodies: dict[str, tuple[Path, str]], rounds: int
) -> dict[tuple[str, str], list[Window]]:
    windows: dict[tuple[str, str], list[Window]] = {}
    with (
        running_server(repository, **SETTINGS) as today,
        running_server(repository, **SETTINGS, **SERVICES["runs of 1048 rows (before)"]) as before,
    ):
        urls = dict(zip(SERVICES, (today, before), strict=True))
        for _ in range(rounds):
            for body, (path, target) in bodies.items():
                for service, url in urls.items():
                    window = asyncio.run(_window(url, path, target, body))
                    windows.setdefault((service, body), []).append(window)
    return windows


async def _window(url: str, path: Path, target: str, body: str) -> Window:
    host, port = url.removeprefix("http://").split(":")
    small = build_request(
        host,
        int(port),
        "/v1/models/demo-untied/topk",
        orjson.dumps({"hidden_states": [[0.5] * 512]}),
        {"content-type": "application/json"},
    )
    stop = asyncio.Event()
    loop = asyncio.create_task(timed_requests(host, int(port), small, CLIENTS, stop))
    waits = _queue_waits(url)
    await asyncio.sleep(WARM_S)  # the one-row clients in a steady state before the big one
    media = "application/x-npy" if body == "npy" else "application/json"
    big = build_request(host, int(port), target, path.read_bytes(), {"content-type": media})
    raw = path.with_suffix(".request")
    raw.write_bytes(big)
    started = time.perf_counter()
    sender = [sys.executable, "-m", "bench.fairness", "--send", str(raw), host, port]
    await (await asyncio.create_subprocess_exec(*sender)).wait()
    ended = time.perf_counter()
    stop.set()
    timed = await loop
    during = [latency for start, latency in timed if started <= start <= ended]
    after = _queue_waits(url)
    return Window(during, ended - started, {le: after[le] - waits.get(le, 0) for le in after})


def _queue_waits(url: str) -> dict[float, float]:
    """``lmhead_queue_duration_seconds`` of ``demo-untied``: how many waited at most each
    bucket's bound (the engine's own clock: from queued to its run's start)."""
    counts: dict[float, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == "lmhead_queue_duration_seconds_bucket" and (
                sample.labels.get("model") == "demo-untied"
            ):
                bound = float(sample.labels["le"])
                counts[bound] = counts.get(bound, 0) + sample.value
    return counts


def _send(raw: Path, host: str, port: int) -> int:
    """Send one prepared request, read its whole answer (the big client's process)."""
    with socket.create_connection((host, port)) as connection:
        connection.sendall(raw.read_bytes())
        answer = bytearray()
        while b"\r\n\r\n" not in answer:
            answer += connection.recv(1 << 20)
        head, _, rest = bytes(answer).partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise SystemExit(f"the big request failed: {head[:200]!r}")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        left = length - len(rest)
        while left > 0:
            left -= len(connection.recv(min(left, 1 << 20)))
    return 0


def _report(bare: dict[str, float], windows: dict[tuple[str, str], list[Window]]) -> str:
    lines = [
        describe_machine(),
        "",
        f"One-row top-k requests (JSON, {CLIENTS} closed-loop clients) to `demo-untied` while "
        f"one {ROWS}-row, k={K}, log-probs request runs on `demo-tied` (32000 x 512), through "
        "two fronts (`LMHEAD_WORKERS=2`); windows alternate between the services. Bare "
        f"session: a one-row run {bare['one row'] * 1e3:.1f} ms, a 128-row k={K} run "
        f"{bare['128 rows'] * 1e3:.0f} ms, a 1048-row k={K} run {bare['1048 rows'] * 1e3:.0f} ms. "
        "Allowed: one run of the big request plus the one-row request's own.",
        "",
        "| service | big body | one-row p50 ms | p99 ms | max ms | allowed ms | p99 / allowed "
        "| engine queue wait <= 50 ms / 100 ms / 250 ms | big request s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (service, body), runs in windows.items():
        latencies = [latency for window in runs for latency in window.latencies]
        chunk = bare["128 rows" if "128" in service else "1048 rows"]
        allowed = chunk + bare["one row"]
        p99 = float(np.percentile(latencies, 99))
        big = statistics.median(window.big_s for window in runs)
        waits = {le: sum(window.waits.get(le, 0) for window in runs) for le in runs[0].waits}
        total = waits.get(float("inf"), 0) or 1
        shares = " / ".join(f"{waits.get(le, 0) / total:.0%}" for le in (0.05, 0.1, 0.25))
        lines.append(
            f"| {service} | {body} | {statistics.median(latencies) * 1e3:.1f} | {p99 * 1e3:.0f} "
            f"| {max(latencies) * 1e3:.0f} | {allowed * 1e3:.0f} | {p99 / allowed:.2f} "
            f"| {shares} | {big:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
