"""Benchmark what the request options cost on the engine: allowed tokens (candidates) against
the full head, sampling against plain top-k, prompt scoring (memory and time) against a plain
top-k run over the same rows, and a head trimmed to a quarter of its tokens (``lmhead trim``;
time and resident memory) against the full one.

Timed in one process, interleaved run by run (the ratios hold on a noisy machine); a run is
``HeadSession`` plus the numpy the data plane adds, without HTTP. Hidden states are *peaked*
(a table row's direction, as a trained trunk's confident next token): the sampling prefix
then holds the kept set; a flat distribution would send rows to the exact fallback.
Prompt scoring's peak memory is the process's peak resident set beyond the loaded head
(``/proc/self/clear_refs`` resets it), in a fresh subprocess per measurement.

Allowed tokens are also measured served, on the demo head (32000 x 512) through HTTP with
one closed-loop client, interleaved: 64 ``.npy`` rows with 1,000 allowed tokens against the
whole head, and one JSON row with and without them; and the gather of 1,000 rows of W that
the allowed tokens cost (``--served-only`` measures just that part).

    python -m bench.vocabulary [--size 128256x2048] [--rows 64] [--positions 4096] [--output F]
                               [--served-only]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import numpy.typing as npt

from bench.allowed_served import served_allowed_tokens
from service.allocator import peak_resident_bytes, reset_peak
from service.heads.files import HeadWeights, save_head
from service.limits import Limits
from service.plane.scoring import score_rows
from service.runtime.layout import Placement, open_head
from service.runtime.logmath import logsumexp
from service.runtime.session import HeadSession
from service.runtime.vocabulary import SampleSpec, sample_sorted, top_sorted
from service.tools.memory import resident_bytes
from service.tools.trim import trim_version

REPEATS = 7
K = 10
#: Alternated rounds of the prompt-scoring probes (each a fresh process).
SCORE_ROUNDS = 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="128256x2048")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--positions", type=int, default=4096)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--served-only", action="store_true")
    parser.add_argument("--probe", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        print(json.dumps(_measure(Path(args.probe[0]), args.probe[1], int(args.probe[2]))))
        return 0
    report = served_allowed_tokens()
    if not args.served_only:
        report += "\n\n" + _engine_report(args.size, args.rows, args.positions)
    print(report)
    if args.output:
        args.output.write_text(report + "\n")
    return 0


def _engine_report(size: str, rows: int, positions: int) -> str:
    vocab, d_model = (int(part) for part in size.split("x"))
    with tempfile.TemporaryDirectory(prefix="lmhead-bench-") as directory:
        path = Path(directory) / "tied" / "1"
        table = np.random.default_rng(0).standard_normal((vocab, d_model), dtype=np.float32)
        save_head(HeadWeights.from_arrays(table * np.float32(0.02)), path)
        del table
        keep = np.random.default_rng(5).choice(vocab, vocab // 4, replace=False)
        trimmed = trim_version(directory, "tied", 1, keep, "trimmed")
        return _report(path, trimmed, vocab, d_model, rows, positions)


def _report(path: Path, trimmed: Path, vocab: int, d_model: int, rows: int, positions: int) -> str:
    session = open_head(path / "model.onnx", Placement())
    hidden = _peaked(session, rows)
    times, fallbacks = _times(session, open_head(trimmed / "model.onnx"), hidden, vocab)
    full = times["full head, top-10"]
    lines = [
        f"Head {vocab} x {d_model} (tied, float32, shared memory mode), {rows} rows, "
        f"median of {REPEATS} interleaved runs:",
        "",
        "| run | ms | speed-up vs full head |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {ms:.2f} | {full / ms:.2f}x |" for name, ms in times.items()]
    memory = {name: _probe(head, "resident", 0)["resident_mb"] for name, head in
              (("full", path), ("trimmed", trimmed))}  # fmt: skip
    lines += [
        "",
        f"Sampling: at most {fallbacks} of {rows} rows per run needed the exact full-logits path.",
        "",
        "Resident memory added by loading the head and one run (fresh process each):",
        "",
        "| head | MB | vs full |",
        "|---|---|---|",
        f"| full, {vocab} tokens | {memory['full']:.0f} | 1.00x |",
        f"| trimmed (`lmhead trim`), {vocab // 4} tokens | {memory['trimmed']:.0f} | "
        f"{memory['trimmed'] / memory['full']:.2f}x |",
    ]
    probes: dict[str, list[dict[str, float]]] = {"plain": [], "score": []}
    for _ in range(SCORE_ROUNDS):  # alternated: both kinds see the same machine
        for kind, results in probes.items():
            results.append(_probe(path, kind, positions))
    plain, scored = (
        {key: statistics.median(result[key] for result in results) for key in results[0]}
        for results in probes.values()
    )
    lines += [
        "",
        f"Prompt scoring of {positions} positions (target log-prob, rank, top-10 alternatives) "
        f"in runs of {scored['rows_per_run']:.0f} rows, against plain top-10 over the same rows "
        f"in the service's runs of {plain['rows_per_run']:.0f} (fresh process each, "
        f"{SCORE_ROUNDS} alternated rounds, medians):",
        "",
        "| run | seconds | peak extra memory MB | time vs plain |",
        "|---|---|---|---|",
        f"| plain top-10 | {plain['seconds']:.2f} | {plain['peak_mb']:.0f} | 1.00x |",
        f"| prompt scoring | {scored['seconds']:.2f} | {scored['peak_mb']:.0f} | "
        f"{scored['seconds'] / plain['seconds']:.2f}x |",
        "",
        f"Scoring takes {scored['seconds'] / plain['seconds']:.2f}x the plain run's time with "
        f"{scored['peak_mb']:.0f} MB of extra memory.",
    ]
    return "\n".join(lines)


def _peaked(session: HeadSession, rows: int) -> npt.NDArray[np.float32]:
    """Rows pointing at a token each (scaled so it holds ~98% of the mass), plus noise."""
    rng = np.random.default_rng(1)
    ids = rng.integers(0, session.vocab_size, rows)
    directions = session.embed(ids)
    scale = (np.log(session.vocab_size) + 4.0) / (directions**2).sum(axis=1, keepdims=True)
    noise = rng.standard_normal(directions.shape).astype(np.float32) * 0.3
    peaked: npt.NDArray[np.float32] = (directions * scale + noise).astype(np.float32)
    return peaked


def _times(
    session: HeadSession, trimmed: HeadSession, hidden: npt.NDArray[np.float32], vocab: int
) -> tuple[dict[str, float], int]:
    """Median ms per run, and the most rows one sampling run sent to the full-logits path."""
    rng = np.random.default_rng(2)
    candidates = session.candidates
    assert candidates is not None
    ones = np.ones(len(hidden), np.float32)
    spec = SampleSpec(top_p=0.9, seed=3)
    fallbacks: list[int] = []

    def restricted(count: int) -> Callable[[], object]:
        ids = rng.choice(vocab, count, replace=False)

        def run() -> object:
            logits = candidates(hidden, ids, ones)
            return top_sorted(logits, ids, K), logsumexp(logits)

        return run

    def sampled() -> object:
        result = session.project(hidden, 64)
        index, inside = sample_sorted(
            result.topk_logits, result.logsumexp, spec, spec.uniforms(len(hidden)), vocab
        )
        for row in np.flatnonzero(~inside):  # the service's exact fallback, row by row
            full = session.project(hidden[row : row + 1], 1, full_logits=True).logits
            assert full is not None
            order = np.argsort(-full[0], kind="stable")
            draw = spec.uniforms(int(row) + 1)[int(row) :]
            sample_sorted(full[:, order], result.logsumexp[row : row + 1], spec, draw, vocab)
        fallbacks.append(int((~inside).sum()))
        return index

    runs: dict[str, Callable[[], object]] = {
        "full head, top-10": lambda: session.project(hidden, K),
        "1000 allowed tokens": restricted(1000),
        "10 allowed tokens": restricted(10),
        "top-10 + sampling (top_p 0.9)": sampled,
        f"head trimmed to {trimmed.vocab_size} tokens, top-10": lambda: trimmed.project(hidden, K),
    }
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        run()
    for _ in range(REPEATS):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            samples[name].append((time.perf_counter() - start) * 1000)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    return medians, max(fallbacks)


def _probe(path: Path, kind: str, positions: int) -> dict[str, float]:
    """``_measure`` in a fresh process: its peak memory is that run's alone."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.vocabulary", "--probe", str(path), kind, str(positions)],
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, float] = json.loads(done.stdout)
    return result


def _measure(path: Path, kind: str, positions: int) -> dict[str, float]:
    if kind == "resident":
        before = resident_bytes()
        opened = open_head(path / "model.onnx", Placement())
        opened.project(np.zeros((1, opened.d_model), np.float32), K)
        return {"resident_mb": (resident_bytes() - before) / 2**20}
    session = open_head(path / "model.onnx", Placement())
    vocab = session.vocab_size
    rng = np.random.default_rng(4)
    hidden = rng.standard_normal((positions, session.d_model), dtype=np.float32)
    targets = rng.integers(0, vocab, positions)
    session.project(hidden[:1], K)
    reset_peak()
    base = resident_bytes()
    start = time.perf_counter()
    per_run = Limits(4096, 1000, 256 * 2**20, 2**30).rows_per_run(vocab)
    step = per_run if kind == "plain" else score_rows(vocab, per_run, session.score_copies)
    for i in range(0, positions, step):
        if kind == "plain":
            session.project(hidden[i : i + step], K)
        else:
            session.score(hidden[i : i + step], targets[i : i + step], K)
    seconds = time.perf_counter() - start
    peak_mb = (peak_resident_bytes() - base) / 2**20
    return {"seconds": seconds, "peak_mb": peak_mb, "rows_per_run": step}


if __name__ == "__main__":
    sys.exit(main())
