"""The one-line machine description every benchmark report starts with."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import numpy as np
import onnxruntime as ort


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
