"""Allowed tokens served: what 1,000 ``allowed_token_ids`` cost through HTTP on the demo head,
against the whole head (``bench.vocabulary`` reports it first)."""

from __future__ import annotations

import asyncio
import io
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import numpy.typing as npt
import orjson

from bench.loadgen import build_request, closed_loop
from bench.machine import describe_machine
from service.runtime.layout import Placement, open_head
from service.tools.demo import write_demo_models
from tests.server import running_server

ALLOWED, ROWS, K, ROUNDS, WINDOW_S = 1000, 64, 10, 3, 1.5


def served_allowed_tokens() -> str:
    """The report's first section: the gather of 1,000 rows of W, and served latencies."""
    with tempfile.TemporaryDirectory(prefix="lmhead-bench-") as directory:
        repository = Path(directory)
        write_demo_models(repository)
        allowed = np.random.default_rng(2).choice(32000, ALLOWED, replace=False)
        gather = _gather_ms(repository, allowed)
        latencies = _served(repository, allowed.tolist())
    full, shaped = latencies["64 rows .npy, whole head"], latencies["64 rows .npy, allowed"]
    plain, one = latencies["1 row JSON, whole head"], latencies["1 row JSON, allowed"]
    lines = [
        describe_machine(),
        "",
        f"Demo head (32000 x 512, tied, shared memory mode, served), {ALLOWED} allowed tokens, "
        f"top-{K}, one closed-loop client, {ROUNDS} interleaved windows of {WINDOW_S:g} s "
        f"(median latency). Gathering the {ALLOWED} rows of W they cost (one take from the "
        f"mapped weight file): {gather:.2f} ms.",
        "",
        "| request | ms | vs the whole head |",
        "|---|---|---|",
    ]
    for name, ms in latencies.items():
        base = full if name.startswith("64") else plain
        lines.append(f"| {name} | {ms:.2f} | {base / ms:.2f}x |")
    lines += [
        "",
        f"64 rows with {ALLOWED} allowed tokens: {full / shaped:.1f}x faster than the whole "
        f"head; one row: {plain / one:.2f}x (no slower).",
    ]
    return "\n".join(lines)


def _gather_ms(repository: Path, allowed: npt.NDArray[np.int64]) -> float:
    with tempfile.TemporaryDirectory(prefix="lmhead-scratch-") as scratch:
        session = open_head(
            repository / "demo-tied" / "1" / "model.onnx", Placement(), scratch=Path(scratch)
        )
        candidates = session.candidates
        assert candidates is not None
        ids = allowed.astype(np.int64)
        runs = []
        for _ in range(50):
            start = time.perf_counter()
            candidates.rows.rows(ids)
            runs.append(time.perf_counter() - start)
        session.close()
    return statistics.median(runs[5:]) * 1e3


def _served(repository: Path, allowed: list[int]) -> dict[str, float]:
    rows = np.random.default_rng(3).standard_normal((ROWS, 512), dtype=np.float32)
    one = np.random.default_rng(4).standard_normal((1, 512), dtype=np.float32)
    buffer = io.BytesIO()
    np.save(buffer, rows)
    ids = orjson.dumps(allowed).decode()
    numpy = orjson.OPT_SERIALIZE_NUMPY
    with running_server(repository) as url:
        host, port = url.removeprefix("http://").split(":")
        path = "/v1/models/demo-tied/topk"
        npy = {"content-type": "application/x-npy", "accept": "application/x-npz"}
        json = {"content-type": "application/json"}
        requests = {
            "64 rows .npy, whole head": (f"{path}?k={K}", buffer.getvalue(), npy),
            "64 rows .npy, allowed": (
                f"{path}?k={K}&allowed_token_ids={ids}",
                buffer.getvalue(),
                npy,
            ),
            "1 row JSON, whole head": (
                path,
                orjson.dumps({"hidden_states": one, "k": K}, option=numpy),
                json,
            ),
            "1 row JSON, allowed": (
                path,
                orjson.dumps(
                    {"hidden_states": one, "k": K, "allowed_token_ids": allowed}, option=numpy
                ),
                json,
            ),
        }
        raw = {name: build_request(host, int(port), *request) for name, request in requests.items()}
        medians: dict[str, list[float]] = {name: [] for name in raw}
        for _ in range(ROUNDS):
            for name, request in raw.items():
                run = asyncio.run(
                    closed_loop(
                        host, int(port), request, 1, max_seconds=WINDOW_S, max_requests=5000
                    )
                )
                medians[name].append(statistics.median(run.latencies) * 1e3)
    return {name: statistics.median(values) for name, values in medians.items()}
