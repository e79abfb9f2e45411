"""Benchmark hot-swaps: swap time, peak memory during a swap, memory after unload, and latency
of concurrent traffic during swaps against steady state, all in one run.

For the demo heads (32000 x 512) and a Llama-3-sized head (128256 x 2048, 1.05 GB, external
data), swap v1 (tied) -> v2 (untied) -> v3 (tied) under one name through the load API while
8 clients keep sending one-row requests (bounded in count and time).

    python -m bench.swap [--large] [--output bench/results-swap.md]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt
import psutil

from service.client import AsyncClient
from service.errors import ServiceError
from service.heads.files import HeadWeights, save_head
from tests.server import running_server

CLIENTS = 8
SIZES = {"demo": (32000, 512), "large": (128256, 2048)}


@dataclass
class Traffic:
    latencies: list[tuple[float, float]] = field(default_factory=list)  # (start, seconds)
    failures: int = 0


class PeakSampler:
    """Samples a process's RSS on a thread while a swap runs."""

    def __init__(self, pid: int) -> None:
        self._process = psutil.Process(pid)
        self._stop = threading.Event()
        self.peak = 0
        self._thread = threading.Thread(target=self._sample)

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def __enter__(self) -> PeakSampler:
        self.peak = self._process.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--large", action="store_true", help="also the 1.05 GB head")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    lines = [
        "| head | weights | swap | swap s | RSS before MB | peak during swap MB | "
        "RSS after MB | requests | failed | p99 steady ms | p99 during swaps ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size in ["demo"] + (["large"] if args.large else []):
        with tempfile.TemporaryDirectory() as scratch:
            lines += asyncio.run(_bench(Path(scratch), size))
    report = "\n".join(lines)
    print(report)
    if args.output:
        args.output.write_text(report + "\n", encoding="utf-8")
    return 0


def _weights(size: str, version: int) -> HeadWeights:
    vocab, d_model = SIZES[size]
    rng = np.random.default_rng(version)
    table = rng.standard_normal((vocab, d_model), dtype=np.float32)
    if version == 2:
        return HeadWeights.from_arrays(table, rng.standard_normal((vocab, d_model), np.float32))
    return HeadWeights.from_arrays(table)


def _write_version(root: Path, size: str, version: int, external: bool) -> None:
    save_head(_weights(size, version), root / "head" / str(version), external_data=external)


async def _bench(root: Path, size: str) -> list[str]:
    vocab, d_model = SIZES[size]
    external = size == "large"
    save_head(_weights(size, 1), root / "head" / "1", external_data=external)
    rows = []
    with running_server(root, log_level="warning", drain_timeout_s="60") as url:
        server = next(
            p for p in psutil.Process().children(recursive=True) if "serve" in p.cmdline()
        )
        traffic = Traffic()
        stop = asyncio.Event()
        hidden = np.full((1, d_model), 0.01, np.float32)
        clients = [asyncio.create_task(_client(url, hidden, traffic, stop)) for _ in range(CLIENTS)]
        warm_until = time.monotonic() + 0.5
        steady_until = warm_until + 3
        while time.monotonic() < steady_until:
            await asyncio.sleep(0.1)
        windows = []
        async with AsyncClient(url, timeout=120, retries=0) as admin:
            for version in (2, 3):
                # Made off this event loop: a blocked client loop would look like a server stall.
                await asyncio.to_thread(_write_version, root, size, version, external)
                before = server.memory_info().rss
                start = time.monotonic()
                with PeakSampler(server.pid) as sampler:
                    await admin.load("head")
                    swap = time.monotonic() - start
                    await asyncio.sleep(1.0)  # the replaced version drains and is released
                windows.append((start, start + swap + 1.0))
                after = server.memory_info().rss
                kind = "tied" if version == 3 else "untied"
                rows.append((version, kind, swap, before, sampler.peak, after))
        stop.set()
        await asyncio.gather(*clients)
    steady = [s for t, s in traffic.latencies if warm_until <= t < steady_until]
    during = [s for t, s in traffic.latencies if any(a <= t <= b for a, b in windows)]
    weight_mb = vocab * d_model * 4 / 1e6
    lines = []
    for version, kind, swap, before, peak, after in rows:
        lines.append(
            f"| {size} {vocab}x{d_model} | W = {weight_mb:.0f} MB | v{version - 1} -> v{version}"
            f" ({kind}) | {swap:.2f} | {before / 1e6:.0f} | {peak / 1e6:.0f} | {after / 1e6:.0f}"
            f" | {len(traffic.latencies)} | {traffic.failures} | {_p99(steady):.1f} |"
            f" {_p99(during):.1f} |"
        )
    return lines


async def _client(
    url: str, hidden: npt.NDArray[np.float32], traffic: Traffic, stop: asyncio.Event
) -> None:
    """One-row JSON top-k through the client, no retries: a failure is counted, not hidden."""
    async with AsyncClient(url, timeout=60, retries=0, binary=False) as client:
        for _ in range(5000):  # bounded; the swaps end well before
            if stop.is_set():
                return
            start = time.monotonic()
            try:
                await client.topk("head", hidden, 5)
            except ServiceError:
                traffic.failures += 1
            traffic.latencies.append((start, time.monotonic() - start))


def _p99(samples: list[float]) -> float:
    if not samples:
        return float("nan")
    return statistics.quantiles(samples, n=100)[98] * 1e3 if len(samples) > 1 else samples[0] * 1e3


if __name__ == "__main__":
    raise SystemExit(main())
