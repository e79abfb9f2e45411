"""Benchmark tied vs untied heads in each memory mode: file size, resident memory, speed.

Every configuration runs in the same process, interleaved run by run, so the ratios hold on a
shared, noisy machine; resident memory is measured in a fresh subprocess per configuration.

    python -m bench.heads [--sizes 32000x512,50257x768] [--output bench/results-heads.md]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.machine import describe_machine
from service.heads import HeadWeights, save_head
from service.layout import Placement, open_head
from service.runtime import MEMORY_MODES, HeadSession
from service.settings import MemoryMode

ROWS = (1, 8, 64, 512)
REPEATS = {1: 60, 8: 40, 64: 20, 512: 6}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="32000x512,50257x768")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    lines = [f"{describe_machine()} Medians of interleaved runs.", "", _header()]
    for size in args.sizes.split(","):
        vocab, d_model = (int(part) for part in size.split("x"))
        with tempfile.TemporaryDirectory() as scratch:
            lines += _bench_size(Path(scratch), vocab, d_model)
    table = "\n".join(lines)
    print(table)
    if args.output:
        args.output.write_text(table + "\n", encoding="utf-8")
    return 0


def _header() -> str:
    cells = ["head", "vocab x d", "memory mode", "file MB", "resident / W"]
    cells += [f"{rows} row{'s' * (rows > 1)} ms" for rows in ROWS] + ["vs fast @64"]
    return "| " + " | ".join(cells) + " |\n|" + "---|" * len(cells)


def _bench_size(scratch: Path, vocab: int, d_model: int) -> list[str]:
    rng = np.random.default_rng(0)
    table = rng.standard_normal((vocab, d_model), dtype=np.float32)
    paths = {
        "tied": save_head(HeadWeights.from_arrays(table), scratch / "tied"),
        "untied": save_head(
            HeadWeights.from_arrays(table, table[rng.permutation(vocab)]), scratch / "untied"
        ),
    }
    del table
    configs = [(kind, mode) for kind in paths for mode in MEMORY_MODES]
    sessions = {
        (kind, mode): open_head(paths[kind], Placement(mode)) for kind, mode in configs
    }
    timings = {rows: _interleaved(sessions, rows, d_model) for rows in ROWS}
    rows_out = []
    for kind, mode in configs:
        ratio = _resident_ratio(paths[kind], mode)
        fast = timings[64][(kind, "fast")]
        cells = [
            kind,
            f"{vocab} x {d_model}",
            mode,
            f"{paths[kind].stat().st_size / 1e6:.0f}",
            f"{ratio:.2f}",
            *(f"{timings[rows][(kind, mode)]:.2f}" for rows in ROWS),
            f"{timings[64][(kind, mode)] / fast:.2f}x",
        ]
        rows_out.append("| " + " | ".join(cells) + " |")
    return rows_out


def _interleaved(
    sessions: dict[tuple[str, MemoryMode], HeadSession], rows: int, d_model: int
) -> dict[tuple[str, MemoryMode], float]:
    hidden = np.random.default_rng(rows).standard_normal((rows, d_model), dtype=np.float32)
    samples: dict[tuple[str, MemoryMode], list[float]] = {key: [] for key in sessions}
    for session in sessions.values():
        session.project(hidden, 10)
    for _ in range(REPEATS[rows]):
        for key, session in sessions.items():
            start = time.perf_counter()
            session.project(hidden, 10)
            samples[key].append(time.perf_counter() - start)
    return {key: float(np.median(values)) * 1e3 for key, values in samples.items()}


def _resident_ratio(path: Path, mode: str) -> float:
    command = [sys.executable, "-m", "service.memory", str(path), "--memory-mode", mode]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)["ratio"])


if __name__ == "__main__":
    raise SystemExit(main())
