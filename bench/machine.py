"""What benchmark reports share: the one-line machine description they start with, and the
``main`` of a report measured on freshly written demo heads."""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort

from service.demo import write_demo_models


def describe_machine() -> str:
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    for line in lines:
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return (
        f"Machine: {cpu}, {os.cpu_count()} cores; onnxruntime {ort.__version__}, "
        f"numpy {np.__version__}."
    )


def report_on_demo_heads(description: str | None, report: Callable[[Path], str]) -> int:
    """``python -m bench.X [--output FILE]``: ``report(repository)`` on fresh demo heads,
    printed, and written to FILE when given."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        repository = Path(scratch)
        write_demo_models(repository)
        text = report(repository)
    print(text)
    if args.output:
        args.output.write_text(text + "\n", encoding="utf-8")
    return 0
