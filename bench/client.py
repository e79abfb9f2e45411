"""Benchmark what ``service.client`` costs per call against a hand-built binary request.

One server on the demo heads (32000 x 512, top-10), one caller, calls one after another: the
hand-built request (``httpx.Client`` posting ``.npy``, reading the ``.npz`` answer with numpy)
and ``Client.topk`` (the same bytes both ways, plus the typed answer), interleaved call by call
so drift hits both alike; 1-row and 64-row requests. Overhead = the client's median latency
minus the hand-built one's, in ms and as a ratio.

    python -m bench.client [--output bench/results-client.md]
"""

from __future__ import annotations

import io
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import httpx
import numpy as np

from bench.machine import describe_machine, report_on_demo_heads
from service.client import Client
from tests.server import running_server

MODEL = "demo-tied"
ROWS = (1, 64)
CALLS = 400
K = 10


def main() -> int:
    return report_on_demo_heads(__doc__, _report)


def _report(repository: Path) -> str:
    lines = [
        describe_machine(),
        "",
        f"One caller, {CALLS} calls per kind, interleaved; median latency per call ({MODEL}, "
        f"top-{K}, `.npy` in, `.npz` out):",
        "",
        "| rows | hand-built httpx ms | Client.topk ms | overhead ms | client / hand-built |",
        "|---|---|---|---|---|",
    ]
    with (
        running_server(repository) as url,
        httpx.Client(base_url=url) as raw,
        Client(url) as client,
    ):
        for rows in ROWS:
            hidden = np.random.default_rng(rows).standard_normal((rows, 512), dtype=np.float32)
            hand, typed = _interleaved(
                _hand_built(raw, hidden), partial(client.topk, MODEL, hidden, K)
            )
            lines.append(
                f"| {rows} | {hand:.3f} | {typed:.3f} | {typed - hand:.3f} | {typed / hand:.3f}x |"
            )
    return "\n".join(lines)


def _hand_built(raw: httpx.Client, hidden: np.ndarray) -> Callable[[], object]:
    def call() -> object:
        buffer = io.BytesIO()
        np.save(buffer, hidden)
        answer = raw.post(
            f"/v1/models/{MODEL}/topk",
            params={"k": str(K)},
            content=buffer.getvalue(),
            headers={"content-type": "application/x-npy", "accept": "application/x-npz"},
        )
        answer.raise_for_status()
        return dict(np.load(io.BytesIO(answer.content)))

    return call


def _interleaved(first: Callable[[], object], second: Callable[[], object]) -> tuple[float, float]:
    """Median ms per call of each, alternating call by call after a warm-up."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(20):
        first()
        second()
    for _ in range(CALLS):
        for call, kept in ((first, times[0]), (second, times[1])):
            start = time.perf_counter()
            call()
            kept.append((time.perf_counter() - start) * 1000)
    return statistics.median(times[0]), statistics.median(times[1])


if __name__ == "__main__":
    sys.exit(main())
