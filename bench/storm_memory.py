"""Benchmark memory under the hostile probe's load, against what the docs promise.

One service (defaults, the gRPC port on) serves the demo heads (32000 x 512). First, gRPC
cancellation storms: for ``--storm-s`` seconds, 64 concurrent 4096-row, k=1000 calls, all
cancelled 0.3 s after they are sent. Then 16 clients score 4096 rows at k=1000 (JSON, 2 each).
Measured in the server process: its resident set once the heads are loaded and warm (one
call of each kind the load sends, of one run's rows: a process keeps what its first calls set
up, such as the scoring buffer of its inference thread), its peak (VmHWM) over the whole load,
and its resident set once idle afterwards, against the models +
``service.budget.worst_case_extra_bytes`` (docs/safety.md's formula) and 1.2x the process
loaded before any call.

    python -m bench.storm_memory [--storm-s 10] [--output FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import numpy as np
import numpy.typing as npt
import orjson
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from bench.machine import describe_machine
from service.budget import worst_case_extra_bytes
from service.settings import Settings
from service.tools.demo import write_demo_models
from tests.server import free_port, peak_resident, poll, running_server, server_process

ROWS, K, STORM_CALLS, SCORERS, SCORES = 4096, 1000, 64, 16, 32
WARM_ROWS = 128  # one run's rows (LMHEAD_MAX_BATCH_ROWS)
IDLE_RATIO = 1.2
MB = 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--storm-s", type=float, default=10.0)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        repository = Path(scratch)
        write_demo_models(repository)
        text = _measure(repository, args.storm_s)
    print(text)
    if args.output:
        args.output.write_text(text + "\n", encoding="utf-8")
    return 0


def _measure(repository: Path, storm_s: float) -> str:
    grpc_port = free_port()
    with running_server(repository, grpc_port=str(grpc_port)) as url:
        server = server_process(url)
        cold = server.memory_info().rss
        hidden = np.random.default_rng(1).standard_normal((ROWS, 512), dtype=np.float32)
        _storms(f"127.0.0.1:{grpc_port}", hidden[:WARM_ROWS], 0.0)  # one call of each kind
        _scores(url, hidden[:WARM_ROWS], calls=1)
        loaded = server.memory_info().rss
        cancelled = _storms(f"127.0.0.1:{grpc_port}", hidden, storm_s)
        after_storms = _idle(server, cold)
        statuses = _scores(url, hidden)
        peak = peak_resident(server)
        idle = _idle(server, cold)
    bound = worst_case_extra_bytes(Settings())
    answered = {status: statuses.count(status) for status in sorted(set(statuses))}
    return "\n".join(
        [
            describe_machine(),
            "",
            f"One process, default settings, demo heads (32000 x 512). {cancelled} gRPC calls "
            f"of {ROWS} rows at k={K}, {STORM_CALLS} at a time, cancelled 0.3 s after they "
            f"were sent, for {storm_s:g} s; then {SCORERS} clients scored {ROWS} rows at k={K} "
            f"({SCORES} requests, JSON; answered {answered}). Resident memory of the server:",
            "",
            "| measure | MB | promised |",
            "|---|---|---|",
            f"| loaded, before any call | {cold / MB:.0f} | |",
            f"| loaded and warm | {loaded / MB:.0f} | |",
            f"| idle after the storms | {after_storms / MB:.0f} "
            f"| <= {IDLE_RATIO * cold / MB:.0f} ({after_storms / cold:.2f}x the cold one) |",
            f"| peak over the load, beyond the loaded | {(peak - loaded) / MB:.0f} | <= "
            f"{bound / MB:.0f} (worst_case_extra_bytes) |",
            f"| idle after the scoring | {idle / MB:.0f} | <= {IDLE_RATIO * cold / MB:.0f} "
            f"({idle / cold:.2f}x the cold one; {idle / loaded:.2f}x the warm one) |",
        ]
    )


def _storms(address: str, hidden: npt.NDArray[np.float32], seconds: float) -> int:
    """Storms for ``seconds``; with 0, one call answered (a warm-up)."""
    request = pb.ModelInferRequest(
        model_name="demo-tied",
        inputs=[
            pb.ModelInferRequest.InferInputTensor(
                name="hidden_states", datatype="FP32", shape=list(hidden.shape)
            )
        ],
        raw_input_contents=[hidden.tobytes()],
        parameters={"k": pb.InferParameter(int64_param=K)},
    )
    sent = 0
    options = [("grpc.max_send_message_length", 64 * MB)]
    with grpc.insecure_channel(address, options=options) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        if not seconds:
            stub.ModelInfer(request)
            return 1
        ends = time.monotonic() + seconds
        while time.monotonic() < ends:
            calls = [stub.ModelInfer.future(request) for _ in range(STORM_CALLS)]
            sent += len(calls)
            time.sleep(0.3)  # the probe's clients: they cancel 0.3 s after sending
            for call in calls:
                call.cancel()
    return sent


def _scores(url: str, hidden: npt.NDArray[np.float32], calls: int = SCORES) -> list[int]:
    body = orjson.dumps(
        {"hidden_states": hidden, "target_ids": list(range(len(hidden))), "k": K},
        option=orjson.OPT_SERIALIZE_NUMPY,
    )

    def score(_: int) -> int:
        answer = httpx.post(
            f"{url}/v1/models/demo-tied/score",
            content=body,
            headers={"content-type": "application/json"},
            timeout=600,
        )
        return answer.status_code

    with ThreadPoolExecutor(SCORERS) as clients:
        return list(clients.map(score, range(calls)))


def _idle(server: object, loaded: int) -> int:
    """The server's resident set once it handed back what the load left (it does so a moment
    after its last request), or whatever it holds after 30 s."""
    rss = server.memory_info  # type: ignore[attr-defined]
    with contextlib.suppress(AssertionError):  # reported as it is
        poll(lambda: rss().rss <= IDLE_RATIO * loaded or None, "idle memory", timeout_s=30)
    return int(rss().rss)


if __name__ == "__main__":
    raise SystemExit(main())
