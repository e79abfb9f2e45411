"""Benchmark ``LMHEAD_WORKERS``: N front processes feeding one engine, against N = 1 (one
process) and the bare onnxruntime session, side by side in one run.

The N = 1 service stays up the whole run; for each N > 1 (default 2, 4, 8) the split service
starts beside it, and every measurement alternates between the two (N = 1, N, N = 1, N;
3-second windows, averaged), so the machine's noise hits both alike. ``bench.loadgen``'s raw
HTTP/1.1 clients (every connection opened first, closed loop, bounded in time and count)
send top-10 requests: 64-row ``.npy`` and 1-row JSON to the demo head (32000 x 512), and
1-row JSON to a small head (4096 tokens, same d_model), where the matmul is cheap and
Python is the cost,
as on a GPU. Each window also reads the CPU time the server's processes spent (the one
process, or the engine and supervisor; the fronts together) per request, and how many cores
the server and the clients kept busy: where the split's cost goes, and whether the machine was
the limit. Memory per N: the engine's resident set, the fronts' together, and on a GPU the
device memory in use, which must not grow with N (the heads live in the engine alone).

    python -m bench.workers [--workers 2,4,8] [--rounds 2] [--large] [--provider cuda]
                            [--output FILE]

``--large`` replaces the demo head by a 128256 x 2048 tied head (the GPU measurement).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import orjson
import psutil
import uvloop
from prometheus_client.parser import text_string_to_metric_families

from bench.loadgen import build_request, closed_loop
from bench.machine import describe_machine
from bench.serve import Result, _bare, _hidden, _result
from service.heads.files import HeadWeights, save_head
from service.heads.inspector import inspect_head
from service.runtime.providers import select_providers
from service.runtime.session import HeadSession
from service.settings import Settings
from service.tools.demo import write_demo_models
from tests.server import running_server, server_process

CLIENTS = (1, 16, 64)
MAX_SECONDS = 3.0
ROUNDS = 2
MAX_REQUESTS = 20000
K = 10
LARGE = (128256, 2048)
SMALL_VOCAB = 4096


@dataclass(frozen=True)
class Load:
    model: str
    kind: str
    rows: int

    def __str__(self) -> str:
        return f"{self.rows}-row {self.kind}, `{self.model}`"


@dataclass(frozen=True)
class Usage:
    """CPU per request (microseconds) by role, and cores busy over a window."""

    engine_us: float  # the one process (N = 1), or the engine and the supervisor
    fronts_us: float  # all fronts together (0 for N = 1)
    cores: float  # the server's processes and this one (the clients) per second of window
    batch_rows: float  # rows per onnxruntime run (from the service's own metrics)


@dataclass(frozen=True)
class Window:
    result: Result
    usage: Usage


@dataclass(frozen=True)
class Memory:
    engine_mb: float
    fronts_mb: float
    device_mb: float | None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", default="2,4,8")
    parser.add_argument("--large", action="store_true", help="a 128256 x 2048 tied head")
    parser.add_argument("--provider", default="auto")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="alternations per load")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    counts = [int(n) for n in args.workers.split(",") if int(n) > 1]
    with tempfile.TemporaryDirectory() as scratch:
        repository = Path(scratch)
        big = _write_heads(repository, args.large)
        loads = [Load(big, "npy", 64), Load(big, "json", 1), Load("small", "json", 1)]
        report = _run(repository, big, loads, counts, args.provider, args.rounds)
    print(report)
    if args.output:
        args.output.write_text(report + "\n", encoding="utf-8")
    return 0


def _write_heads(repository: Path, large: bool) -> str:
    rng = np.random.default_rng(0)
    shape = (SMALL_VOCAB, LARGE[1] if large else 512)  # the big head's d_model
    small = rng.standard_normal(shape, dtype=np.float32) * 0.02
    save_head(HeadWeights.from_arrays(small), repository / "small" / "1")
    if not large:
        write_demo_models(repository)
        return "demo-tied"
    table = rng.standard_normal(LARGE, dtype=np.float32) * 0.02
    save_head(HeadWeights.from_arrays(table), repository / "large" / "1")
    return "large"


def _run(
    repository: Path, big: str, loads: list[Load], counts: list[int], provider: str, rounds: int
) -> str:
    path = repository / big / "1" / "model.onnx"
    d_model = inspect_head(path).d_model
    session = HeadSession(path, tied=True, providers=select_providers(provider))  # type: ignore[arg-type]
    bare = _bare(session, 64, d_model, seconds=MAX_SECONDS)
    settings = {"log_level": "warning", "provider": provider}
    measured: list[tuple[Load, int, int, Window, Window]] = []
    memory: dict[int, Memory] = {}
    with running_server(repository, **settings) as single:
        memory[1] = _memory(single)
        for workers in counts:
            with running_server(repository, workers=str(workers), **settings) as split:
                memory[workers] = _memory(split)
                for load in loads:
                    for clients in CLIENTS:
                        one, many = _alternate(single, split, load, clients, d_model, rounds)
                        measured.append((load, clients, workers, one, many))
    bare_after = _bare(session, 64, d_model, seconds=MAX_SECONDS)
    rate = (bare.rows_per_s + bare_after.rows_per_s) / 2  # the machine drifts: before and after
    rows = [_row(*window, rate) for window in measured]
    return _report(big, d_model, rows, memory, rate, rounds)


def _alternate(
    single: str, split: str, load: Load, clients: int, d_model: int, rounds: int
) -> tuple[Window, Window]:
    """N = 1 and N > 1 in alternating windows, each averaged over ``rounds``."""
    runs: dict[str, list[Window]] = {single: [], split: []}
    for _ in range(rounds):
        for url in (single, split):
            runs[url].append(_window(url, load, clients, d_model))
    return _mean(runs[single]), _mean(runs[split])


def _window(url: str, load: Load, clients: int, d_model: int) -> Window:
    rows_before, runs_before = _batches(url)
    before = _cpu_seconds(url)
    result = uvloop.run(_drive(url, load, clients, d_model))
    after = _cpu_seconds(url)
    rows_after, runs_after = _batches(url)
    engine, fronts, own, elapsed = (end - start for start, end in zip(before, after, strict=True))
    per_request = 1e6 / max(result.requests, 1)
    batch_rows = (rows_after - rows_before) / max(runs_after - runs_before, 1)
    cores = (engine + fronts + own) / elapsed
    return Window(result, Usage(engine * per_request, fronts * per_request, cores, batch_rows))


def _batches(url: str) -> tuple[float, float]:
    """Rows run and runs so far, summed over models (``lmhead_batch_rows``)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    rows = runs = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == "lmhead_batch_rows":
            for sample in family.samples:
                if sample.name.endswith("_sum"):
                    rows += sample.value
                elif sample.name.endswith("_count"):
                    runs += sample.value
    return rows, runs


def _cpu_seconds(url: str) -> tuple[float, float, float, float]:
    """CPU seconds so far: the engine (or one process) with the supervisor, the fronts, this
    process (the clients); and the wall clock."""
    supervisor = server_process(url)
    engine = fronts = 0.0
    for process in [supervisor, *supervisor.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = process.cpu_times()
            if process.name() == "lmhead-front":
                fronts += times.user + times.system
            else:
                engine += times.user + times.system
    own = resource.getrusage(resource.RUSAGE_SELF)
    return engine, fronts, own.ru_utime + own.ru_stime, time.perf_counter()


def _mean(windows: list[Window]) -> Window:
    results = [w.result for w in windows]
    usages = [w.usage for w in windows]
    return Window(
        Result(
            statistics.fmean(r.rows_per_s for r in results),
            statistics.fmean(r.p50_ms for r in results),
            statistics.fmean(r.p99_ms for r in results),
            sum(r.requests for r in results),
        ),
        Usage(
            statistics.fmean(u.engine_us for u in usages),
            statistics.fmean(u.fronts_us for u in usages),
            statistics.fmean(u.cores for u in usages),
            statistics.fmean(u.batch_rows for u in usages),
        ),
    )


def _row(
    load: Load, clients: int, workers: int, one: Window, many: Window, bare_rate: float
) -> str:
    """One table row; ``bare_rate``: the bare session's rows/s the report states (the mean
    of before and after: the column had used the one before, while the header said mean)."""
    big = load.model != "small"
    a, b = one.result, many.result
    versus_bare = f"{b.rows_per_s / bare_rate:.2f}x" if big else "-"
    cpu = f"{one.usage.engine_us:.0f} / {many.usage.engine_us:.0f} + {many.usage.fronts_us:.0f}"
    return (
        f"| {load} | {clients} | {workers} | {a.rows_per_s:.0f} | {b.rows_per_s:.0f} | "
        f"**{b.rows_per_s / a.rows_per_s:.2f}x** | {a.p50_ms:.2f} / {b.p50_ms:.2f} | "
        f"{a.p99_ms:.2f} / {b.p99_ms:.2f} | {cpu} | {one.usage.cores:.2f} / "
        f"{many.usage.cores:.2f} | {one.usage.batch_rows:.1f} / {many.usage.batch_rows:.1f} | "
        f"{versus_bare} |"
    )


def _report(
    big: str,
    d_model: int,
    rows: list[str],
    memory: dict[int, Memory],
    bare_rate: float,
    rounds: int,
) -> str:
    lines = [
        describe_machine(),
        "",
        f"Top-{K}, loopback, raw HTTP/1.1 closed-loop clients on the same machine. N = 1 is one "
        f"process (the default); N > 1 is N fronts + one engine, measured alternately with N = 1 "
        f"({rounds} x {MAX_SECONDS:.0f} s windows each); the fronts run at nice "
        f"{Settings().front_nice} (`LMHEAD_FRONT_NICE`). Bare onnxruntime session on `{big}` "
        f"(d_model {d_model}) at 64 rows: {bare_rate:.0f} rows/s.",
        "",
        "CPU per request: the one process / the engine + the fronts (microseconds). Cores busy: "
        "the server's processes and the clients together (the machine has "
        f"{psutil.cpu_count()}). Rows per run: the mean over the window, from the service's "
        "`lmhead_batch_rows`.",
        "",
        "| load | clients | N | N = 1 rows/s | N rows/s | N vs N = 1 | p50 ms (1 / N) | "
        "p99 ms (1 / N) | CPU us / request (1 / N) | cores busy (1 / N) | rows per run (1 / N) | "
        "N vs bare session |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "| N | engine (or the one process) RSS MB | fronts RSS MB (all) | device memory MB |",
        "|---|---|---|---|",
    ]
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


async def _drive(url: str, load: Load, clients: int, d_model: int) -> Result:
    hidden = _hidden(load.rows, d_model)
    path = f"/v1/models/{load.model}/topk"
    if load.kind == "json":
        body = orjson.dumps({"hidden_states": hidden.tolist(), "k": K})
        headers = {"content-type": "application/json"}
    else:
        stream = io.BytesIO()
        np.save(stream, hidden)
        body, headers = stream.getvalue(), {"content-type": "application/x-npy"}
        path += f"?k={K}"
    host, port = url.removeprefix("http://").split(":")
    raw = build_request(host, int(port), path, body, headers)
    run = await closed_loop(
        host, int(port), raw, clients, max_seconds=MAX_SECONDS, max_requests=MAX_REQUESTS
    )
    return _result(run.latencies, load.rows, run.elapsed)


if __name__ == "__main__":
    raise SystemExit(main())
