"""The logit lens served: what ``/lens`` costs against a plain ``/topk`` over the same rows,
and the memory it holds.

A tied head with a final RMS norm (default 128256 x 2048, Llama-3.2-1B's shape) is served
by one process; ``/lens`` reads LAYERS x TOKENS residual states (``.npy`` body, ``.npz``
answer), and ``/topk`` the same rows as final states (normalized here in numpy), in one
request each (``LMHEAD_MAX_ROWS`` raised to hold them), alternated over ROUNDS rounds.
Memory: the server's anonymous resident peak (``tests.server.anonymous_peak``) during one
more lens request, beyond the process loaded and warm, against ``worst_case_extra_bytes``
(not during the timed ones: the sampler reads /proc as fast as it can, on one of the cores,
which made the lens look 1.75x the /topk it was not sampled beside). The
engine's part alone is measured too, in this process on the same file: the lens runs
(``runtime.layer_runs.lens_run``) against top-k runs (``HeadSession.project``) of the same
rows, both in the service's run size, alternated.

    python -m bench.lens [--size 128256x2048] [--layers 32] [--tokens 512] [--rounds 2]
                         [--output bench/results-lens.md]
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import numpy.typing as npt

from bench.machine import describe_machine
from service.budget import worst_case_extra_bytes
from service.heads.files import HeadWeights, save_head
from service.heads.norm import FinalNorm
from service.runtime.layer_runs import lens_run
from service.runtime.layout import open_head
from service.settings import Settings
from tests.server import anonymous_peak, running_server, server_process

MB = 2**20
K = 5
RUN_ROWS = 128  # the service's run of this head (LMHEAD_MAX_BATCH_ROWS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="128256x2048")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    vocab, d_model = (int(part) for part in args.size.split("x"))
    report = _report(vocab, d_model, args.layers, args.tokens, args.rounds)
    print(report)
    if args.output:
        args.output.write_text(report + "\n", encoding="utf-8")
    return 0


def _report(vocab: int, d_model: int, layers: int, tokens: int, rounds: int) -> str:
    rng = np.random.default_rng(0)
    scale = (1 + 0.1 * rng.standard_normal(d_model)).astype(np.float32)
    norm = FinalNorm("rms", scale, 1e-5)
    states = (rng.standard_normal((layers, tokens, d_model)) * 3).astype(np.float32)
    final = norm.apply(states.reshape(-1, d_model)).astype(np.float32)
    rows = layers * tokens
    env = {
        "max_rows": str(max(rows, 4096)),
        "max_body_bytes": str(2 * states.nbytes + MB),
    }
    with tempfile.TemporaryDirectory(prefix="lmhead-bench-") as directory:
        table = rng.standard_normal((vocab, d_model), dtype=np.float32) * np.float32(0.02)
        save_head(HeadWeights.from_arrays(table, norm=norm), Path(directory) / "head" / "1")
        del table
        engine = _engine(Path(directory) / "head" / "1" / "model.onnx", states, final, rounds)
        with running_server(Path(directory), **env) as url:
            server = server_process(url)
            lens_body, topk_body = _npy(states), _npy(final)
            with httpx.Client(base_url=url, timeout=3600) as client:
                _lens(client, _npy(states[:, :2]))  # warm: one small call of each
                _topk(client, _npy(final[:64]))
                warm = _anonymous(server.pid)
                lens_s, topk_s = [], []
                for _ in range(rounds):  # timed without the sampler: it spins on a core
                    seconds, shape = _lens(client, lens_body)
                    lens_s.append(seconds)
                    topk_s.append(_topk(client, topk_body))
                _, peak = anonymous_peak(server, lambda: _lens(client, lens_body))
                peaks = [peak]
    bound = worst_case_extra_bytes(Settings(**env))  # type: ignore[arg-type]
    lens_median, topk_median = statistics.median(lens_s), statistics.median(topk_s)
    extra = max(peaks) - warm
    return "\n".join(
        [
            describe_machine(),
            "",
            f"Tied head {vocab} x {d_model} with a final RMS norm, one process, default settings "
            f"but LMHEAD_MAX_ROWS={env['max_rows']} and LMHEAD_MAX_BODY_BYTES="
            f"{env['max_body_bytes']}. `/lens` on {layers} layers x {tokens} tokens of residual "
            f"states (`.npy` in, `.npz` out, k={K}, answer {shape}); `/topk` on the same "
            f"{rows} rows as final states (one request, k={K}); {rounds} alternated rounds, "
            "medians.",
            "",
            "| request | seconds | vs /topk |",
            "|---|---|---|",
            f"| `/topk`, {rows} final rows | {topk_median:.2f} | 1.00x |",
            f"| `/lens`, {layers} x {tokens} residual | {lens_median:.2f} | "
            f"{lens_median / topk_median:.2f}x |",
            "",
            f"The engine alone (this process, runs of {RUN_ROWS} rows, {rounds} alternated "
            "rounds, medians):",
            "",
            "| runs | seconds | vs top-k |",
            "|---|---|---|",
            f"| top-k runs (`HeadSession.project`) | {engine[1]:.2f} | 1.00x |",
            f"| lens runs (`layer_runs.lens_run`) | {engine[0]:.2f} | "
            f"{engine[0] / engine[1]:.2f}x |",
            "",
            "| memory during `/lens` | MB |",
            "|---|---|",
            f"| anonymous resident, loaded and warm | {warm / MB:.0f} |",
            f"| peak beyond it | {extra / MB:.0f} |",
            f"| bound beyond the models (worst_case_extra_bytes) | {bound / MB:.0f} |",
            "",
            f"The lens costs {lens_median / topk_median:.2f}x the plain top-k over the same rows "
            f"and peaks {extra / MB:.0f} MB beyond the loaded process (bound {bound / MB:.0f} MB).",
        ]
    )


def _engine(
    path: Path, states: npt.NDArray[np.float32], final: npt.NDArray[np.float32], rounds: int
) -> tuple[float, float]:
    """Seconds of the lens runs and of top-k runs over the same rows, medians of ``rounds``."""
    session = open_head(path)
    layers, tokens, _ = states.shape
    residual = np.ones(layers, bool)
    residual[-1] = False
    step = max(1, RUN_ROWS // layers)

    def lens() -> None:
        for start in range(0, tokens, step):
            lens_run(session, states[:, start : start + step], residual, K, None)

    def topk() -> None:
        for start in range(0, len(final), RUN_ROWS):
            session.project(final[start : start + RUN_ROWS], K)

    timings: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for run, into in ((lens, timings[0]), (topk, timings[1])):
            started = time.perf_counter()
            run()
            into.append(time.perf_counter() - started)
    session.close()
    return statistics.median(timings[0]), statistics.median(timings[1])


def _npy(array: npt.NDArray[np.float32]) -> bytes:
    stream = io.BytesIO()
    np.save(stream, np.ascontiguousarray(array))
    return stream.getvalue()


def _lens(client: httpx.Client, body: bytes) -> tuple[float, tuple[int, ...]]:
    seconds, answer = _post(client, "lens", body)
    return seconds, tuple(np.load(io.BytesIO(answer))["token_ids"].shape)


def _topk(client: httpx.Client, body: bytes) -> float:
    return _post(client, "topk", body)[0]


def _post(client: httpx.Client, verb: str, body: bytes) -> tuple[float, bytes]:
    """Seconds of one ``.npy`` request to ``verb`` (k=K, ``.npz`` answer), and the answer."""
    started = time.perf_counter()
    answer = client.post(
        f"/v1/models/head/{verb}?k={K}",
        content=body,
        headers={"content-type": "application/x-npy", "accept": "application/x-npz"},
    )
    answer.raise_for_status()
    return time.perf_counter() - started, answer.content


def _anonymous(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc status")


if __name__ == "__main__":
    raise SystemExit(main())
