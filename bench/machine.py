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

from service.tools.demo import write_demo_models

#: The widest vector instructions a CPU offers, best first (``/proc/cpuinfo`` flags): MLAS
#: picks its kernels by them, and quantized heads' speed follows (one "AMD EPYC" VM measured
#: int8 at 64 rows 1.26x slower than fp32 with AVX2 alone, 1.64x faster with AVX-512 VNNI).
VECTOR_ISAS = (
    ("amx_int8", "AMX"),
    ("avx512_vnni", "AVX-512 VNNI"),
    ("avx512f", "AVX-512"),
    ("avx_vnni", "AVX-VNNI"),
    ("avx2", "AVX2"),
    ("asimd", "NEON"),
)


def describe_machine() -> str:
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    cpu = names[0] if names else cpu
    flags = next(
        (
            set(line.split(":", 1)[1].split())
            for line in lines
            if line.startswith(("flags", "Features"))
        ),
        set(),
    )
    isa = next((name for flag, name in VECTOR_ISAS if flag in flags), None)
    return (
        f"Machine: {cpu}{f' ({isa})' if isa else ''}, {os.cpu_count()} cores; "
        f"onnxruntime {ort.__version__}, numpy {np.__version__}."
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
