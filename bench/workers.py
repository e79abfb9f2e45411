"""Benchmark ``LMHEAD_WORKERS``: N front processes feeding one engine, against N = 1 and the
bare onnxruntime session, in one run.

For each N (default 1, 2, 4, 8) the real service starts on fresh demo heads (or, with
``--large``, a 128256 x 2048 tied head) and ``bench.loadgen``'s raw HTTP/1.1 clients drive
64-row ``.npy`` and 1-row JSON top-10 requests at 1, 16 and 64 clients (closed loop, bounded
in time and count, every connection opened first). N = 1 runs first and again last, averaged,
so a machine that got busier or quieter does not skew every ratio one way. Memory per N: the
engine's resident set, the fronts' together, and (on a GPU) the device memory in use, which
must not grow with N: the heads live in the engine alone.

    python -m bench.workers [--workers 1,2,4,8] [--large] [--provider cuda] [--output FILE]
"""

from __future__ import annotations

import argparse
import io
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import orjson
import uvloop

from bench.loadgen import build_request, closed_loop
from bench.machine import describe_machine
from service.demo import write_demo_models
from service.heads import HeadWeights, save_head
from service.inspect import inspect_head
from service.runtime import HeadSession, select_providers
from tests.server import running_server, server_process

CLIENTS = (1, 16, 64)
KINDS = (("npy", 64), ("json", 1))
MAX_SECONDS = 3.0
MAX_REQUESTS = 20000
K = 10
LARGE = (128256, 2048)


@dataclass(frozen=True)
class Result:
    rows_per_s: float
    p50_ms: float
    p99_ms: float


@dataclass(frozen=True)
class Memory:
    engine_mb: float
    fronts_mb: float
    device_mb: float | None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", default="1,2,4,8")
    parser.add_argument("--large", action="store_true", help="a 128256 x 2048 tied head")
    parser.add_argument("--provider", default="auto")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    counts = [int(n) for n in args.workers.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        repository = Path(scratch)
        model = _write_heads(repository, args.large)
        report = _run(repository, model, counts, args.provider)
    print(report)
    if args.output:
        args.output.write_text(report + "\n", encoding="utf-8")
    return 0


def _write_heads(repository: Path, large: bool) -> str:
    if not large:
        write_demo_models(repository)
        return "demo-tied"
    table = np.random.default_rng(0).standard_normal(LARGE, dtype=np.float32) * 0.02
    save_head(HeadWeights.from_arrays(table), repository / "large" / "1")
    return "large"


def _run(repository: Path, model: str, counts: list[int], provider: str) -> str:
    path = repository / model / "1" / "model.onnx"
    d_model = inspect_head(path).d_model
    providers = select_providers(provider)  # type: ignore[arg-type]
    first = _bare(HeadSession(path, tied=True, providers=providers), d_model)
    order = [*counts, counts[0]] if counts[0] == 1 and len(counts) > 1 else counts
    measured: dict[int, list[dict[tuple[str, int], Result]]] = {}
    memory: dict[int, Memory] = {}
    for workers in order:
        settings = {"workers": str(workers), "log_level": "warning", "provider": provider}
        with running_server(repository, **settings) as url:
            runs = {
                (kind, clients): uvloop.run(_drive(url, model, kind, rows, clients, d_model))
                for kind, rows in KINDS
                for clients in CLIENTS
            }
            memory[workers] = _memory(url)
        measured.setdefault(workers, []).append(runs)
    last = _bare(HeadSession(path, tied=True, providers=providers), d_model)
    bare = Result((first.rows_per_s + last.rows_per_s) / 2, first.p50_ms, first.p99_ms)
    return _report(model, d_model, _averaged(measured), memory, bare)


def _averaged(
    measured: dict[int, list[dict[tuple[str, int], Result]]],
) -> dict[int, dict[tuple[str, int], Result]]:
    averaged = {}
    for workers, runs in measured.items():
        averaged[workers] = {
            key: Result(
                statistics.fmean(run[key].rows_per_s for run in runs),
                statistics.fmean(run[key].p50_ms for run in runs),
                statistics.fmean(run[key].p99_ms for run in runs),
            )
            for key in runs[0]
        }
    return averaged


def _report(
    model: str,
    d_model: int,
    results: dict[int, dict[tuple[str, int], Result]],
    memory: dict[int, Memory],
    bare: Result,
) -> str:
    lines = [
        describe_machine(),
        "",
        f"Head `{model}` (d_model {d_model}), top-{K}, loopback, raw HTTP/1.1 closed-loop "
        f"clients on the same machine; N = 1 is one process (today's service), N > 1 is N "
        f"fronts + one engine; N = 1 measured first and last, averaged. Bare onnxruntime "
        f"session at 64 rows: {bare.rows_per_s:.0f} rows/s.",
        "",
        "| request | clients | N | rows/s | p50 ms | p99 ms | vs N = 1 | vs bare session |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, rows in KINDS:
        for clients in CLIENTS:
            base = results[min(results)][(kind, clients)].rows_per_s
            for workers, runs in sorted(results.items()):
                result = runs[(kind, clients)]
                lines.append(
                    f"| {rows}-row {kind} | {clients} | {workers} | {result.rows_per_s:.0f} | "
                    f"{result.p50_ms:.2f} | {result.p99_ms:.2f} | "
                    f"{result.rows_per_s / base:.2f}x | "
                    f"{result.rows_per_s / bare.rows_per_s:.2f}x |"
                )
    lines += ["", "| N | engine RSS MB | fronts RSS MB (all) | device memory MB |"]
    lines += ["|---|---|---|---|"]
    for workers, used in sorted(memory.items()):
        device = "-" if used.device_mb is None else f"{used.device_mb:.0f}"
        lines.append(f"| {workers} | {used.engine_mb:.0f} | {used.fronts_mb:.0f} | {device} |")
    return "\n".join(lines)


def _memory(url: str) -> Memory:
    supervisor = server_process(url)
    children = supervisor.children(recursive=True)
    fronts = [p for p in children if p.name() == "lmhead-front"]
    engines = [p for p in children if p.name() == "lmhead-engine"] or [supervisor]
    return Memory(
        sum(p.memory_info().rss for p in engines) / 1e6,
        sum(p.memory_info().rss for p in fronts) / 1e6,
        _device_mb(),
    )


def _device_mb() -> float | None:
    if shutil.which("nvidia-smi") is None:
        return None
    query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
    answer = subprocess.run(query, capture_output=True, text=True, check=False)
    return float(answer.stdout.split()[0]) if answer.returncode == 0 else None


def _hidden(rows: int, d_model: int) -> npt.NDArray[np.float32]:
    return np.random.default_rng(rows).standard_normal((rows, d_model)).astype(np.float32)


def _bare(session: HeadSession, d_model: int) -> Result:
    hidden = _hidden(64, d_model)
    session.project(hidden, K)
    latencies: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < MAX_SECONDS and len(latencies) < 2000:
        begin = time.perf_counter()
        session.project(hidden, K)
        latencies.append(time.perf_counter() - begin)
    return _result(latencies, 64, sum(latencies))


async def _drive(url: str, model: str, kind: str, rows: int, clients: int, d_model: int) -> Result:
    hidden = _hidden(rows, d_model)
    path = f"/v1/models/{model}/topk"
    if kind == "json":
        body = orjson.dumps({"hidden_states": hidden.tolist(), "k": K})
        headers = {"content-type": "application/json"}
    else:
        stream = io.BytesIO()
        np.save(stream, hidden)
        body, headers, path = stream.getvalue(), {"content-type": "application/x-npy"}, path
        path += f"?k={K}"
    host, port = url.removeprefix("http://").split(":")
    raw = build_request(host, int(port), path, body, headers)
    run = await closed_loop(
        host, int(port), raw, clients, max_seconds=MAX_SECONDS, max_requests=MAX_REQUESTS
    )
    return _result(run.latencies, rows, run.elapsed)


def _result(latencies: list[float], rows: int, elapsed: float) -> Result:
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return Result(len(latencies) * rows / elapsed, statistics.median(ordered) * 1e3, p99 * 1e3)


if __name__ == "__main__":
    raise SystemExit(main())
