"""The decoding step against a plain top-k of the same rows (issue 45's speed target: at most
1.2x, on the demo head and on a 128256 x 2048 head).

64 rows, each with a grammar's token bitmask and all three penalties (repetition 1.2,
presence 0.5, frequency 0.5) over 512 history tokens (256 of prompt, 256 of output), top-10
with log-probs; and the same with a draw (top_p 0.9). The masks are as a JSON grammar's steps
look: half the rows inside a string (every token but ~200 allowed), half at a structural
point (64 tokens allowed). Hidden states are peaked (a table row's direction, as a trained
trunk's confident next token), so a draw's kept set fits the sorted prefix.

Engine: the data plane in this process (``DataPlane.topk``: options, runs, the step; no
HTTP), interleaved request by request, median wall time and process CPU time (the ratios hold
on a shared machine better than the times). ``--served`` also times both through HTTP
(``.npz`` bodies, one closed-loop client), once the wire carries the options.

    python -m bench.decoding [--sizes 32000x512,128256x2048] [--rounds 15] [--output F]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import numpy.typing as npt

from bench.decoding_served import served_report
from bench.machine import describe_machine
from service.allocator import settle_allocator
from service.heads.files import HeadWeights, save_head
from service.messages import (
    DecodingOptions,
    SampleOptions,
    Target,
    TokenLists,
    TopKRequest,
    VocabularyOptions,
)
from service.metrics import Metrics
from service.plane.dataplane import DataPlane
from service.repository.registry import Registry
from service.runtime.processors import pack
from service.settings import Settings

ROWS, K, HISTORY = 64, 10, 512
#: The logit of each row's own token (the others' spread about 0.7): ~99% of the mass.
PEAK = 16.0
HEAD = Target("head")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="32000x512,128256x2048")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--served", action="store_true")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    settle_allocator()  # the service's allocator: buffers from 1 MiB up are fresh mappings
    lines = [describe_machine(), "", _legend(), ""]
    lines += ["| head | request | wall ms | CPU ms | vs plain (wall) | vs plain (CPU) |"]
    lines += ["|---|---|---|---|---|---|"]
    sizes = [tuple(int(part) for part in size.split("x")) for size in args.sizes.split(",")]
    for vocab, d_model in sizes:
        rounds = args.rounds if vocab * d_model <= 2**25 else max(3, args.rounds // 3)
        lines += _engine_rows(vocab, d_model, rounds)
    if args.served:
        lines += ["", *served_report(sizes, requests)]
    report = "\n".join(lines)
    print(report)
    if args.output:
        args.output.write_text(report + "\n", encoding="utf-8")
    return 0


def _legend() -> str:
    return (
        f"Engine (the data plane in process, no HTTP): {ROWS} rows, top-{K} with log-probs; "
        f"the step adds a bitmask per row and repetition, presence and frequency penalties over "
        f"{HISTORY} history tokens per row; interleaved, medians."
    )


def requests(table: npt.NDArray[np.float32], seed: int = 0) -> dict[str, TopKRequest]:
    """The plain top-k, the step, and the step with a draw, over the same peaked rows."""
    vocab, d_model = table.shape
    rng = np.random.default_rng(seed)
    picked = rng.choice(vocab, ROWS, replace=False)
    norms = np.linalg.norm(table[picked], axis=1, keepdims=True)
    noise = rng.standard_normal((ROWS, d_model)) * 0.1
    hidden = (table[picked] / norms**2 * PEAK + noise).astype(np.float32)  # its logit: PEAK
    allows = np.zeros((ROWS, vocab), np.bool_)
    for row in range(ROWS):
        if row % 2:  # a structural point: a few tokens, the trunk's choice among them
            allows[row, rng.choice(vocab, 64, replace=False)] = True
            allows[row, picked[row]] = True
        else:  # inside a string: all but the quotes, controls and the like
            allows[row] = True
            allows[row, rng.choice(vocab, 200, replace=False)] = False
    half = HISTORY // 2
    history = [rng.integers(0, vocab, half * ROWS) for _ in range(2)]
    lengths = np.full(ROWS, half)
    decoding = DecodingOptions(
        prompt_token_ids=TokenLists(history[0], lengths),
        output_token_ids=TokenLists(history[1], lengths),
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        token_bitmask=pack(allows),
    )
    sample = SampleOptions(seed=seed, top_p=0.9)
    return {
        "plain top-k": TopKRequest(HEAD, hidden, k=K, logprobs=True),
        "step": TopKRequest(
            HEAD, hidden, k=K, logprobs=True, vocabulary=VocabularyOptions(decoding=decoding)
        ),
        "step + draw (top_p 0.9)": TopKRequest(
            HEAD,
            hidden,
            k=K,
            logprobs=True,
            vocabulary=VocabularyOptions(decoding=decoding, sample=sample),
        ),
    }


def _engine_rows(vocab: int, d_model: int, rounds: int) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="lmhead-bench-") as directory:
        repository = Path(directory)
        rng = np.random.default_rng(1)
        table = (rng.standard_normal((vocab, d_model), dtype=np.float32) * 0.05).astype(np.float32)
        save_head(HeadWeights.from_arrays(table), repository / HEAD.model / "1")
        asked = requests(table)
        del table
        times = asyncio.run(_timed(repository, asked, rounds))
    plain_wall, plain_cpu = times["plain top-k"]
    rows = []
    for name, (wall, cpu) in times.items():
        rows.append(
            f"| {vocab} x {d_model} | {name} | {wall:.2f} | {cpu:.2f} | "
            f"{wall / plain_wall:.2f}x | {cpu / plain_cpu:.2f}x |"
        )
    return rows


async def _timed(
    repository: Path, asked: dict[str, TopKRequest], rounds: int
) -> dict[str, tuple[float, float]]:
    """Median wall and CPU milliseconds of each request, interleaved round by round."""
    settings = Settings(repository=repository, max_rows=4096)
    metrics = Metrics()
    with ThreadPoolExecutor(1) as executor:
        registry = Registry(settings, executor, metrics)
        plane = DataPlane(registry, settings, metrics)
        await registry.load_all()
        try:
            for request in asked.values():  # warm: the selection graph, the arenas
                await plane.topk(request)
            walls: dict[str, list[float]] = {name: [] for name in asked}
            cpus: dict[str, list[float]] = {name: [] for name in asked}
            for _ in range(rounds):
                for name, request in asked.items():
                    wall, cpu = time.perf_counter(), time.process_time()
                    await plane.topk(request)
                    walls[name].append(time.perf_counter() - wall)
                    cpus[name].append(time.process_time() - cpu)
        finally:
            await plane.close()
            await registry.close()
    return {
        name: (statistics.median(walls[name]) * 1e3, statistics.median(cpus[name]) * 1e3)
        for name in asked
    }


if __name__ == "__main__":
    raise SystemExit(main())
