"""Benchmark the service against a bare onnxruntime session, JSON vs .npy, batching on vs off.

Starts the real service (``python -m service serve``) on loopback on freshly made demo heads,
drives it with concurrent aiohttp clients on uvloop (bounded in count and time; httpx's async
pool itself tops out near 60 requests/s at 64 connections here, and the clients share the 2
cores with the server, so a lighter load generator measures the server better; every
connection is opened before the clock starts), and measures the bare
``HeadSession`` on the same head in the same run. The batching comparison (64 one-row
clients) runs twice: with aiohttp, and with ``bench.loadgen``'s raw HTTP/1.1 client, whose
near-zero CPU per request leaves the cores to the server, so every ratio comes from one run on one
(shared, noisy) machine. Writes a markdown report.

    python -m bench.serve [--model demo-tied] [--output bench/results-serve.md]
    python -m bench.serve --baseline ../lmhead-before --output bench/results-before-after.md

``--baseline DIR`` (a checkout of an earlier commit, e.g. ``git worktree add``) measures only
the acceptance rows, for that checkout's service and this one, alternating in one run: 64-row
npy and JSON at 16 clients against the bare session, and batching on/off at 64 one-row clients.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import numpy.typing as npt
import orjson
import uvloop

from bench.loadgen import build_request, closed_loop
from bench.machine import describe_machine
from service.heads.inspector import inspect_head
from service.runtime.session import HeadSession
from service.tools.demo import write_demo_models
from tests.server import running_checkout, running_server

ROWS = (1, 8, 64)
CLIENTS = (1, 16, 64)
MAX_SECONDS = 4.0
BATCHING_REQUESTS = 8000  # the batching runs are bounded by MAX_SECONDS first
K = 10


@dataclass(frozen=True)
class Result:
    rows_per_s: float
    p50_ms: float
    p99_ms: float
    requests: int


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="demo-tied")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--baseline", type=Path, help="an earlier checkout to compare with")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        repository = Path(scratch)
        write_demo_models(repository)
        if args.baseline is None:
            report = _run(repository, args.model)
        else:
            report = _before_after(repository, args.baseline.resolve(), args.model)
    print(report)
    if args.output:
        args.output.write_text(report + "\n", encoding="utf-8")
    return 0


def _session(repository: Path, model: str) -> HeadSession:
    path = repository / model / "1" / "model.onnx"
    return HeadSession(path, tied=inspect_head(path).tied)


def _run(repository: Path, model: str) -> str:
    session = _session(repository, model)
    before = {rows: _bare(session, rows) for rows in ROWS}
    url_path = f"/v1/models/{model}/topk"
    served = []
    with running_server(repository, log_level="warning") as url:
        for kind in ("json", "npy"):
            for rows in ROWS:
                for clients in CLIENTS:
                    result = uvloop.run(_drive(url + url_path, kind, rows, clients))
                    served.append((kind, rows, clients, result))
    # The bare session is measured before and after the served runs and averaged, so a
    # machine that got busier or quieter during the run does not skew every ratio one way.
    bare = {rows: _mean(before[rows], _bare(session, rows)) for rows in ROWS}
    lines = [
        describe_machine(),
        "",
        f"Head `{model}` (32000 x 512), k={K}, loopback, aiohttp clients; the bare session is "
        "the mean of a run before and one after the served runs.",
        "",
    ]
    lines += ["| body | rows/req | clients | rows/s | p50 ms | p99 ms | vs bare session |"]
    lines += ["|---|---|---|---|---|---|---|"]
    lines += [
        f"| bare session | {r} | 1 | {bare[r].rows_per_s:.0f} | {bare[r].p50_ms:.2f} | "
        f"{bare[r].p99_ms:.2f} | 1.00x |"
        for r in ROWS
    ]
    for kind, rows, clients, result in served:
        ratio = result.rows_per_s / bare[rows].rows_per_s
        lines.append(
            f"| {kind} | {rows} | {clients} | {result.rows_per_s:.0f} | "
            f"{result.p50_ms:.2f} | {result.p99_ms:.2f} | {ratio:.2f}x |"
        )
    lines += ["", "Open Inference Protocol (V2) against the native API, 64 rows per request:", ""]
    lines += ["| API and body | clients | rows/s | p50 ms | p99 ms | vs native npy |"]
    lines += ["|---|---|---|---|---|---|"]
    v2_path = f"/v2/models/{model}/infer"
    with running_server(repository, log_level="warning") as url:
        for clients in (1, 16):
            runs = {
                "native npy": _drive(url + url_path, "npy", 64, clients),
                "native json": _drive(url + url_path, "json", 64, clients),
                "v2 binary": _drive(url + v2_path, "v2-binary", 64, clients),
                "v2 json": _drive(url + v2_path, "v2-json", 64, clients),
            }
            measured = {name: uvloop.run(run) for name, run in runs.items()}
            base = measured["native npy"].rows_per_s
            for name, result in measured.items():
                lines.append(
                    f"| {name} | {clients} | {result.rows_per_s:.0f} | {result.p50_ms:.2f} | "
                    f"{result.p99_ms:.2f} | {result.rows_per_s / base:.2f}x |"
                )
    lines += ["", "Dynamic batching, 64 concurrent clients sending one row each (JSON):", ""]
    lines += _batching_table(repository, url_path)
    return "\n".join(lines)


ROUNDS = 3  # baseline and current alternate, so drift on the machine hits both alike


def _before_after(repository: Path, baseline: Path, model: str) -> str:
    """The acceptance rows for an earlier checkout and this one, alternating in one run."""
    old_repository = repository.parent / (repository.name + "-baseline")
    subprocess.run(  # the baseline writes its own demo heads (file formats may differ)
        [sys.executable, "-m", "service", "demo", "--repository", str(old_repository)],
        cwd=baseline,
        env={"PYTHONPATH": str(baseline), "PATH": ""},
        check=True,
        capture_output=True,
    )
    session = _session(repository, model)
    bare = _bare(session, 64)
    url_path = f"/v1/models/{model}/topk"
    builds = {"before": (baseline, old_repository), "after": (None, repository)}
    measured: dict[tuple[str, str], list[float]] = {}
    for _ in range(ROUNDS):
        for build, (source, models) in builds.items():
            with _server(source, models) as url:
                for kind in ("npy", "json"):
                    result = uvloop.run(_drive(url + url_path, kind, 64, 16))
                    measured.setdefault((build, kind), []).append(result.rows_per_s)
            for batching in ("false", "true"):
                with _server(source, models, batching=batching) as url:
                    result = uvloop.run(_batching_run(url, url_path, "raw"))
                    measured.setdefault((build, f"batching {batching}"), []).append(
                        result.rows_per_s
                    )
    bare = _mean(bare, _bare(session, 64))
    mean = {key: statistics.fmean(values) for key, values in measured.items()}
    lines = [
        describe_machine(),
        "",
        f"Before: `{_revision(baseline)}`; after: `{_revision(Path.cwd())}` "
        f"(plus uncommitted changes, if any). Head `{model}` (32000 x 512), "
        f"k={K}; each build measured {ROUNDS} times, alternating; rows/s means. Bare session "
        f"at 64 rows: {bare.rows_per_s:.0f} rows/s.",
        "",
        "| measure | before | after | after / before | target |",
        "|---|---|---|---|---|",
    ]
    for kind, target in (("npy", 0.9), ("json", 0.8)):
        ratios = [mean[(build, kind)] / bare.rows_per_s for build in builds]
        lines.append(
            f"| 64-row {kind} at 16 clients, vs bare session | {ratios[0]:.2f}x | "
            f"{ratios[1]:.2f}x | {ratios[1] / ratios[0]:.2f} | >= {target}x |"
        )
    gains = [mean[(b, "batching true")] / mean[(b, "batching false")] for b in builds]
    lines.append(
        f"| 64 one-row JSON clients, batching on / off | {gains[0]:.1f}x | {gains[1]:.1f}x | "
        f"{gains[1] / gains[0]:.2f} | >= 8x |"
    )
    lines += ["", "| build | measure | rows/s, each round |", "|---|---|---|"]
    for (build, measure), values in sorted(measured.items()):
        lines.append(f"| {build} | {measure} | {', '.join(f'{v:.0f}' for v in values)} |")
    return "\n".join(lines)


def _revision(checkout: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(checkout), "log", "-1", "--format=%h %s"], capture_output=True, text=True
    )
    return done.stdout.strip()[:72] or checkout.name


def _server(source: Path | None, repository: Path, **settings: str) -> AbstractContextManager[str]:
    if source is None:
        return running_server(repository, log_level="warning", **settings)
    return running_checkout(source, repository, log_level="warning", **settings)


def _batching_table(repository: Path, url_path: str) -> list[str]:
    """Batching off vs on, with two load generators: aiohttp, and the lean raw client."""
    lines = ["| client | batching | rows/s | p50 ms | p99 ms | speed-up |"]
    lines += ["|---|---|---|---|---|---|"]
    for client in ("raw", "aiohttp"):
        results = {}
        for batching in ("false", "true"):
            with running_server(repository, log_level="warning", batching=batching) as url:
                results[batching] = uvloop.run(_batching_run(url, url_path, client))
        for batching, result in results.items():
            gain = result.rows_per_s / results["false"].rows_per_s
            lines.append(
                f"| {client} | {'on' if batching == 'true' else 'off'} | "
                f"{result.rows_per_s:.0f} | {result.p50_ms:.2f} | {result.p99_ms:.2f} | "
                f"{gain:.1f}x |"
            )
    return lines


async def _batching_run(url: str, url_path: str, client: str) -> Result:
    if client == "aiohttp":
        return await _drive(url + url_path, "json", 1, 64, max_requests=BATCHING_REQUESTS)
    body, headers, _ = _body("json", 1)
    host, port = url.removeprefix("http://").split(":")
    raw = build_request(host, int(port), url_path, body, headers)
    run = await closed_loop(
        host, int(port), raw, 64, max_seconds=MAX_SECONDS, max_requests=BATCHING_REQUESTS
    )
    return _result(run.latencies, 1, run.elapsed)


def _hidden(rows: int, d_model: int = 512) -> npt.NDArray[np.float32]:
    return np.random.default_rng(rows).standard_normal((rows, d_model)).astype(np.float32)


def _bare(
    session: HeadSession, rows: int, d_model: int = 512, seconds: float = MAX_SECONDS / 2
) -> Result:
    """The bare session on ``rows`` rows, back to back, bounded in time and count."""
    hidden = _hidden(rows, d_model)
    session.project(hidden, K)
    latencies: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds and len(latencies) < 2000:
        begin = time.perf_counter()
        session.project(hidden, K)
        latencies.append(time.perf_counter() - begin)
    return _result(latencies, rows, sum(latencies))


def _mean(first: Result, second: Result) -> Result:
    return Result(
        rows_per_s=(first.rows_per_s + second.rows_per_s) / 2,
        p50_ms=(first.p50_ms + second.p50_ms) / 2,
        p99_ms=(first.p99_ms + second.p99_ms) / 2,
        requests=first.requests + second.requests,
    )


def _body(kind: str, rows: int, d_model: int = 512) -> tuple[bytes, dict[str, str], str]:
    hidden = _hidden(rows, d_model)
    if kind.startswith("v2"):
        tensor: dict[str, object] = {"name": "hidden_states", "shape": list(hidden.shape)}
        tensor["datatype"] = "FP32"
        if kind == "v2-json":
            tensor["data"] = hidden.reshape(-1).tolist()
            header = orjson.dumps({"inputs": [tensor], "parameters": {"k": K}})
            return header, {"content-type": "application/json"}, ""
        tensor["parameters"] = {"binary_data_size": hidden.nbytes}
        header = orjson.dumps({"inputs": [tensor], "parameters": {"k": K}})
        headers = {
            "content-type": "application/octet-stream",
            "inference-header-content-length": str(len(header)),
        }
        return header + hidden.tobytes(), headers, ""
    if kind == "json":
        payload = orjson.dumps({"hidden_states": hidden.tolist(), "k": K})
        return payload, {"content-type": "application/json"}, ""
    stream = io.BytesIO()
    np.save(stream, hidden)
    return stream.getvalue(), {"content-type": "application/x-npy"}, f"?k={K}"


async def _drive(
    url: str,
    kind: str,
    rows: int,
    clients: int,
    max_requests: int | None = None,
    d_model: int = 512,
) -> Result:
    body, headers, query = _body(kind, rows, d_model)
    budget = max_requests or max(8 * clients, 200 // rows + 16)
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector, raise_for_status=True) as client:

        async def post() -> None:
            async with client.post(url + query, data=body, headers=headers) as response:
                await response.read()

        await asyncio.gather(*(post() for _ in range(clients)))  # every connection opened first
        tickets = iter(range(budget))
        start = time.perf_counter()

        async def worker() -> None:
            for _ in _until(tickets, start):
                begin = time.perf_counter()
                await post()
                latencies.append(time.perf_counter() - begin)

        await asyncio.gather(*(worker() for _ in range(clients)))
        elapsed = time.perf_counter() - start
    return _result(latencies, rows, elapsed)


def _until(tickets: Iterator[int], start: float) -> Iterator[int]:
    for ticket in tickets:
        if time.perf_counter() - start > MAX_SECONDS:
            return
        yield ticket


def _result(latencies: list[float], rows: int, elapsed: float) -> Result:
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return Result(
        rows_per_s=len(latencies) * rows / elapsed,
        p50_ms=statistics.median(ordered) * 1e3,
        p99_ms=p99 * 1e3,
        requests=len(latencies),
    )


if __name__ == "__main__":
    raise SystemExit(main())
