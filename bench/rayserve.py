"""Benchmark lmhead under Ray Serve against the single lmhead process, side by side in one run.

The same demo head (32000 x 512, `.npy` bodies, k=10) is served three ways on this machine:
one ``lmhead serve`` process, and Ray Serve with 1 and 2 replicas behind Serve's HTTP proxy
(a local one-node Ray cluster; each replica is a whole lmhead service with its own dynamic
batching and onnxruntime threads = its ``num_cpus``: all the cores for one replica, half each
for two). Each is driven by 1 and 16 closed-loop aiohttp clients with 1-row and 64-row
requests (bounded in count and time, ``bench.serve``'s driver). The single process is measured
before and after the Ray runs and averaged, so drift on a shared machine hits both sides alike.
The 1-row, 1-client latency difference is the cost of Serve's proxy hop. Needs the ray extra.

    python -m bench.rayserve [--output bench/results-ray.md]
"""

from __future__ import annotations

import os
from pathlib import Path

import ray
import uvloop
from ray import serve

from bench.machine import describe_machine, report_on_demo_heads
from bench.serve import Result, _drive, _mean
from service.hosting.rayserve import LMHead
from tests.server import free_port, running_server

MODEL = "demo-tied"
ROWS = (1, 64)
CLIENTS = (1, 16)
REPLICAS = (1, 2)
CORES = os.cpu_count() or 1
Runs = dict[tuple[int, int], Result]


def main() -> int:
    return report_on_demo_heads(__doc__, _report)


def _measure(url: str) -> Runs:
    path = f"{url}/v1/models/{MODEL}/topk"
    return {
        (rows, clients): uvloop.run(_drive(path, "npy", rows, clients))
        for rows in ROWS
        for clients in CLIENTS
    }


def _single(repository: Path) -> Runs:
    with running_server(repository, log_level="warning") as url:
        return _measure(url)


def _on_ray(repository: Path) -> dict[int, Runs]:
    """Serve with 1, then 2 replicas on a local Ray cluster (the cores this machine has)."""
    ray.init(
        address="local",
        _node_ip_address="127.0.0.1",
        logging_level="warning",
        log_to_driver=False,
        include_dashboard=False,
    )
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    settings = {"repository": str(repository), "log_level": "warning"}
    measured = {}
    try:
        for replicas in REPLICAS:
            cpus = max(1, CORES // replicas)  # every configuration gets the machine's cores
            deployment = LMHead.options(num_replicas=replicas, ray_actor_options={"num_cpus": cpus})
            serve.run(deployment.bind(settings), name="lmhead", route_prefix="/")
            measured[replicas] = _measure(f"http://127.0.0.1:{port}")
            serve.delete("lmhead")  # its replicas free their CPUs for the next configuration
    finally:
        serve.shutdown()
        ray.shutdown()
    return measured


def _report(repository: Path) -> str:
    first = _single(repository)
    ray_runs = _on_ray(repository)
    single = {key: _mean(first[key], run) for key, run in _single(repository).items()}
    lines = [
        describe_machine(),
        "",
        f"Head `{MODEL}` (32000 x 512), `.npy` top-10, loopback, aiohttp clients on the same "
        "cores; Ray Serve on a local one-node cluster, proxy on the head; the single process is "
        "the mean of a run before and one after the Ray runs.",
        "",
        "| served by | rows/req | clients | rows/s | p50 ms | p99 ms | vs single process |",
        "|---|---|---|---|---|---|---|",
    ]
    rows: list[tuple[str, Runs]] = [("single process", single)]
    rows += [(f"Ray Serve, {n} replica{'s' * (n > 1)}", ray_runs[n]) for n in REPLICAS]
    for name, runs in rows:
        for key, result in runs.items():
            ratio = result.rows_per_s / single[key].rows_per_s
            lines.append(
                f"| {name} | {key[0]} | {key[1]} | {result.rows_per_s:.0f} | "
                f"{result.p50_ms:.2f} | {result.p99_ms:.2f} | {ratio:.2f}x |"
            )
    hop = ray_runs[1][(1, 1)].p50_ms - single[(1, 1)].p50_ms
    lines += ["", f"Serve's proxy hop (p50, 1 row, 1 client, 1 replica - single): {hop:.2f} ms."]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
