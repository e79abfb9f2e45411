"""Benchmark the three wire protocols of one lmhead process, side by side in one run.

V2 over gRPC (blocking stubs, as ``tritonclient.grpc`` uses, one channel and thread per client;
raw tensor contents), V2 over REST with the binary extension (aiohttp) and the native API with
``.npy`` bodies (aiohttp), all on the same server,
the same demo head (32000 x 512, top-10) and the same hidden states; 1-row and 64-row requests
at 1 and 16 closed-loop clients, bounded in count and time (``bench.serve``'s budget). The
three protocols alternate within each cell, twice, and each cell reports the mean, so drift
on a shared machine hits all three alike.

    python -m bench.protocols [--output bench/results-protocols.md]
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import uvloop
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from bench.machine import describe_machine, report_on_demo_heads
from bench.serve import MAX_SECONDS, K, Result, _drive, _hidden, _mean, _result, _until
from tests.server import free_port, running_server

MODEL = "demo-tied"
ROWS = (1, 64)
CLIENTS = (1, 16)
ROUNDS = 2
PROTOCOLS = ("gRPC raw", "V2 REST binary", "native npy")


def main() -> int:
    return report_on_demo_heads(__doc__, _report)


def _infer_request(rows: int) -> pb.ModelInferRequest:
    hidden = _hidden(rows)
    tensor = pb.ModelInferRequest.InferInputTensor(
        name="hidden_states", datatype="FP32", shape=list(hidden.shape)
    )
    request = pb.ModelInferRequest(
        model_name=MODEL, inputs=[tensor], raw_input_contents=[hidden.tobytes()]
    )
    request.parameters["k"].int64_param = K
    return request


def _drive_grpc(address: str, rows: int, clients: int) -> Result:
    """``clients`` threads, each with its own channel and blocking stub (what
    ``tritonclient.grpc`` uses), sending its next request when its answer is in."""
    request = _infer_request(rows)
    channels = [grpc.insecure_channel(address) for _ in range(clients)]
    stubs = [service_pb2_grpc.GRPCInferenceServiceStub(channel) for channel in channels]
    latencies: list[float] = []
    tickets = iter(range(max(8 * clients, 200 // rows + 16)))
    lock = threading.Lock()

    def client(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
        while True:
            with lock:  # one ticket at a time, as the asyncio drivers take theirs
                ticket = next(_until(tickets, start), None)
            if ticket is None:
                return
            begin = time.perf_counter()
            stub.ModelInfer(request)
            latencies.append(time.perf_counter() - begin)

    try:
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(stub_call, stubs, [request] * clients))  # every channel connected
            start = time.perf_counter()
            list(pool.map(client, stubs))
        return _result(latencies, rows, time.perf_counter() - start)
    finally:
        for channel in channels:
            channel.close()


def stub_call(stub: service_pb2_grpc.GRPCInferenceServiceStub, request: Any) -> Any:
    return stub.ModelInfer(request)


def _cell(url: str, address: str, rows: int, clients: int) -> dict[str, Result]:
    runs: dict[str, list[Result]] = {name: [] for name in PROTOCOLS}
    for _ in range(ROUNDS):
        runs["gRPC raw"].append(_drive_grpc(address, rows, clients))
        v2 = f"{url}/v2/models/{MODEL}/infer"
        runs["V2 REST binary"].append(uvloop.run(_drive(v2, "v2-binary", rows, clients)))
        native = f"{url}/v1/models/{MODEL}/topk"
        runs["native npy"].append(uvloop.run(_drive(native, "npy", rows, clients)))
    return {name: _mean(*results) for name, results in runs.items()}


def _report(repository: Path) -> str:
    port = free_port()
    with running_server(repository, grpc_port=str(port), log_level="warning") as url:
        cells = {
            (rows, clients): _cell(url, f"127.0.0.1:{port}", rows, clients)
            for rows in ROWS
            for clients in CLIENTS
        }
    lines = [
        describe_machine(),
        "",
        f"Head `{MODEL}` (32000 x 512), top-{K}, loopback, one server for all three; clients "
        f"on the same cores; each cell the mean of {ROUNDS} alternating rounds (<= "
        f"{MAX_SECONDS:.0f} s each).",
        "",
        "| protocol | rows/req | clients | rows/s | p50 ms | p99 ms | vs native npy |",
        "|---|---|---|---|---|---|---|",
    ]
    for (rows, clients), results in cells.items():
        base = results["native npy"].rows_per_s
        for name, result in results.items():
            lines.append(
                f"| {name} | {rows} | {clients} | {result.rows_per_s:.0f} | "
                f"{result.p50_ms:.2f} | {result.p99_ms:.2f} | {result.rows_per_s / base:.2f}x |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
