"""Benchmark heads as the service lays them out: fp32 tied (shared and fast memory modes), fp32
untied, and block-quantized tied int8 and int4; time per run, resident memory, the share of
the machine's read bandwidth reached, and the accuracy of the quantized heads.

Every configuration runs in the same process, interleaved run by run, so the ratios hold on a
shared, noisy machine; resident memory is measured in a fresh subprocess per configuration;
the read bandwidth is measured in the same run (``read_bandwidth``).

Accuracy compares full logits with the fp32 head on two kinds of hidden states: *random*
N(0, 1) (almost flat distributions over the vocabulary: the hardest case for top-1) and
*peaked* (a table row's direction scaled to logit ln(V) + 1.1 plus noise giving the other
logits a spread of 1.5: the target holds ~half of the probability, as a trained trunk's
confident next token does).

``--serve`` adds the same heads served by a real uvicorn process: 1-row ``.npy`` requests
from 16 clients, rows/s per head against fp32, beside the bare sessions' ratio at the run size
the server reached (1 row with batching off).

    python -m bench.heads [--sizes 50257x768,128256x2048] [--serve] [--output FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import numpy.typing as npt
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from prometheus_client.parser import text_string_to_metric_families

from bench.loadgen import build_request, closed_loop
from bench.machine import describe_machine
from service.heads.files import HeadWeights, save_head
from service.heads.inspector import inspect_head
from service.heads.quantize import QuantSpec
from service.heads.reference import log_softmax
from service.plane.comparison import agreement
from service.runtime.layout import Placement, open_head
from service.runtime.session import HeadSession
from service.settings import MemoryMode
from tests.server import running_server

ROWS = (1, 8, 64, 512)
#: Runs per configuration and row count; the large head gets fewer (one 512-row fp32 run
#: there takes seconds).
REPEATS = {"small": {1: 60, 8: 40, 64: 20, 512: 6}, "large": {1: 20, 8: 12, 64: 6, 512: 3}}
ACCURACY_ROWS = 256
PEAK_SPREAD = 1.5


@dataclass(frozen=True)
class Config:
    name: str
    mode: MemoryMode
    path: Path
    spec: QuantSpec | None = None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="50257x768,128256x2048")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--serve", action="store_true", help="also measure through the API")
    args = parser.parse_args()
    bandwidth = read_bandwidth()
    lines = [
        f"{describe_machine()} Medians of interleaved runs. Read bandwidth measured in this "
        f"run: {bandwidth / 1e9:.1f} GB/s (onnxruntime ReduceMax over rows). The floor is the "
        "time to read the projection's weights once at that rate.",
        "",
        _header(),
    ]
    accuracy = ["", _accuracy_header()]
    for size in args.sizes.split(","):
        vocab, d_model = (int(part) for part in size.split("x"))
        with tempfile.TemporaryDirectory() as scratch:
            speed, quality = _bench_size(Path(scratch), vocab, d_model, bandwidth)
        lines += speed
        accuracy += quality
    if args.serve:
        accuracy += ["", *served_table()]
    table = "\n".join(lines + accuracy)
    print(table)
    if args.output:
        args.output.write_text(table + "\n", encoding="utf-8")
    return 0


def read_bandwidth(megabytes: int = 512) -> float:
    """Bytes per second onnxruntime reads from memory: ``ReduceMax`` over the rows of a
    float32 matrix (a matrix-vector product's access pattern, all threads; best of 5).
    numpy's reductions read slower here (14-20 GB/s) than a 1-row fp32 projection does."""
    rows = megabytes * 2**20 // 4096
    graph = helper.make_graph(
        [helper.make_node("ReduceMax", ["x", "axis"], ["y"], keepdims=0)],
        "bandwidth",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, 1024])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows])],
        [numpy_helper.from_array(np.array([1], np.int64), "axis")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    data = np.ones((rows, 1024), np.float32)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        session.run(None, {"x": data})
        best = min(best, time.perf_counter() - start)
    return data.nbytes / best


def _header() -> str:
    cells = ["head", "vocab x d", "memory mode", "stored MB", "resident / W", "resident / stored"]
    cells += [f"{rows} row{'s' * (rows > 1)} ms" for rows in ROWS]
    cells += ["vs fp32 shared @1", "vs fast @64", "floor % @1"]
    return "| " + " | ".join(cells) + " |\n|" + "---|" * len(cells)


def _accuracy_header() -> str:
    cells = ["head", "vocab x d", "hidden states", "fp32 top-1 prob", "top-1 agreement"]
    cells += ["top-10 overlap", "mean KL", "p90 KL"]
    return "| " + " | ".join(cells) + " |\n|" + "---|" * len(cells)


def _configs(scratch: Path, vocab: int, d_model: int) -> list[Config]:
    rng = np.random.default_rng(0)
    table = (rng.standard_normal((vocab, d_model), dtype=np.float32) * 0.02).astype(np.float32)
    tied = HeadWeights.from_arrays(table)
    fp32 = save_head(tied, scratch / "tied", external_data=True)
    untied = save_head(
        HeadWeights.from_arrays(table, table[rng.permutation(vocab)]),
        scratch / "untied",
        external_data=True,
    )
    configs = [
        Config("tied fp32", "shared", fp32),
        Config("tied fp32", "fast", fp32),
        Config("untied fp32", "shared", untied),
    ]
    for name in ("int8", "int4"):
        spec = QuantSpec.parse(name)
        path = save_head(tied, scratch / name, external_data=True, quantization=spec)
        configs.append(Config(f"tied {spec.name} b{spec.block_size}", "shared", path, spec))
    return configs


def _bench_size(
    scratch: Path, vocab: int, d_model: int, bandwidth: float
) -> tuple[list[str], list[str]]:
    configs = _configs(scratch, vocab, d_model)
    sessions = {config: open_head(config.path, Placement(config.mode)) for config in configs}
    repeats = REPEATS["large" if vocab * d_model > 2**28 else "small"]
    timings = {rows: _interleaved(sessions, rows, d_model, repeats[rows]) for rows in ROWS}
    shared, fast = configs[0], configs[1]
    speed = []
    for config in configs:
        report = inspect_head(config.path)
        ratio = _resident_ratio(config.path, config.mode)
        stored = report.weight_bytes
        projection_bytes = stored if report.tied else stored // 2
        if report.quantization:
            projection_bytes = report.quantization["bytes"]
        floor_ms = projection_bytes / bandwidth * 1e3
        cells = [
            config.name,
            f"{vocab} x {d_model}",
            config.mode,
            f"{stored / 1e6:.0f}",
            f"{ratio:.2f}",
            f"{ratio * vocab * d_model * 4 / stored:.2f}",
            *(f"{timings[rows][config]:.2f}" for rows in ROWS),
            f"{timings[1][shared] / timings[1][config]:.2f}x",
            f"{timings[64][config] / timings[64][fast]:.2f}x",
            f"{floor_ms / timings[1][config] * 100:.0f}%",
        ]
        speed.append("| " + " | ".join(cells) + " |")
    return speed, _accuracy(sessions, configs, vocab, d_model)


def _interleaved(
    sessions: dict[Config, HeadSession], rows: int, d_model: int, repeats: int
) -> dict[Config, float]:
    hidden = np.random.default_rng(rows).standard_normal((rows, d_model), dtype=np.float32)
    samples: dict[Config, list[float]] = {key: [] for key in sessions}
    for session in sessions.values():
        session.project(hidden, 10)
    for _ in range(repeats):
        for key, session in sessions.items():
            start = time.perf_counter()
            session.project(hidden, 10)
            samples[key].append(time.perf_counter() - start)
    return {key: float(np.median(values)) * 1e3 for key, values in samples.items()}


def peaked_states(
    table: npt.NDArray[np.float32], rows: int, seed: int = 1
) -> npt.NDArray[np.float32]:
    """Hidden states whose fp32 distribution puts ~half the mass on one token (see the module
    docstring): the target row's direction plus noise orthogonal to nothing in particular."""
    rng = np.random.default_rng(seed)
    vocab, d_model = table.shape
    targets = rng.integers(0, vocab, rows)
    chosen = np.asarray(table[targets], np.float64)
    target_logit = np.log(vocab) + PEAK_SPREAD**2 / 2
    direction = chosen / np.sum(chosen**2, axis=1, keepdims=True) * target_logit
    row_norm = float(np.sqrt(np.mean(np.sum(np.asarray(table[:4096], np.float64) ** 2, 1))))
    noise = rng.standard_normal((rows, d_model)) * PEAK_SPREAD / row_norm
    states: npt.NDArray[np.float32] = (direction + noise).astype(np.float32)
    return states


def _accuracy(
    sessions: dict[Config, HeadSession], configs: list[Config], vocab: int, d_model: int
) -> list[str]:
    reference = sessions[configs[1]]  # fp32, onnxruntime defaults
    table = reference.embed(np.arange(vocab))
    states = {
        "random N(0, 1)": np.random.default_rng(2).standard_normal(
            (ACCURACY_ROWS, d_model), dtype=np.float32
        ),
        "peaked": peaked_states(table, ACCURACY_ROWS),
    }
    del table
    lines = []
    for config in (c for c in configs if c.spec is not None):
        for kind, hidden in states.items():
            exact = reference.project(hidden, 10, full_logits=True).logits
            quantized = sessions[config].project(hidden, 10, full_logits=True).logits
            assert exact is not None
            assert quantized is not None
            stats = agreement(exact, quantized, 10)
            top_prob = np.exp(log_softmax(exact).max(axis=1)).mean()
            cells = [
                config.name,
                f"{vocab} x {d_model}",
                kind,
                f"{top_prob:.3f}",
                f"{stats['top1_agreement']:.1%}",
                f"{stats['topk_overlap']:.3f}",
                f"{stats['kl_ab']['mean']:.4f}",
                f"{stats['kl_ab']['p90']:.4f}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def _resident_ratio(path: Path, mode: str) -> float:
    command = [sys.executable, "-m", "service.tools.memory", str(path), "--memory-mode", mode]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)["ratio"])


SERVED_CLIENTS = 16
SERVED_SECONDS = 6.0
SERVED_ROUNDS = 4


def served_table(vocab: int = 50257, d_model: int = 768) -> list[str]:
    """fp32, int8 and int4 tied heads in one server; rounds alternate heads to share drift.

    Each served ratio stands beside the bare sessions' ratio at the run size the server
    reached (``lmhead_batch_rows``; 1 with batching off): rows/s of runs that size, timed
    interleaved after the servers stop. Batching merges ~16 one-row requests into a run, where
    a quantized head's lead is smaller than at 1 row, so the 1-row ratio is the wrong yardstick
    for a batching server."""
    with tempfile.TemporaryDirectory() as scratch:
        repository = Path(scratch) / "models"
        configs = _configs(Path(scratch), vocab, d_model)
        chosen = [c for c in configs if c.name.startswith("tied") and c.mode == "shared"]
        names = {c: c.spec.name if c.spec else "fp32" for c in chosen}
        for config in chosen:
            version = repository / names[config] / "1"
            version.mkdir(parents=True)
            for item in config.path.parent.iterdir():
                (version / item.name).write_bytes(item.read_bytes())
        served: dict[str, tuple[dict[str, float], dict[str, float]]] = {}
        for batching in ("on", "off"):
            with running_server(
                repository, log_level="warning", batching=str(batching == "on").lower(),
                provider="cpu",
            ) as url:  # fmt: skip
                served[batching] = (
                    _served_rates(url, list(names.values()), d_model),
                    _run_rows(url),
                )
        sessions = {c: open_head(c.path, Placement("shared")) for c in chosen}
        sizes = {
            max(1, round(rows)) for _, run_rows in served.values() for rows in run_rows.values()
        }
        bare = {size: _interleaved(sessions, size, d_model, 30) for size in sorted(sizes | {1})}
        lines = [
            f"Served: 1-row `.npy` requests from {SERVED_CLIENTS} clients (dynamic batching on "
            f"and off), {vocab} x {d_model}, rows/s over {SERVED_ROUNDS} alternating rounds. "
            "Bare: the sessions alone, rows/s of runs the size the server ran (its mean rows "
            "per run), timed after the servers stopped; the target is the served ratio within "
            "10% of the bare one.",
            "",
            "| head | batching | rows/s | rows per run | vs fp32 served | vs fp32 bare, same "
            "run size | served / bare ratio | vs fp32 bare @1 |",
            "|---|---|---|---|---|---|---|---|",
        ]
        fp32 = chosen[0]
        for batching, (rates, run_rows) in served.items():
            sized = {c: max(1, round(run_rows[names[c]])) for c in chosen}
            capacity = {c: sized[c] / bare[sized[c]][c] for c in chosen}
            for config in chosen:
                name = names[config]
                served_ratio = rates[name] / rates[names[fp32]]
                bare_ratio = capacity[config] / capacity[fp32]
                cells = [
                    config.name,
                    batching,
                    f"{rates[name]:.0f}",
                    f"{run_rows[name]:.1f}",
                    f"{served_ratio:.2f}x",
                    f"{bare_ratio:.2f}x",
                    f"{served_ratio / bare_ratio:.2f}",
                    f"{bare[1][fp32] / bare[1][config]:.2f}x",
                ]
                lines.append("| " + " | ".join(cells) + " |")
    return lines


def _run_rows(url: str) -> dict[str, float]:
    """Mean rows per onnxruntime run so far, per model (``lmhead_batch_rows``)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "lmhead_batch_rows":
            for sample in family.samples:
                model = sample.labels["model"]
                if sample.name.endswith("_sum"):
                    sums[model] = sums.get(model, 0.0) + sample.value
                elif sample.name.endswith("_count"):
                    counts[model] = counts.get(model, 0.0) + sample.value
    return {model: sums[model] / counts[model] for model in counts if counts[model]}


def _served_rates(url: str, models: list[str], d_model: int) -> dict[str, float]:
    host, port = url.removeprefix("http://").split(":")
    stream = io.BytesIO()
    np.save(stream, np.random.default_rng(5).standard_normal((1, d_model), dtype=np.float32))
    headers = {"content-type": "application/x-npy"}
    done: dict[str, list[float]] = {model: [] for model in models}
    for _ in range(SERVED_ROUNDS):
        for model in models:
            raw = build_request(
                host, int(port), f"/v1/models/{model}/topk?k=10", stream.getvalue(), headers
            )
            run = asyncio.run(
                closed_loop(
                    host, int(port), raw, SERVED_CLIENTS,
                    max_seconds=SERVED_SECONDS, max_requests=20000,
                )
            )  # fmt: skip
            done[model].append(len(run.latencies) / run.elapsed)
    return {model: float(np.mean(rates)) for model, rates in done.items()}


if __name__ == "__main__":
    raise SystemExit(main())
