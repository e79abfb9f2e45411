"""Benchmark what shadow traffic costs the primary: demo-tied shadowed by demo-untied at 0%,
10% and 100% sampling, 16 concurrent clients sending 8-row JSON requests, in one run.

    python -m bench.shadow [--output bench/results-shadow.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from bench.machine import describe_machine
from bench.serve import _drive
from service.tools.demo import write_demo_models
from tests.server import running_server

FRACTIONS = (0.0, 0.1, 1.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    lines = [
        describe_machine(),
        "",
        "| shadow sampling | rows/s | p50 ms | p99 ms | vs no shadow |",
    ]
    lines.append("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        repository = Path(scratch)
        write_demo_models(repository)
        baseline = None
        for fraction in FRACTIONS:
            shadow = {"shadow": {"model": "demo-untied", "fraction": fraction}}
            (repository / "demo-tied" / "config.json").write_text(json.dumps(shadow))
            with running_server(repository, log_level="warning") as url:
                path = f"{url}/v1/models/demo-tied/topk"
                result = asyncio.run(_drive(path, "json", 8, 16))
            baseline = baseline or result.rows_per_s
            lines.append(
                f"| {fraction:.0%} | {result.rows_per_s:.0f} | {result.p50_ms:.1f} | "
                f"{result.p99_ms:.1f} | {result.rows_per_s / baseline:.2f}x |"
            )
    report = "\n".join(lines)
    print(report)
    if args.output:
        args.output.write_text(report + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
