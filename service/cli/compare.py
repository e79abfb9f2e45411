"""``lmhead compare``: ask the running service to contrast two heads, add each head's resident
memory measured in a fresh process, and print a side-by-side table (or the JSON)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from service.cli.arguments import CommandError
from service.client import Client
from service.errors import ServiceError
from service.heads import MODEL_FILE


def compare_served(
    url: str,
    model_a: str,
    model_b: str,
    hidden_path: Path,
    targets_path: Path | None,
    k: int,
    repository: Path,
) -> dict[str, Any]:
    options: dict[str, Any] = {"k": k, "measure_speed": True}
    if targets_path is not None:
        options["target_ids"] = np.load(targets_path)
    try:
        with Client(url.rstrip("/"), timeout=300) as client:
            report = client.compare(model_a, model_b, np.load(hidden_path), **options)
    except httpx.TransportError as error:
        raise CommandError(f"{url} is not reachable: {error}") from None
    except ServiceError as error:
        raise CommandError(f"the service answered {error.status}: {error.message}") from None
    for block in report["models"]:
        block["resident_bytes"] = _resident(repository, block)
    missing = [block["name"] for block in report["models"] if block["resident_bytes"] is None]
    if missing:  # measured from the files, in a fresh process: say why there is no number
        report["note"] = (
            f"resident bytes n/a: no model file of {', '.join(missing)} under {repository} "
            "(--repository, or LMHEAD_REPOSITORY)"
        )
    return report


def _resident(repository: Path, block: dict[str, Any]) -> int | None:
    """Resident bytes of the head loaded alone in a fresh process (None without the file)."""
    path = repository / block["name"] / str(block["version"]) / MODEL_FILE
    if not path.is_file():
        return None
    command = [sys.executable, "-m", "service.tools.memory", str(path), "--memory-mode"]
    command += [block["memory_mode"]]
    measured = json.loads(subprocess.run(command, capture_output=True, check=True).stdout)
    return int(measured["warm_bytes"])


def format_comparison(report: dict[str, Any]) -> str:
    a, b = report["models"]
    rows = [
        ("", a["name"], b["name"]),
        ("tied", str(a["tied"]), str(b["tied"])),
        ("parameters", f"{a['parameters']:,}", f"{b['parameters']:,}"),
        ("file bytes", f"{a['file_bytes']:,}", f"{b['file_bytes']:,}"),
        ("resident bytes", _bytes(a.get("resident_bytes")), _bytes(b.get("resident_bytes"))),
        ("rows/s @64", f"{a['rows_per_s']:.0f}", f"{b['rows_per_s']:.0f}"),
    ]
    if "nll" in a:
        rows += [
            ("NLL", f"{a['nll']:.4f}", f"{b['nll']:.4f}"),
            ("perplexity", _perplexity(a["perplexity"]), _perplexity(b["perplexity"])),
            ("rows won", f"{a['wins']:.1%}", f"{b['wins']:.1%}"),
            ("rows tied", f"{report['ties']:.1%}", ""),
        ]
    width = max(len(cell) for row in rows for cell in row)
    lines = [" ".join(cell.ljust(width) for cell in row) for row in rows]
    kl_ab, kl_ba = report["kl_ab"], report["kl_ba"]
    lines += [
        "",
        f"rows {report['rows']}, top-1 agreement {report['top1_agreement']:.1%}, "
        f"top-{report['k']} overlap (Jaccard) {report['topk_overlap']:.3f}",
        f"KL(A||B) mean {kl_ab['mean']:.4g} p50 {kl_ab['p50']:.4g} p90 {kl_ab['p90']:.4g} "
        f"max {kl_ab['max']:.4g}",
        f"KL(B||A) mean {kl_ba['mean']:.4g} p50 {kl_ba['p50']:.4g} p90 {kl_ba['p90']:.4g} "
        f"max {kl_ba['max']:.4g}",
    ]
    if "note" in report:
        lines.append(report["note"])
    return "\n".join(lines)


def _bytes(value: int | None) -> str:
    return "n/a" if value is None else f"{value:,}"


def _perplexity(value: float | None) -> str:
    """JSON carries a perplexity past float64 (NLL over ~709) as null."""
    return "inf" if value is None else f"{value:.2f}"
