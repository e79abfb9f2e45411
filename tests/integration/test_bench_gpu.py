"""bench/gpu.py on a small head: the GPU benchmark's code runs on a CPU too (a smoke test;
the numbers come from a GPU machine, see bench/results-gpu.md)."""

from __future__ import annotations

from pathlib import Path

from bench.gpu import main


def test_the_gpu_benchmark_runs_on_a_small_head(tmp_path: Path) -> None:
    output = tmp_path / "report.md"
    assert main(["--small", "--output", str(output)]) == 0
    report = output.read_text(encoding="utf-8")
    for row in ("| tied | float32 |", "| untied | float32 |", "| tied | bfloat16 |"):
        assert row in report
    for engine in ("| lmhead float32 |", "| lmhead float16 |", "| lmhead bfloat16 |"):
        assert engine in report
