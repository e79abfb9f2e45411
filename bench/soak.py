"""A bounded soak: valid and hostile traffic at once while versions are swapped (loopback).

Clients send valid top-k requests (JSON and .npy) and check every answer against the numpy
reference of the version it names; other clients send the hostile requests of issue 13 class 4
and expect a 4xx; a loader publishes a new version (tied and untied in turn) every few seconds;
a prober times ``/health/live``. At the end: wrong answers, failed valid requests, 5xx answers,
the server's peak resident memory against models + the documented worst case, and the
liveness p99. Everything is bounded in time and in count.

    python -m bench.soak [--seconds 180] [--output bench/results-soak.md]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import numpy.typing as npt

from bench.machine import describe_machine
from service.budget import worst_case_extra_bytes
from service.client import Client
from service.errors import ServiceError
from service.heads.files import HeadWeights, save_head
from service.heads.reference import top_k
from service.settings import Settings
from tests.conftest import reference_logits
from tests.server import peak_resident, running_server, server_process

VOCAB, D_MODEL, K = 8000, 256, 5
SWAP_EVERY_S = 3.0
MAX_REQUESTS_PER_CLIENT = 20000
SETTINGS = {
    "max_inflight_bytes": str(256 * 2**20),
    "max_logits_bytes": str(64 * 2**20),
    "provider": "cpu",  # the bound is on host memory
}
HOSTILE: list[tuple[str, bytes, dict[str, str]]] = [
    ("/v1/models/head/topk", b'{"hidden_states": [[1, 2', {"content-type": "application/json"}),
    ("/v1/models/head/topk", b'{"hidden_states": [["1.5"]]}', {"content-type": "application/json"}),
    ("/v1/models/head/topk", b'{"hidden_states": [[true]]}', {"content-type": "application/json"}),
    ("/v1/models/head/topk", b"[" * 300 + b"]" * 300, {"content-type": "application/json"}),
    (
        "/v1/models/head/topk",
        b'{"hidden_states": [[' + b"0.5," * (D_MODEL - 1) + b'0.5]], "temperature": 1e-45}',
        {"content-type": "application/json"},
    ),
    ("/v1/models/head/topk", b'{"hidden_states": [[1e999]]}', {"content-type": "application/json"}),
    ("/v1/models/head/topk", b'{"k": "3"}', {"content-type": "application/json"}),
    ("/v1/models/head/topk?version=%C2%B2", b"{}", {"content-type": "application/json"}),
    ("/v1/models/head/topk?version=" + "9" * 5000, b"{}", {"content-type": "application/json"}),
    ("/v1/models/head/topk", b"{}", {"content-type": "x/" + "y" * 5000}),
    (
        "/v2/models/head/infer",
        json.dumps(
            {"inputs": [{"name": "hidden_states", "shape": [2**63, 0], "datatype": "FP32"}]}
        ).encode(),
        {"content-type": "application/json"},
    ),
    (
        "/v2/models/head/infer",
        json.dumps(
            {"inputs": [{"name": "input_ids", "shape": [1], "datatype": "INT32", "data": [2**40]}]}
        ).encode(),
        {"content-type": "application/json"},
    ),
    ("/v1/models/head/embed", b'{"input_ids": [1.9, 2.9]}', {"content-type": "application/json"}),
    ("/v1/models/nope%0a/topk", b"{}", {"content-type": "application/json"}),
]


@dataclass
class SoakReport:
    seconds: float
    valid: int = 0
    wrong: int = 0
    failed_valid: int = 0
    hostile: int = 0
    hostile_statuses: Counter[int] = field(default_factory=Counter)
    server_errors: int = 0
    swaps: int = 0
    versions_seen: set[int] = field(default_factory=set)
    live_ms: list[float] = field(default_factory=list)
    peak_over_models: int = 0
    bound: int = 0

    @property
    def live_p99_ms(self) -> float:
        ordered = sorted(self.live_ms)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0


def _weights(version: int) -> HeadWeights:
    rng = np.random.default_rng(version)
    table = rng.standard_normal((VOCAB, D_MODEL), dtype=np.float32)
    if version % 2:
        return HeadWeights.from_arrays(table)
    return HeadWeights.from_arrays(table, rng.standard_normal((VOCAB, D_MODEL), dtype=np.float32))


def _publish(root: Path, version: int) -> npt.NDArray[np.int64]:
    """Write a version beside the model and rename it into place; its reference top-k."""
    staging = root / "head" / ".incoming"
    save_head(_weights(version), staging)
    final = root / "head" / str(version)
    staging.rename(final)
    return np.asarray(top_k(reference_logits(final, HIDDEN), K)[1])


HIDDEN = np.random.default_rng(99).standard_normal((32, D_MODEL)).astype(np.float32)


def run_soak(seconds: float) -> SoakReport:
    report = SoakReport(seconds)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        expected = {1: _publish(root, 1)}
        with running_server(root, **SETTINGS) as url:
            server = server_process(url)
            models_loaded = server.memory_info().rss
            stop = threading.Event()
            lock = threading.Lock()
            workers = [
                threading.Thread(target=_valid, args=(url, expected, report, lock, stop, i))
                for i in range(3)
            ]
            workers += [
                threading.Thread(target=_hostile, args=(url, report, lock, stop)),
                threading.Thread(target=_prober, args=(url, report, stop)),
            ]
            for worker in workers:
                worker.start()
            _swapper(url, root, expected, report, stop, seconds)
            stop.set()
            for worker in workers:
                worker.join(timeout=60)
            report.peak_over_models = peak_resident(server) - models_loaded
    report.bound = worst_case_extra_bytes(Settings(**SETTINGS))  # type: ignore[arg-type]
    return report


def _swapper(
    url: str,
    root: Path,
    expected: dict[int, npt.NDArray[np.int64]],
    report: SoakReport,
    stop: threading.Event,
    seconds: float,
) -> None:
    deadline = time.monotonic() + seconds
    version = 1
    with Client(url, timeout=60, retries=0) as admin:
        while time.monotonic() < deadline and not stop.is_set():
            if stop.wait(min(SWAP_EVERY_S, max(0.0, deadline - time.monotonic()))):
                return
            if time.monotonic() >= deadline:
                return
            version += 1
            expected[version] = _publish(root, version)
            admin.load("head")  # a failed load raises ModelLoadFailed: the soak stops
            report.swaps += 1
            shutil.rmtree(root / "head" / str(version - 1))


def _valid(
    url: str,
    expected: dict[int, npt.NDArray[np.int64]],
    report: SoakReport,
    lock: threading.Lock,
    stop: threading.Event,
    seed: int,
) -> None:
    rng = np.random.default_rng(seed)
    clients = [Client(url, timeout=60, retries=0, binary=binary) for binary in (False, True)]
    try:
        for _ in range(MAX_REQUESTS_PER_CLIENT):
            if stop.is_set():
                return
            rows = rng.choice(len(HIDDEN), size=int(rng.integers(1, 9)), replace=False)
            answer = _topk(clients[int(rng.integers(2))], HIDDEN[rows])
            with lock:
                report.valid += 1
                if answer is None:
                    report.failed_valid += 1
                    continue
                version, ids = answer
                report.versions_seen.add(version)
                if not np.array_equal(ids, expected[version][rows]):
                    report.wrong += 1
    finally:
        for client in clients:
            client.close()


def _topk(
    client: Client, hidden: npt.NDArray[np.float32]
) -> tuple[int, npt.NDArray[np.int64]] | None:
    """The version that answered and its top-k ids (the client's .npy or JSON wire)."""
    try:
        answer = client.topk("head", hidden, K)
    except (ServiceError, httpx.TransportError):
        return None
    return answer.version, answer.token_ids


def _hostile(url: str, report: SoakReport, lock: threading.Lock, stop: threading.Event) -> None:
    with httpx.Client(base_url=url, timeout=60) as client:
        for index in range(MAX_REQUESTS_PER_CLIENT):
            if stop.is_set():
                return
            path, body, headers = HOSTILE[index % len(HOSTILE)]
            status = client.post(path, content=body, headers=headers).status_code
            with lock:
                report.hostile += 1
                report.hostile_statuses[status] += 1
                report.server_errors += status >= 500


def _prober(url: str, report: SoakReport, stop: threading.Event) -> None:
    with httpx.Client(base_url=url, timeout=60) as client:
        while not stop.wait(0.05):
            begin = time.perf_counter()
            status = client.get("/health/live").status_code
            report.live_ms.append((time.perf_counter() - begin) * 1e3)
            report.server_errors += status >= 500


def format_report(report: SoakReport) -> str:
    statuses = ", ".join(f"{s}: {n}" for s, n in sorted(report.hostile_statuses.items()))
    return "\n".join(
        [
            describe_machine(),
            "",
            f"Soak of {report.seconds:.0f} s: 3 valid clients (JSON and .npy top-k, checked "
            "against the numpy reference of the version each answer names), 1 hostile client, "
            f"a liveness prober, a tied/untied swap every {SWAP_EVERY_S:.0f} s.",
            "",
            "| measure | value |",
            "|---|---|",
            f"| valid requests | {report.valid} |",
            f"| wrong answers | {report.wrong} |",
            f"| failed valid requests | {report.failed_valid} |",
            f"| hostile requests (status: count) | {report.hostile} ({statuses}) |",
            f"| 5xx answers | {report.server_errors} |",
            f"| swaps published / versions seen in answers | {report.swaps} / "
            f"{len(report.versions_seen)} |",
            f"| peak RSS over the loaded models / documented bound | "
            f"{report.peak_over_models / 2**20:.0f} MB / {report.bound / 2**20:.0f} MB |",
            f"| /health/live p50 / p99 ms | {statistics.median(report.live_ms):.1f} / "
            f"{report.live_p99_ms:.1f} |",
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    text = format_report(run_soak(args.seconds))
    print(text)
    if args.output:
        args.output.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
