"""``/verify`` against a plain ``/topk`` of the same rows (issue 46's speed target: at most
1.25x): 64 sequences of K = 4 drafts (320 rows: four drafted positions and one more), with
the draft's probabilities, and with drafts taken as certain; top-10 for the ``/topk``.

Engine: the data plane in this process (no HTTP), interleaved request by request, median
wall time (the ratio holds on a shared machine better than the times).

    python -m bench.verify [--sizes 32000x512,128256x2048] [--rounds 7]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from bench.machine import describe_machine
from service.heads.files import HeadWeights, save_head
from service.messages import Target, TopKRequest
from service.metrics import Metrics
from service.plane.dataplane import DataPlane
from service.repository.registry import Registry
from service.settings import Settings
from service.verify_messages import VerifyRequest

SEQUENCES, DRAFTS, K = 64, 4, 10
HEAD = Target("head")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="32000x512,128256x2048")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    print(describe_machine())
    print("| head | /topk ms | /verify draft_probs ms | ratio | /verify certain ms | ratio |")
    print("|---|---|---|---|---|---|")
    for size in args.sizes.split(","):
        vocab, d_model = (int(part) for part in size.split("x"))
        print(asyncio.run(_measure(vocab, d_model, args.rounds)), flush=True)
    return 0


async def _measure(vocab: int, d_model: int, rounds: int) -> str:
    rng = np.random.default_rng(46)
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        table = rng.standard_normal((vocab, d_model), dtype=np.float32) / np.sqrt(d_model)
        save_head(HeadWeights.from_arrays(table), root / HEAD.model / "1")
        del table
        hidden = rng.standard_normal((SEQUENCES, DRAFTS + 1, d_model), dtype=np.float32)
        draft = rng.dirichlet(np.full(vocab, 0.05), size=(SEQUENCES, DRAFTS)).astype(np.float32)
        ids = np.argmax(draft, axis=2)
        settings = Settings(repository=root, max_rows=4096)
        metrics = Metrics()
        with ThreadPoolExecutor(1) as executor:
            registry = Registry(settings, executor, metrics)
            plane = DataPlane(registry, settings, metrics)
            await registry.load_all()
            rows = hidden.reshape(-1, d_model)
            calls: dict[str, Callable[[], Awaitable[Any]]] = {
                "topk": functools.partial(plane.topk, TopKRequest(HEAD, rows, K, logprobs=True)),
                "probs": functools.partial(plane.verify, VerifyRequest(HEAD, hidden, ids, draft)),
                "certain": functools.partial(plane.verify, VerifyRequest(HEAD, hidden, ids)),
            }
            times: dict[str, list[float]] = {name: [] for name in calls}
            for round_ in range(rounds + 1):
                for name, call in calls.items():
                    start = time.perf_counter()
                    await call()
                    if round_:  # the first round warms up
                        times[name].append(time.perf_counter() - start)
            await plane.close()
            await registry.close()
    topk, probs, certain = (1000 * statistics.median(times[name]) for name in calls)
    return (
        f"| {vocab} x {d_model} | {topk:.1f} | {probs:.1f} | {probs / topk:.2f}x "
        f"| {certain:.1f} | {certain / topk:.2f}x |"
    )


if __name__ == "__main__":
    raise SystemExit(main())
