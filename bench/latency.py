"""One row, one client: what lmhead itself costs per request, beside the floor (issue 47).

One lmhead process (``python -m service serve``, batching on as shipped) on two random tied
heads, a 1024 x 64 head (``small``: its run costs next to nothing, so what is measured is the
service) and a 50257 x 768 head (``gpt2``), and in the same run the floor: a raw ASGI app that
reads the body and answers a fixed one (``bench.floor``) under the same uvicorn, uvloop and
httptools. Measured:

* server CPU per request: the process's CPU time (every thread's, ``/proc``) over a bounded
  count of top-10 requests (``--requests``, 2,000) from ``bench.loadgen``'s raw keep-alive
  client (whose own CPU is next to nothing), at 1 and at 16 closed-loop clients, for the
  native API with JSON and ``.npy`` (answered ``.npz``, as ``Client`` asks) and V2 with JSON
  and the binary extension (answered binary); each cell the mean of alternating rounds;
* one row, one client, p50 and p99 latency on both heads, with ``service.client.Client`` in
  binary mode and with the raw client, beside a bare onnxruntime session's one-row p50 on the
  50257 x 768 head (measured before and after the served runs, in this process);
* where the microseconds of a request go: the client's encode and decode timed in process,
  and the server's event loop under cProfile (``bench.latency_profile``).

``--baseline DIR`` (an earlier checkout, ``git worktree add``) serves that checkout's lmhead
beside this one's, alternating, so before and after come from one run.

    python -m bench.latency [--output bench/results-latency.md] [--baseline /tmp/old47]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import numpy as np
import orjson
import uvloop

from bench.latency_profile import client_costs, profile_table
from bench.loadgen import build_request, closed_loop
from bench.machine import describe_machine
from service.heads.files import HeadWeights, save_head
from service.runtime.session import HeadSession
from tests.server import free_port, running_checkout, running_server

HEADS = {"small": (1024, 64), "gpt2": (50257, 768)}
FORMATS = ("json", "npy", "v2-json", "v2-binary")
CLIENTS = (1, 16)
#: The bodies each reference server takes (lmhead and its baseline: every format).
SERVED_KINDS = {"floor": ("floor",), "lean": ("json",)}
K = 10
ROUNDS = 2
LATENCY_CALLS = 400


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--baseline", type=Path, help="an earlier checkout to compare with")
    parser.add_argument("--requests", type=int, default=2000, help="per CPU measurement")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        repository = write_heads(Path(scratch) / "models")
        text = report(repository, args.baseline, args.requests)
    print(text)
    if args.output:
        args.output.write_text(text + "\n", encoding="utf-8")
    return 0


def write_heads(repository: Path) -> Path:
    rng = np.random.default_rng(47)
    for name, (vocab, d_model) in HEADS.items():
        table = (rng.standard_normal((vocab, d_model), dtype=np.float32) * 0.05).astype(np.float32)
        save_head(HeadWeights.from_arrays(table), repository / name / "1")
    return repository


def raw_request(host: str, port: int, kind: str, model: str) -> bytes:
    """The one request a run sends again and again (``bench.loadgen``)."""
    d_model = HEADS[model][1]
    hidden = np.random.default_rng(1).standard_normal((1, d_model), dtype=np.float32)
    path = f"/v1/models/{model}/topk"
    headers = {"content-type": "application/json"}
    if kind == "json":
        body = orjson.dumps({"hidden_states": hidden.tolist(), "k": K})
    elif kind in ("npy", "floor"):
        stream = io.BytesIO()
        np.save(stream, hidden)
        body = stream.getvalue()
        headers = {"content-type": "application/x-npy", "accept": "application/x-npz"}
        path = "/" if kind == "floor" else f"{path}?k={K}"
    else:
        path = f"/v2/models/{model}/infer"
        tensor: dict[str, object] = {"name": "hidden_states", "shape": [1, d_model]}
        tensor["datatype"] = "FP32"
        parameters: dict[str, object] = {"k": K}
        if kind == "v2-json":
            tensor["data"] = hidden.reshape(-1).tolist()
            body = orjson.dumps({"inputs": [tensor], "parameters": parameters})
        else:
            tensor["parameters"] = {"binary_data_size": hidden.nbytes}
            parameters["binary_data_output"] = True
            header = orjson.dumps({"inputs": [tensor], "parameters": parameters})
            body = header + hidden.tobytes()
            headers = {
                "content-type": "application/octet-stream",
                "inference-header-content-length": str(len(header)),
            }
    return build_request(host, port, path, body, headers)


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of the process so far (``/proc/PID/task/*/schedstat``, in ns:
    ``/proc/PID/stat``'s user + system count 10 ms ticks, 3 of them per 1,000 floor requests)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError):  # a thread that ended meanwhile
            continue
    return total / 1e9


def server_pid(port: int) -> int:
    """The process serving on ``port`` (started with ``--port PORT``)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            words = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--port" in words and str(port).encode() in words and entry.name != str(os.getpid()):
            return int(entry.name)
    raise RuntimeError(f"no process serves port {port}")


def measure(url: str, pid: int, kind: str, model: str, clients: int, count: int) -> float:
    """Server CPU us per request over ``count`` requests (after a warm-up)."""
    host, port = url.removeprefix("http://").split(":")
    raw = raw_request(host, int(port), kind, model)

    def run(requests: int) -> int:
        done = uvloop.run(
            closed_loop(host, int(port), raw, clients, max_seconds=120.0, max_requests=requests)
        )
        return len(done.latencies)

    run(200)
    before = cpu_seconds(pid)
    served = run(count)
    return (cpu_seconds(pid) - before) / served * 1e6


def latency(url: str, kind: str, model: str, calls: int = LATENCY_CALLS) -> tuple[float, float]:
    """p50 and p99 ms of one client sending one row at a time (raw client)."""
    host, port = url.removeprefix("http://").split(":")
    raw = raw_request(host, int(port), kind, model)
    uvloop.run(closed_loop(host, int(port), raw, 1, max_seconds=30.0, max_requests=50))
    done = uvloop.run(closed_loop(host, int(port), raw, 1, max_seconds=30.0, max_requests=calls))
    return _percentiles(done.latencies)


def client_latency(url: str, model: str, calls: int = LATENCY_CALLS) -> tuple[float, float]:
    """p50 and p99 ms of ``Client.topk`` (binary: ``.npy`` in, ``.npz`` back), one row."""
    from service.client import Client

    hidden = np.random.default_rng(1).standard_normal((1, HEADS[model][1]), dtype=np.float32)
    times = []
    with Client(url) as client:
        for index in range(calls + 50):
            start = time.perf_counter()
            client.topk(model, hidden, K)
            if index >= 50:
                times.append(time.perf_counter() - start)
    return _percentiles(times)


def bare_latency(path: Path, calls: int = 1000) -> tuple[float, float]:
    """A bare onnxruntime session's one-row top-10, p50 and p99 ms."""
    session = HeadSession(path, tied=True)
    hidden = np.random.default_rng(1).standard_normal((1, HEADS["gpt2"][1]), dtype=np.float32)
    for _ in range(50):
        session.project(hidden, K)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        session.project(hidden, K)
        times.append(time.perf_counter() - start)
    return _percentiles(times)


def _percentiles(seconds: list[float]) -> tuple[float, float]:
    ordered = sorted(seconds)
    return statistics.median(ordered) * 1e3, ordered[int(0.99 * (len(ordered) - 1))] * 1e3


@contextmanager
def floor_server(app: str = "bench.floor:app", model: Path | None = None) -> Iterator[str]:
    """``bench.floor`` (or ``app``: ``bench.lean_head``'s, on ``model``) under uvicorn with
    uvloop and httptools, as lmhead runs."""
    port = free_port()
    command = [sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1"]
    command += ["--port", str(port), "--loop", "uvloop", "--http", "httptools", "--ws", "none"]
    command += ["--log-level", "warning", "--no-access-log", "--no-proxy-headers"]
    env = {**os.environ} | ({"LMHEAD_LEAN_MODEL": str(model)} if model else {})
    process = subprocess.Popen(command, cwd=Path(__file__).resolve().parent.parent, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.post(url, content=b"", timeout=2)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise
                time.sleep(0.1)  # polling a start-up, not synchronising a test
        yield url
    finally:
        process.terminate()
        process.wait(timeout=20)


def report(repository: Path, baseline: Path | None, count: int) -> str:
    builds = {"floor": None, "lean": None, "lmhead": None} | ({"before": None} if baseline else {})
    with ExitStack() as stack:
        servers = {"floor": stack.enter_context(floor_server())}
        small = repository / "small" / "1" / "model.onnx"
        servers["lean"] = stack.enter_context(floor_server("bench.lean_head:app", small))
        servers["lmhead"] = stack.enter_context(running_server(repository, log_level="warning"))
        if baseline is not None:
            servers["before"] = stack.enter_context(
                running_checkout(baseline.resolve(), repository, log_level="warning")
            )
        pids = {name: server_pid(int(url.rsplit(":", 1)[1])) for name, url in servers.items()}
        bare = [bare_latency(repository / "gpt2" / "1" / "model.onnx")]
        cpu: dict[tuple[str, str, int], list[float]] = {}
        for _ in range(ROUNDS):
            for clients in CLIENTS:
                for name in builds:
                    for kind in SERVED_KINDS.get(name, FORMATS):
                        us = measure(servers[name], pids[name], kind, "small", clients, count)
                        cpu.setdefault((name, kind, clients), []).append(us)
        lat: dict[tuple[str, str, str], tuple[float, float]] = {}
        bare.append(bare_latency(repository / "gpt2" / "1" / "model.onnx"))
        for model in HEADS:
            for name in builds:
                if name == "lean":
                    continue
                kinds = ("floor",) if name == "floor" else (*FORMATS, "client")
                for kind in kinds if name != "floor" or model == "small" else ():
                    url = servers[name]
                    got = (
                        client_latency(url, model)
                        if kind == "client"
                        else latency(url, kind, model)
                    )
                    lat[(name, kind, model)] = got
        bare.append(bare_latency(repository / "gpt2" / "1" / "model.onnx"))
    profiles = profile_table(repository, count // 2)
    costs = client_costs(repository)
    return _text(cpu, lat, bare, profiles, costs, baseline, count)


def _text(
    cpu: dict[tuple[str, str, int], list[float]],
    lat: dict[tuple[str, str, str], tuple[float, float]],
    bare: list[tuple[float, float]],
    profiles: list[str],
    costs: list[str],
    baseline: Path | None,
    count: int,
) -> str:
    mean = {key: statistics.fmean(values) for key, values in cpu.items()}
    names = ["lmhead"] + (["before"] if baseline else [])
    lines = [describe_machine(), ""]
    if baseline is not None:
        lines += [f"Before: `{_revision(baseline)}`; after: `{_revision(Path.cwd())}`.", ""]
    lines += [
        "Server CPU per request (us, every thread's run time from /proc/PID/task/*/schedstat "
        f"over {count} requests after 200 to warm up; mean of {ROUNDS} alternating rounds), "
        f"1024 x 64 head, one row, top-{K}; the floor is `bench.floor` under the same "
        "uvicorn, uvloop and httptools; `lean` is `bench.lean_head` there (JSON parsed, the "
        "head's session run on one thread, JSON answered: no check, batching, metric, limit "
        "or lease). Target: at most 3x the floor at 1 client, 2x at 16.",
        "",
        "| server | body | CPU us/req, 1 client | vs floor | CPU us/req, 16 clients | vs floor |",
        "|---|---|---|---|---|---|",
    ]
    floor = {clients: mean[("floor", "floor", clients)] for clients in CLIENTS}
    lines.append(f"| floor | fixed answer | {floor[1]:.0f} | 1.00x | {floor[16]:.0f} | 1.00x |")
    lean = {clients: mean[("lean", "json", clients)] for clients in CLIENTS}
    lines.append(
        f"| lean | json | {lean[1]:.0f} | {lean[1] / floor[1]:.2f}x | {lean[16]:.0f} | "
        f"{lean[16] / floor[16]:.2f}x |"
    )
    for name in names:
        for kind in FORMATS:
            one, many = mean[(name, kind, 1)], mean[(name, kind, 16)]
            lines.append(
                f"| {name} | {kind} | {one:.0f} | {one / floor[1]:.2f}x | {many:.0f} | "
                f"{many / floor[16]:.2f}x |"
            )
    lines += ["", "Each round's CPU us/req:", "", "| server | body | clients | rounds |"]
    lines += ["|---|---|---|---|"]
    for (name, kind, clients), values in cpu.items():
        lines.append(f"| {name} | {kind} | {clients} | {', '.join(f'{v:.0f}' for v in values)} |")
    bare_p50 = statistics.fmean(p50 for p50, _ in bare)
    lines += [
        "",
        f"One row, one client, latency (ms, {LATENCY_CALLS} calls after 50): the raw client per "
        "body, and `service.client.Client.topk` in binary mode (`.npy` in, `.npz` back). Bare "
        f"onnxruntime session, 50257 x 768, one row top-{K}: p50 {bare_p50:.3f} ms (mean of "
        "runs before the CPU rounds, before the latency runs and after them: "
        f"{', '.join(f'{p:.3f}' for p, _ in bare)}); target: `.npy` "
        "and V2 binary within 1 ms of it.",
        "",
        "| server | client, body | head | p50 ms | p99 ms | p50 - bare session |",
        "|---|---|---|---|---|---|",
    ]
    for (name, kind, model), (p50, p99) in lat.items():
        over = f"{p50 - bare_p50:+.3f}" if model == "gpt2" else ""
        lines.append(f"| {name} | {kind} | {model} | {p50:.3f} | {p99:.3f} | {over} |")
    return "\n".join([*lines, "", *costs, "", *profiles])


def _revision(checkout: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(checkout), "log", "-1", "--format=%h %s"], capture_output=True, text=True
    )
    return done.stdout.strip()[:72] or checkout.name


if __name__ == "__main__":
    raise SystemExit(main())
