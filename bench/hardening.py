"""Issue 43's probe findings, before and after: the same requests against two checkouts.

Each build serves one repository (a 32000 x 8 head with an RMS norm, a 524,288 x 8 one, a
32000 x 512 one for the norm's range, and a head whose 32,000 labels are 1,024 control
characters each); for every finding the request the hostile probe sent, its status, its time
and the server's resident growth (RssAnon sampled as it runs, and again once idle).

    python -m bench.hardening --before /path/to/old/checkout [--output bench/results-hardening.md]
"""

from __future__ import annotations

import argparse
import io
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.machine import describe_machine
from service.heads.files import HeadWeights, save_head
from service.heads.norm import FinalNorm
from service.repository.disk import LABELS_FILE
from tests.server import anonymous_peak, anonymous_resident, running_checkout, server_process

MB = 2**20
#: How long a request the old build never finishes is left to run (its growth so far).
PATIENCE_S = 20.0
IDLE_S = 8.0


def _repository(root: Path) -> Path:
    rng = np.random.default_rng(3)
    norm = FinalNorm("rms", np.ones(8, np.float32), 1e-5)
    for name, vocab in (("small", 32_000), ("wide", 524_288)):
        table = rng.standard_normal((vocab, 8), dtype=np.float32)
        save_head(HeadWeights.from_arrays(table, norm=norm), root / name / "1")
    wide_norm = FinalNorm("rms", np.ones(512, np.float32), 1e-5)
    table = rng.standard_normal((32_000, 512), dtype=np.float32)
    save_head(HeadWeights.from_arrays(table, norm=wide_norm), root / "d512" / "1")
    labelled = save_head(HeadWeights.from_arrays(table[:, :8].copy()), root / "labels" / "1")
    (labelled.parent / LABELS_FILE).write_text(
        "".join(f"{i}{chr(1) * (1024 - len(str(i)))}\n" for i in range(32_000))
    )
    return root


def _npy(array: np.ndarray) -> bytes:
    stream = io.BytesIO()
    np.save(stream, array)
    return stream.getvalue()


def _states(*shape: int) -> np.ndarray:
    return np.random.default_rng(1).standard_normal(shape).astype(np.float16)


def _post(url: str, path: str, body: bytes, params: dict[str, str], kind: str) -> str:
    try:
        answer = httpx.post(
            url + path,
            params=params,
            content=body,
            headers={"content-type": kind},
            timeout=PATIENCE_S,
        )
    except httpx.TimeoutException:
        return f"no answer in {PATIENCE_S:.0f} s"
    size = len(answer.content)
    return (
        f"{answer.status_code}, {size / MB:.1f} MB answer" if size > MB else str(answer.status_code)
    )


def _measured(url: str, send: Callable[[], str]) -> dict[str, Any]:
    server = server_process(url)
    before = anonymous_resident(server)
    started = time.perf_counter()
    outcome, peak = anonymous_peak(server, send)
    seconds = time.perf_counter() - started
    deadline = time.monotonic() + IDLE_S
    while time.monotonic() < deadline:  # what it keeps once idle (the release is 0.5 s on)
        time.sleep(0.5)
    return {
        "outcome": outcome,
        "seconds": seconds,
        "peak_mb": (peak - before) / MB,
        "idle_mb": (anonymous_resident(server) - before) / MB,
    }


def _norm_ranks(url: str) -> str:
    rows = np.random.default_rng(1).standard_normal((2, 512)).astype(np.float32) * 1e18
    answer = httpx.post(
        f"{url}/v1/models/d512/topk",
        json={"hidden_states": rows.tolist(), "k": 3, "states": "residual", "logprobs": True},
        timeout=30,
    )
    if answer.status_code != 200:
        return f"{answer.status_code}"
    first = answer.json()["results"][0]
    logits = first["logits"]
    return f"top-3 {first['token_ids']}, logits {'all zero' if not any(logits) else 'ranked'}"


def _labels_state(url: str) -> str:
    index = httpx.post(f"{url}/v2/repository/index", json={}, timeout=30).json()
    entry = next(e for e in index if e["name"] == "labels")
    if entry["state"] != "READY":
        return f"{entry['state']}: {entry.get('reason', '')[:90]}"
    rows = _states(64, 8).astype(np.float32)
    return (
        _post(url, "/v1/models/labels/topk", _npy(rows), {"k": "1000"}, "application/x-npy")
        + " (npy body, JSON answer)"
    )


def run_build(source: Path, repository: Path) -> dict[str, Any]:
    found: dict[str, Any] = {}
    lens = "application/x-npy"
    with running_checkout(source, repository) as url:
        found["5. 64 rows k=1000, labels of 1,024 control characters"] = _measured(
            url, lambda: _labels_state(url)
        )
        found["1. lens 512x2048 layers x tokens, k=1000"] = _measured(
            url,
            lambda: _post(
                url, "/v1/models/small/lens", _npy(_states(512, 2048, 8)), {"k": "1000"}, lens
            ),
        )
        found["2. lens (512, 1, 8) on 524,288 tokens, k=1"] = _measured(
            url,
            lambda: _post(url, "/v1/models/wide/lens", _npy(_states(512, 1, 8)), {"k": "1"}, lens),
        )
        found["8. residual rows of 1e18, d_model 512"] = {"outcome": _norm_ranks(url)}
    return found


def _label(source: Path) -> str:
    line = subprocess.run(
        ["git", "-C", str(source), "log", "-1", "--format=%h %s"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return line[:70] or str(source)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the old checkout")
    parser.add_argument("--after", type=Path, default=Path.cwd(), help="default: this one")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        repository = _repository(Path(scratch))
        builds = {"before": run_build(args.before, repository)}
        builds["after"] = run_build(args.after, repository)
    lines = [
        describe_machine(),
        "",
        f"Before: `{_label(args.before)}`; after: `{_label(args.after)}`. RssAnon of the "
        f"server beyond its resident set before the request: the peak while it ran (at most "
        f"{PATIENCE_S:.0f} s), and {IDLE_S:.0f} s after.",
        "",
        "| finding | build | outcome | seconds | peak MB | idle MB |",
        "|---|---|---|---|---|---|",
    ]
    for finding in builds["before"]:
        for build, results in builds.items():
            row = results[finding]
            numbers = [
                f"{row[key]:.1f}" if key in row else "" for key in ("seconds", "peak_mb", "idle_mb")
            ]
            lines.append(f"| {finding} | {build} | {row['outcome']} | {' | '.join(numbers)} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output is not None:
        args.output.write_text(text)


if __name__ == "__main__":
    main()
