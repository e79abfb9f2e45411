"""Measure what loading a head costs in resident memory, in a process of its own.

Resident memory is only meaningful in a fresh process (allocator caches, other sessions), so
tests and benchmarks run ``python -m service.tools.memory PATH --memory-mode shared`` in a
subprocess and read the one JSON line it prints.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np
import psutil

from service.allocator import peak_resident_bytes, reset_peak, settle_allocator, trim_heap
from service.heads.files import HeadWeights, save_head
from service.heads.inspector import inspect_head
from service.plane.scoring import score_rows
from service.runtime.layout import Placement, open_head
from service.runtime.providers import MEMORY_MODES
from service.runtime.session import HeadSession
from service.settings import MemoryMode


@dataclass(frozen=True)
class LoadFootprint:
    """Resident bytes added by a head, against the bytes of one (vocab, d_model) matrix.

    ``warm_bytes`` is what loading costs: the session, one 1-row warm-up run (as the
    registry loads a model) and 4096 embedding lookups spread over the table. ``batch_bytes``
    adds the working set of one run of ``rows`` rows (logits and log-softmax buffers,
    2 x rows x vocab floats, kept by onnxruntime's arena). ``score_peak_bytes`` is the peak a
    prompt of ``score_positions`` rows adds while scored as ``/score`` does (runs of
    ``score_rows`` rows, each holding its logits once on a CPU: ``service.heads.lse_graph``).
    """

    weight_bytes: int
    loaded_bytes: int
    warm_bytes: int
    batch_rows: int
    batch_bytes: int
    peak_bytes: int  # high-water mark above the starting RSS, during load and runs
    runtime_bytes: int  # onnxruntime's one-time start in the process, not counted above
    score_positions: int = 0
    score_rows: int = 0
    score_peak_bytes: int = 0

    @property
    def ratio(self) -> float:
        """Resident memory added by loading and warming, in units of W."""
        return self.warm_bytes / self.weight_bytes


def resident_bytes() -> int:
    """Resident set size of this process (anonymous and file-backed pages)."""
    return int(psutil.Process().memory_info().rss)


def start_runtime() -> int:
    """Open and run a tiny head once: onnxruntime's one-time start in a process (~10 MB
    measured: allocators, thread pools, kernel registries) is then paid and not charged to
    the head measured next. Returns the bytes it added."""
    gc.collect()
    before = resident_bytes()
    with tempfile.TemporaryDirectory() as scratch:
        table = np.random.default_rng(0).standard_normal((16, 16), dtype=np.float32)
        session = open_head(save_head(HeadWeights.from_arrays(table), scratch))
        session.project(table[:1], 1)
        session.embed(np.arange(2))
        session.close()
    trim_heap()
    return resident_bytes() - before


def measure_load(
    path: str, *, memory_mode: MemoryMode, rows: int, score_positions: int = 0
) -> LoadFootprint:
    """Load the head at ``path`` as the service does on a CPU (``layout.open_head``), warm it
    with one row, then run ``rows`` rows once: what it adds to a process already running
    onnxruntime (``start_runtime``; a server pays that once for all its heads)."""
    settle_allocator()  # as the server does
    report = inspect_head(path)
    runtime = start_runtime()
    gc.collect()
    before = resident_bytes()
    session = open_head(path, Placement(memory_mode), report=report)
    trim_heap()  # as a load does (``RecordBuilder``)
    loaded = resident_bytes() - before
    rng = np.random.default_rng(0)
    session.project(rng.standard_normal((1, session.d_model), dtype=np.float32), 10)
    session.embed(rng.integers(0, session.vocab_size, 4096))  # lookups spread over the table
    warm = resident_bytes() - before
    session.project(rng.standard_normal((rows, session.d_model), dtype=np.float32), 10)
    batch = resident_bytes() - before
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before  # Linux: KiB
    matrix_bytes = session.vocab_size * session.d_model * 4
    footprint = LoadFootprint(matrix_bytes, loaded, warm, rows, batch, peak, runtime)
    if not score_positions:
        return footprint
    step, score_peak = _scoring_peak(session, score_positions)
    return replace(
        footprint, score_positions=score_positions, score_rows=step, score_peak_bytes=score_peak
    )


def _scoring_peak(session: HeadSession, positions: int) -> tuple[int, int]:
    """Rows per scoring run, and the peak resident bytes scoring ``positions`` rows adds
    (the kernel's high-water mark, reset first)."""
    rng = np.random.default_rng(1)
    hidden = rng.standard_normal((positions, session.d_model), dtype=np.float32)
    targets = rng.integers(0, session.vocab_size, positions)
    step = score_rows(session.vocab_size, positions, session.score_copies)
    trim_heap()
    reset_peak()
    before = resident_bytes()
    for start in range(0, positions, step):
        session.score(hidden[start : start + step], targets[start : start + step], 10)
    return step, peak_resident_bytes() - before


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.tools.memory", description=__doc__)
    parser.add_argument("path")
    parser.add_argument("--memory-mode", choices=MEMORY_MODES, default="shared")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--score-positions", type=int, default=0)
    args = parser.parse_args(argv)
    footprint = measure_load(
        args.path,
        memory_mode=args.memory_mode,
        rows=args.rows,
        score_positions=args.score_positions,
    )
    print(json.dumps({**asdict(footprint), "ratio": footprint.ratio}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
