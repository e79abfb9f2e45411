"""The GPU path, measured: device memory per W, run times beside torch and the HBM floor, and
served throughput. On a CPU it runs the same code on a small head (a smoke test for CI).

    python -m bench.gpu [--small] [--serve] [--output bench/results-gpu.md]

* memory: each head is loaded alone in a fresh process (``--probe``); the device memory it
  adds is read from ``nvidia-smi`` for that process, minus what a 16-token head of the same
  kind adds (the CUDA context, cuBLAS handles and workspace), in units of W = the float32
  bytes of one (vocab, d_model) matrix. On a CPU: resident memory instead.
* time: ``HeadSession.project`` (k=10, host copies included) at 1/8/64/512 rows, median of
  interleaved runs; torch on the same GPU when installed (host copies included; bf16 also
  device-resident); the floor is the stored bytes of W over the copy bandwidth measured in the
  same run (read + written bytes, as ``cudaMemcpy`` counts them).
* served: ``lmhead serve`` on the same heads, 64-row ``.npy`` and V2 binary at 1 and 16
  clients and one-row ``.npy`` at 1 client, against the bare session.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnxruntime as ort
import psutil

from bench.machine import describe_machine
from service.heads.files import HeadWeights, save_head
from service.heads.inspector import inspect_head
from service.runtime.layout import servable_path
from service.runtime.providers import CPU, CUDA
from service.runtime.session import HeadSession

ROWS = (1, 8, 64, 512)
K = 10
REPEATS = 30
KINDS = (("tied", "float32"), ("untied", "float32"), ("tied", "float16"), ("tied", "bfloat16"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--small", action="store_true", help="a 4096 x 256 head (CPU smoke)")
    parser.add_argument("--serve", action="store_true", help="also measure the served API")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--probe", nargs=2, metavar=("PATH", "TIED"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        print(json.dumps(_probe(Path(args.probe[0]), args.probe[1] == "tied")))
        return 0
    vocab, d_model = (4096, 256) if args.small else (128256, 2048)
    on_cuda = CUDA in ort.get_available_providers()
    with tempfile.TemporaryDirectory() as scratch:
        paths = _write_heads(Path(scratch), vocab, d_model)
        lines = [describe_machine(), f"onnxruntime {ort.__version__}, providers: "]
        lines[-1] += ", ".join(ort.get_available_providers())
        lines += [
            "",
            f"Head {vocab} x {d_model}; W = {vocab * d_model * 4 / 1e6:.0f} MB (float32).",
        ]
        lines += _memory_table(paths, vocab * d_model * 4, on_cuda)
        lines += _time_table(paths, vocab, d_model, on_cuda)
        if args.serve:
            lines += _served_table(Path(scratch), paths, d_model)
    report = "\n".join(lines)
    print(report)
    if args.output:
        args.output.write_text(report + "\n", encoding="utf-8")
    return 0


def _write_heads(root: Path, vocab: int, d_model: int) -> dict[tuple[str, str], Path]:
    rng = np.random.default_rng(0)
    table = rng.standard_normal((vocab, d_model), dtype=np.float32) * np.float32(d_model**-0.5)
    other = rng.standard_normal((vocab, d_model), dtype=np.float32) * np.float32(d_model**-0.5)
    paths = {}
    for kind, dtype in (*KINDS, ("tiny-tied", "float32"), ("tiny-untied", "float32")):
        rows = 16 if kind.startswith("tiny") else vocab
        weights = HeadWeights.from_arrays(
            table[:rows],
            None if kind.endswith("tied") and "un" not in kind else other[:rows],
            dtype=dtype,
        )
        paths[(kind, dtype)] = save_head(weights, root / kind / dtype / "1", external_data=True)
    for dtype in ("float16", "bfloat16"):  # the tiny baselines of the half kinds
        weights = HeadWeights.from_arrays(table[:16], dtype=dtype)
        paths[("tiny-tied", dtype)] = save_head(weights, root / "tiny" / dtype / "1")
    return paths


def _probe(path: Path, tied: bool) -> dict[str, float]:
    """In a fresh process: load and warm one head, report the memory it holds."""
    providers = (CUDA, CPU) if CUDA in ort.get_available_providers() else (CPU,)
    device_before = _device_used() if CUDA in providers else 0.0
    before = psutil.Process().memory_info().rss
    with tempfile.TemporaryDirectory() as scratch:
        served = servable_path(path, inspect_head(path).dtype, providers, Path(scratch))
        session = HeadSession(served, tied=tied, providers=providers)
        session.project(np.zeros((64, session.d_model), np.float32), K)
    device = _device_used() - device_before if CUDA in providers else 0.0
    return {"device_mb": device, "rss_mb": (psutil.Process().memory_info().rss - before) / 1e6}


def _device_used() -> float:
    """MB in use on the device (probes run one at a time: all of it is this process's);
    through torch when present (its context is made before the session, so not counted),
    else nvidia-smi's count for this process."""
    try:
        import torch
    except ImportError:
        return _device_mb(os.getpid())
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    return float(total - free) / 1e6


def _device_mb(pid: int) -> float:
    query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    for line in subprocess.run(query, capture_output=True, text=True).stdout.splitlines():
        owner, used = (field.strip() for field in line.split(","))
        if int(owner) == pid:
            return float(used) * 1.048576  # MiB -> MB
    return 0.0


def _measured(path: Path, tied: bool) -> dict[str, float]:
    command = [sys.executable, "-m", "bench.gpu", "--probe", str(path), "tied" if tied else "x"]
    return dict(json.loads(subprocess.run(command, capture_output=True, check=True).stdout))


def _memory_table(
    paths: dict[tuple[str, str], Path], weight_bytes: int, on_cuda: bool
) -> list[str]:
    what = "device" if on_cuda else "resident"
    key = "device_mb" if on_cuda else "rss_mb"
    lines = ["", f"Memory added by loading a head, {what} (one fresh process each):", ""]
    lines += [f"| head | dtype | {what} MB | {what} / W |", "|---|---|---|---|"]
    for kind, dtype in KINDS:
        tied = kind == "tied"
        head = _measured(paths[(kind, dtype)], tied)[key]
        tiny = paths[("tiny-tied" if tied else "tiny-untied", dtype if tied else "float32")]
        baseline = _measured(tiny, tied)[key]
        added = head - baseline
        lines.append(
            f"| {kind} | {dtype} | {added:.0f} (+{baseline:.0f} fixed) | "
            f"{added * 1e6 / weight_bytes:.2f} |"
        )
    return lines


def _median_ms(call: Callable[[], object]) -> float:
    call()
    samples = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def _time_table(
    paths: dict[tuple[str, str], Path], vocab: int, d_model: int, on_cuda: bool
) -> list[str]:
    providers = (CUDA, CPU) if on_cuda else (CPU,)
    hidden = {r: np.random.default_rng(r).standard_normal((r, d_model), np.float32) for r in ROWS}
    runners: dict[str, Callable[[int], object]] = {}
    scratch = Path(tempfile.mkdtemp())
    for dtype in ("float32", "float16", "bfloat16"):
        path = paths[("tied", dtype)]
        served = servable_path(path, dtype, providers, scratch / dtype)
        for tf32 in (False, True) if on_cuda and dtype == "float32" else (False,):
            session = HeadSession(served, tied=True, providers=providers, tf32=tf32)
            label = f"lmhead {dtype}" + (" TF32" if tf32 else "")
            runners[label] = _runner(session, hidden)
        if on_cuda and dtype != "float16":  # does binding the inputs and outputs save a copy?
            bound = HeadSession(served, tied=True, providers=providers, io_binding=True)
            runners[f"lmhead {dtype}, IO binding"] = _runner(bound, hidden)
    runners |= _torch_runners(paths, vocab, d_model, hidden)
    lines = ["", "Time per run, ms (k=10, host copies included unless said):", ""]
    lines += ["| engine | " + " | ".join(f"{r} rows" for r in ROWS) + " |"]
    lines += ["|---|" + "---|" * len(ROWS)]
    for label, run in runners.items():
        times = [_median_ms(partial(run, rows)) for rows in ROWS]
        lines.append(f"| {label} | " + " | ".join(f"{t:.3f}" for t in times) + " |")
    bandwidth = _copy_bandwidth()
    if bandwidth:
        floor = [vocab * d_model * size / bandwidth * 1e3 for size in (4, 2)]
        lines.append(
            f"| floor: read W once (copy {bandwidth / 1e12:.2f} TB/s) | float32 {floor[0]:.3f}, "
            f"half {floor[1]:.3f} | | | |"
        )
    return lines


def _runner(
    session: HeadSession, hidden: dict[int, npt.NDArray[np.float32]]
) -> Callable[[int], object]:
    return lambda rows: session.project(hidden[rows], K)


def _torch_runners(
    paths: dict[tuple[str, str], Path],
    vocab: int,
    d_model: int,
    hidden: dict[int, npt.NDArray[np.float32]],
) -> dict[str, Callable[[int], object]]:
    try:
        import torch
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    torch.backends.cuda.matmul.allow_tf32 = False
    table = torch.from_numpy(np.random.default_rng(0).standard_normal((vocab, d_model), np.float32))
    weights = {"float32": table.cuda(), "bfloat16": table.to(torch.bfloat16).cuda()}
    resident = {r: torch.from_numpy(h).cuda().to(torch.bfloat16) for r, h in hidden.items()}

    def run(rows: int, dtype: str, on_device: bool = False) -> object:
        h = resident[rows] if on_device else torch.from_numpy(hidden[rows]).cuda()
        logits = (h.to(weights[dtype].dtype) @ weights[dtype].T).float()
        values, ids = logits.topk(K, dim=1)
        lse = torch.logsumexp(logits, dim=1)
        if on_device:
            torch.cuda.synchronize()
            return values
        return values.cpu(), ids.cpu(), lse.cpu()

    return {
        "torch float32": lambda r: run(r, "float32"),
        "torch bfloat16": lambda r: run(r, "bfloat16"),
        "torch bfloat16, device-resident": lambda r: run(r, "bfloat16", on_device=True),
    }


def _copy_bandwidth() -> float | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    source = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    target.copy_(source)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        target.copy_(source)
    torch.cuda.synchronize()
    return float(2 * source.numel() * 10 / (time.perf_counter() - start))


def _served_table(root: Path, paths: dict[tuple[str, str], Path], d_model: int) -> list[str]:
    """One process serving the float32 and bfloat16 tied heads, against their bare sessions."""
    import shutil

    import uvloop

    from bench.serve import _drive
    from tests.server import running_server

    providers = (CUDA, CPU) if CUDA in ort.get_available_providers() else (CPU,)
    repository = root / "served"
    bare: dict[tuple[str, int], float] = {}
    names = {"tied-fp32": ("tied", "float32"), "tied-bf16": ("tied", "bfloat16")}
    for name, key in names.items():
        shutil.copytree(paths[key].parent, repository / name / "1", copy_function=os.link)
        served = servable_path(paths[key], key[1], providers, root / "bare" / name)
        session = HeadSession(served, tied=True, providers=providers)
        for rows in (1, 64):
            hidden = np.random.default_rng(rows).standard_normal((rows, d_model), np.float32)
            bare[(name, rows)] = rows * 1e3 / _median_ms(partial(session.project, hidden, K))
        del session
    lines = ["", "Served by one process (`lmhead serve`), against the bare session:", ""]
    lines += ["| head | request | clients | rows/s | p50 ms | p99 ms | vs bare |"]
    lines += ["|---|---|---|---|---|---|---|"]
    cases = (("npy", 64, 1), ("npy", 64, 16), ("v2-binary", 64, 1), ("v2-binary", 64, 16))
    with running_server(repository, log_level="warning") as url:
        for name in names:
            for kind, rows, clients in (*cases, ("npy", 1, 1)):
                route = (
                    f"/v2/models/{name}/infer"
                    if kind.startswith("v2")
                    else (f"/v1/models/{name}/topk")
                )
                result: Any = uvloop.run(_drive(url + route, kind, rows, clients, d_model=d_model))
                lines.append(
                    f"| {name} | {kind} {rows} rows | {clients} | {result.rows_per_s:.0f} | "
                    f"{result.p50_ms:.2f} | {result.p99_ms:.2f} | "
                    f"{result.rows_per_s / bare[(name, rows)]:.2f}x |"
                )
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
