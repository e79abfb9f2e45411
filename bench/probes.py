"""Benchmark the event loop under large answers: how long ``/health/live`` takes to answer
while one large answer is computed, encoded and read.

A Kubernetes liveness probe gives up after 1 s (its default ``timeoutSeconds``); lmhead's
target is 100 ms, whatever the answer. One service starts on the demo heads (32000 x 512) with
the default limits but ``LMHEAD_MAX_INFLIGHT_BYTES`` (4 GiB), so that a 2,048-row ``/logits``
answer can be asked as JSON (715 MB). For each answer kind a separate process sends the one
large request and reads its whole answer, while a thread here sends ``GET /health/live`` on a
keep-alive connection every ``PROBE_EVERY_S`` and times each answer; the report gives the
probes' p50, p99 and worst latency from the request's send to its answer's last byte (and the
worst once the answer's head has come: while it is read), and the answer's size.

    python -m bench.probes [--rounds 2] [--kinds logits-json,v2-json] [--output FILE]
    python -m bench.probes --baseline ../lmhead-before --output bench/results-probes.md

``--baseline DIR`` (a checkout of an earlier commit: ``git archive`` or ``git worktree add``)
measures that checkout's service too, alternating with this one's.
"""

from __future__ import annotations

import argparse
import io
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import orjson

from bench.loadgen import build_request
from bench.machine import describe_machine
from service.tools.demo import write_demo_models
from tests.server import running_checkout, running_server

MODEL, D_MODEL = "demo-tied", 512
#: Room for the largest answers measured (a 2,048-row JSON ``/logits`` declares ~2.4 GB); the
#: other limits are the defaults.
SETTINGS = {"log_level": "warning", "max_inflight_bytes": str(4 * 2**30)}
#: Pause between one probe's answer and the next probe.
PROBE_EVERY_S = 0.02
TARGET_MS = 100.0
KUBERNETES_TIMEOUT_MS = 1000.0
#: Pause after each answer: the service hands memory back once idle (``IdleRelease``, 0.5 s
#: after), which is not the next answer's doing.
SETTLE_S = 1.0


@dataclass(frozen=True)
class Kind:
    """One large answer: its request line's path, body, headers and what it is."""

    name: str
    what: str
    path: str
    body: bytes
    headers: dict[str, str]


@dataclass
class Window:
    probes: list[tuple[float, float]]  # each probe's start (perf_counter) and latency (ms)
    answer_bytes: int
    sent_at: float  # the request's send, its answer's head, its last byte (perf_counter)
    head_at: float
    done_at: float

    def latencies(self, start: float | None = None) -> list[float]:
        """Latencies of the probes sent after ``start`` (all of them: None)."""
        return [ms for at, ms in self.probes if start is None or at >= start]


def kinds() -> dict[str, Kind]:
    """The answers measured, each as large as the default limits allow it to be asked."""
    rows = np.random.default_rng(0).standard_normal((4096, D_MODEL), dtype=np.float32)
    npy = {"content-type": "application/x-npy"}
    as_json = {**npy, "accept": "application/json"}
    logits, topk = rows[:2048], rows
    return {
        "logits-json": Kind(
            "logits-json", "/v1 logits, 2,048 rows, JSON", "logits", _npy(logits), as_json
        ),
        "logits-npy": Kind(
            "logits-npy", "/v1 logits, 2,048 rows, .npy", "logits", _npy(logits), npy
        ),
        "topk-json": Kind(
            "topk-json",
            "/v1 topk, 4,096 rows, k=1000, log-probs and token strings, JSON",
            "topk?k=1000&logprobs=true",
            _npy(topk),
            as_json,
        ),
        "v2-json": Kind("v2-json", "V2 logits, 2,048 rows, JSON", "infer", *_v2(logits, False)),
        "v2-binary": Kind(
            "v2-binary", "V2 logits, 2,048 rows, binary", "infer", *_v2(logits, True)
        ),
        "v2-classification": Kind(
            "v2-classification",
            "V2 classification=1000, 4,096 rows (value:index:label strings), JSON",
            "infer",
            *_v2(topk, False, {"classification": 1000}),
        ),
    }


def _npy(array: npt.NDArray[np.float32]) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _v2(
    rows: npt.NDArray[np.float32],
    binary: bool,
    parameters: dict[str, object] | None = None,
) -> tuple[bytes, dict[str, str]]:
    """A V2 request sending ``rows`` as binary data, asking the logits output back."""
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "hidden_states",
                    "shape": list(rows.shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": rows.nbytes},
                }
            ],
            "outputs": [
                {"name": "logits", "parameters": {"binary_data": binary, **(parameters or {})}}
            ],
        }
    )
    headers = {
        "content-type": "application/octet-stream",
        "inference-header-content-length": str(len(header)),
    }
    return header + rows.tobytes(), headers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kinds", default=",".join(kinds()))
    parser.add_argument("--baseline", type=Path)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--send", nargs=3, metavar=("FILE", "HOST", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.send:  # the large request's own process
        print(_send(Path(args.send[0]), args.send[1], int(args.send[2])))
        return 0
    chosen = [kinds()[name] for name in args.kinds.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        repository = Path(scratch)
        write_demo_models(repository)
        services: dict[str, Callable[[], AbstractContextManager[str]]] = {
            "this checkout": lambda: running_server(repository, **SETTINGS)
        }
        if args.baseline is not None:
            baseline = args.baseline.resolve()
            services = {
                "before": lambda: running_checkout(baseline, repository, **SETTINGS),
                "after": services["this checkout"],
            }
        load = os.getloadavg()[0]
        windows = _measure(services, chosen, args.rounds, repository)
    text = _report(windows, chosen, args.baseline)
    text += (
        f"\n\nLoad average (1 min) of the machine: {load:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end (other jobs share it); niceness {os.nice(0)} "
        "(the services inherit it)."
    )
    print(text)
    if args.output:
        args.output.write_text(text + "\n", encoding="utf-8")
    return 0


def _measure(
    services: dict[str, Callable[[], AbstractContextManager[str]]],
    chosen: list[Kind],
    rounds: int,
    scratch: Path,
) -> dict[tuple[str, str], list[Window]]:
    """Each service in turn (one at a time: two would share the cores), every kind, rounds."""
    windows: dict[tuple[str, str], list[Window]] = {}
    for _ in range(rounds):
        for service, start in services.items():
            with start() as url:
                for kind in chosen:
                    windows.setdefault((service, kind.name), []).append(_window(url, kind, scratch))
    return windows


def _window(url: str, kind: Kind, scratch: Path) -> Window:
    """Probe ``/health/live`` while another process sends ``kind`` and reads its answer (the
    clocks of both are the system's monotonic one)."""
    host, port = url.removeprefix("http://").split(":")
    path = (
        f"/v1/models/{MODEL}/{kind.path}" if kind.path != "infer" else f"/v2/models/{MODEL}/infer"
    )
    raw = scratch / f"{kind.name}.request"
    raw.write_bytes(build_request(host, int(port), path, kind.body, kind.headers))
    with _Probing(host, int(port)) as probes:
        sender = [sys.executable, "-m", "bench.probes", "--send", str(raw), host, port]
        sent = subprocess.run(sender, capture_output=True, text=True)
        if sent.returncode:
            raise RuntimeError(f"{kind.name}: {sent.stderr.strip()[-600:]}")
        size, *times = sent.stdout.split()
    sent_at, head_at, done_at = map(float, times)
    window = [(at, ms) for at, ms in probes if sent_at <= at <= done_at]
    time.sleep(SETTLE_S)
    return Window(window, int(size), sent_at, head_at, done_at)


class _Probe:
    """``GET /health/live`` on one keep-alive connection, timed from send to whole answer."""

    REQUEST = b"GET /health/live HTTP/1.1\r\nHost: localhost\r\n\r\n"

    def __init__(self, host: str, port: int) -> None:
        self.connection = socket.create_connection((host, port))
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def once(self) -> tuple[float, float]:
        start = time.perf_counter()
        self.connection.sendall(self.REQUEST)
        answer = b""
        while not (answer.endswith(b"}") and b"\r\n\r\n" in answer):
            chunk = self.connection.recv(4096)
            if not chunk:
                raise ConnectionError("the service closed the probe's connection")
            answer += chunk
        if not answer.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"probe answered {answer[:100]!r}")
        return start, (time.perf_counter() - start) * 1e3


class _Probing(AbstractContextManager[list[tuple[float, float]]]):
    """Probes every ``PROBE_EVERY_S`` in a thread while the block runs: their starts and
    latencies."""

    def __init__(self, host: str, port: int) -> None:
        self.probe = _Probe(host, port)
        self.latencies: list[tuple[float, float]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> list[tuple[float, float]]:
        self.probe.once()  # the connection warm before the window opens
        self.thread.start()
        return self.latencies

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.probe.connection.close()

    def _run(self) -> None:
        while not self.stop.is_set():
            self.latencies.append(self.probe.once())
            self.stop.wait(PROBE_EVERY_S)


def _send(raw: Path, host: str, port: int) -> str:
    """Send one prepared request and read its whole answer: its body's bytes, and when it
    was sent, its head came and its last byte came."""
    with socket.create_connection((host, port)) as connection:
        sent_at = time.perf_counter()
        connection.sendall(raw.read_bytes())
        answer = bytearray()
        while b"\r\n\r\n" not in answer:
            answer += connection.recv(1 << 20)
        head_at = time.perf_counter()
        head, _, rest = bytes(answer).partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise SystemExit(f"the large request failed: {head[:200]!r} {rest[:300]!r}")
        fields = dict(line.split(b":", 1) for line in head.lower().split(b"\r\n")[1:])
        length = int(fields[b"content-length"])
        left = length - len(rest)
        buffer = bytearray(1 << 20)
        while left > 0:
            got = connection.recv_into(buffer, min(left, len(buffer)))
            if not got:
                raise SystemExit(f"the answer ended {left} bytes short")
            left -= got
    return f"{length} {sent_at} {head_at} {time.perf_counter()}"


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def _report(
    windows: dict[tuple[str, str], list[Window]], chosen: list[Kind], baseline: Path | None
) -> str:
    names = {kind.name: kind.what for kind in chosen}
    lines = [
        describe_machine(),
        "",
        f"`GET /health/live` every {PROBE_EVERY_S * 1e3:.0f} ms on a keep-alive connection "
        f"while another process sends one large request to `{MODEL}` (32000 x 512; default "
        "limits but `LMHEAD_MAX_INFLIGHT_BYTES` = 4 GiB) and reads its whole answer; latency "
        "from the probe's send to its whole answer, for the probes sent between the large "
        "request's send and its answer's last byte (the last column: once its head came, "
        f"while it was read). Target: every probe within {TARGET_MS:.0f} ms (a Kubernetes "
        f"probe fails after {KUBERNETES_TIMEOUT_MS / 1e3:.0f} s)."
        + (f" Before: the checkout in `{baseline.name}`." if baseline else ""),
        "",
        "| service | answer | answer MB | answer s | probes | p50 ms | p99 ms | worst ms "
        "| worst ms while read |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (service, name), runs in windows.items():
        probes = [ms for window in runs for ms in window.latencies()]
        reading = [ms for window in runs for ms in window.latencies(window.head_at)]
        seconds = statistics.mean(window.done_at - window.sent_at for window in runs)
        lines.append(
            f"| {service} | {names[name]} | {runs[0].answer_bytes / 1e6:.0f} | {seconds:.1f} "
            f"| {len(probes)} | {statistics.median(probes):.1f} "
            f"| {_percentile(probes, 0.99):.1f} | {max(probes):.1f} "
            f"| {max(reading, default=float('nan')):.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
