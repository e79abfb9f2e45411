"""A real multi-node Ray cluster on this machine: a head and two worker nodes, each started by
``ray start --block`` in its own process group (so a test can kill a whole node), torn down
at the end. Only ``make ray-test`` runs these (the ray extra, its own environment)."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# Token authentication, as a production cluster runs it: one token for every node and this
# driver (RAY_AUTH_TOKEN_PATH, not the user's ~/.ray/auth_token), set before Ray is imported
# (it reads its configuration once).
_TOKEN = Path(tempfile.mkdtemp(prefix="lmhead-ray-")) / "auth_token"
_TOKEN.write_text(secrets.token_hex(32))
_TOKEN.chmod(0o600)
os.environ |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(_TOKEN)}

ray = pytest.importorskip("ray", reason="the ray extra: make ray-test")

from tests.server import free_port, poll  # noqa: E402

#: Logical CPUs per node: replicas ask for 0.5, so each node holds a few.
NODE_CPUS = 2
START_DEADLINE_S = 120
NODE_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_raylet_start_wait_time_s": "120",  # 2 shared cores: a raylet can start slowly
    # Replicas and handles report load every 0.5 s (default 10 s) so autoscaling tests are quick.
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    # The tests' one proxy (on the head) would keep requests on the head's replica until it is
    # full; spread them as proxies on every node behind a load balancer do in production.
    "RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING": "0",
}


#: Lines the tests report (requests sent, retried, failed), printed after the run.
COUNTS: list[str] = []


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if COUNTS:
        terminalreporter.section("requests counted under failures and publications")
        for line in COUNTS:
            terminalreporter.write_line(line)


@dataclass
class Cluster:
    address: str
    nodes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    """Process groups by role: "head", "worker-1", "worker-2"."""

    def kill(self, role: str) -> None:
        """Kill a whole node (its raylet and every worker process on it), as a crash would."""
        process = self.nodes.pop(role)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def _ray(*args: str, log: Path) -> subprocess.Popen[bytes]:
    command = [str(Path(sys.executable).with_name("ray")), "start", "--block", *args]
    env = {**os.environ, **NODE_ENV}
    with log.open("ab") as out:
        return subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def _wait_for_nodes(count: int) -> None:
    def alive() -> int | None:
        nodes = sum(1 for node in ray.nodes() if node["Alive"])
        return nodes if nodes >= count else None

    poll(alive, f"{count} Ray nodes alive", START_DEADLINE_S)


def _connect(address: str, head: subprocess.Popen[bytes]) -> None:
    """``ray.init`` once the head's GCS answers (it refuses connections until then)."""

    def connected() -> bool | None:
        if head.poll() is not None:
            raise RuntimeError(f"the Ray head exited with {head.returncode}")
        try:
            ray.init(address=address, logging_level="warning", log_to_driver=False)
        except (ConnectionError, RuntimeError):
            return None
        return True

    poll(connected, "the Ray head answering", START_DEADLINE_S)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("ray-logs")
    port = free_port()
    address = f"127.0.0.1:{port}"
    common = [f"--num-cpus={NODE_CPUS}", "--object-store-memory=100000000", "--disable-usage-stats"]
    head = _ray(
        "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--include-dashboard=false",
        *common, log=logs / "head.log",
    )  # fmt: skip
    nodes = {"head": head}
    try:
        _connect(address, head)
        for index in (1, 2):  # one at a time: two raylets starting at once on 2 cores time out
            nodes[f"worker-{index}"] = _ray(
                f"--address={address}", "--node-ip-address=127.0.0.1", *common,
                log=logs / f"worker-{index}.log",
            )  # fmt: skip
            _wait_for_nodes(1 + index)
        yield Cluster(address, nodes)
    finally:
        ray.shutdown()
        for process in nodes.values():
            _stop(process)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the node's process group (``ray start --block`` stops its node), then KILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
            process.wait(timeout=30)
            return
        except ProcessLookupError:
            process.wait(timeout=30)
            return
        except subprocess.TimeoutExpired:
            continue
