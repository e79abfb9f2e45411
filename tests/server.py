"""Run the real service in a subprocess (``python -m service serve``) for integration tests.

Readiness is polled on ``/health/ready`` until a deadline. Between polls the helper waits on
the process itself (``Popen.wait`` with a short timeout), so a server that dies is noticed at
once, with its log in the failure message. Output goes to a file, so a chatty server can
never block on a full pipe.
"""

from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TypeVar

import httpx
import psutil

from service.allocator import peak_resident_bytes

READY_DEADLINE_S = 60.0
POLL_INTERVAL_S = 0.05


T = TypeVar("T")


def poll(check: Callable[[], T | None], what: str, timeout_s: float = 30.0) -> T:
    """Call ``check`` until it returns a value, pausing between calls, up to a deadline.

    For outcomes the service reaches after it has answered (shadow statistics, a replaced
    version draining): the condition itself is checked every time, the pause only keeps the
    poll from spinning a core the server needs.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found is not None:
            return found
        time.sleep(POLL_INTERVAL_S)
    raise AssertionError(f"{what} did not happen within {timeout_s} s")


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include ``labels``."""
    return metric_in(httpx.get(f"{url}/metrics").text, name, **labels)


def metric_in(scrape: str, name: str, **labels: str) -> float:
    """``metric`` read from one scrape's text (several metrics of one moment)."""
    total = 0.0
    for line in scrape.splitlines():
        named = line.startswith((name + "{", name + " "))  # a metric without labels too
        if named and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def server_process(url: str) -> psutil.Process:
    """The server process behind ``url`` (a child of this one, found by its port)."""
    port = url.rsplit(":", 1)[1]
    (server,) = [
        p for p in psutil.Process().children(recursive=True) if port in " ".join(p.cmdline())
    ]
    return server


def peak_resident(process: psutil.Process) -> int:
    """VmHWM: the peak resident set of a process so far, in bytes."""
    return peak_resident_bytes(process.pid)


def anonymous_peak(process: psutil.Process, action: Callable[[], T]) -> tuple[T, int]:
    """Run ``action`` in a thread and read ``process``'s anonymous resident bytes (RssAnon)
    as often as /proc allows until it returns: the result and the highest value seen.

    VmHWM counts clean file pages too (a weight file mapped while onnxruntime packs it, which
    the kernel drops under pressure); this is the memory a process really holds. Sampling can
    miss a spike shorter than one read (~50 us), never invent one.
    """
    highest = 0
    with ThreadPoolExecutor(1) as worker:
        done = worker.submit(action)
        while True:
            finished = done.done()
            highest = max(highest, anonymous_resident(process))
            if finished:
                return done.result(), highest


def anonymous_resident(process: psutil.Process) -> int:
    """RssAnon: resident bytes not backed by a file."""
    status = Path(f"/proc/{process.pid}/status").read_text()
    match = re.search(r"^RssAnon:\s+(\d+) kB", status, re.MULTILINE)
    assert match is not None, "no RssAnon in /proc (Linux only)"
    return int(match.group(1)) * 1024


#: Where ``free_port`` picks: below Linux's ephemeral range (32768-60999), from which the kernel
#: hands ports to outgoing connections and to binds on port 0 (another test's probe could get
#: the port a server of this test is about to bind), cut into one slice per pytest-xdist worker.
PORTS = range(20000, 32768)
_HANDED_OUT: set[int] = set()
_PICK = random.Random()  # its own: a test that seeds the module's never repeats the picks


def _worker_ports() -> range:
    """This process's slice of ``PORTS``: worker ``gwN`` of ``PYTEST_XDIST_WORKER_COUNT`` gets
    the N-th, so no two workers ever pick the same port; outside xdist, all of them."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    size = len(PORTS) // count
    start = PORTS.start + int(worker.removeprefix("gw")) * size
    return range(start, start + size)


def free_port() -> int:
    """A loopback port free now and never handed out before in this test process, from this
    worker's slice of ``PORTS``: within one process a port is handed out once (a test that
    picks a gRPC port, then starts a server that picks its HTTP port, once had both on one
    port: CI, errno 98), and workers pick from slices of their own. Picked at random in the
    slice, so two suites running at once on one machine rarely meet."""
    ports = _worker_ports()
    for port in _PICK.sample(ports, len(ports)):
        if port in _HANDED_OUT:
            continue
        _HANDED_OUT.add(port)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:  # another program's
                continue
        return port
    raise RuntimeError(f"no free port left in {ports}")


@contextmanager
def running_server(repository: Path, **settings: str) -> Iterator[str]:
    """Start the service on a free loopback port; yield its base URL once ready."""
    with _serving(repository, None, settings) as (url, _):
        yield url


@contextmanager
def running_script(repository: Path, **settings: str) -> Iterator[str]:
    """``running_server`` started as users start it: the ``lmhead`` console script (whose
    imports multiprocessing's spawn runs again in every child; ``-m service`` is exempt)."""
    with _serving(repository, None, settings, script=True) as (url, _):
        yield url


@contextmanager
def running_server_on(port: int, repository: Path) -> Iterator[str]:
    """``running_server`` on a port chosen beforehand (for clients started before it)."""
    with _serving(repository, None, {}, port=port) as (url, _):
        yield url


@contextmanager
def live_server(repository: Path, **settings: str) -> Iterator[tuple[str, Callable[[], str]]]:
    """The service once it is *live* (for start-ups that never get ready), and its log."""
    with _serving(repository, None, settings, "/health/live") as served:
        yield served


@contextmanager
def running_checkout(source: Path, repository: Path, **settings: str) -> Iterator[str]:
    """``running_server`` with the ``service`` package of another checkout (before/after)."""
    with _serving(repository, source, settings) as (url, _):
        yield url


@contextmanager
def _serving(
    repository: Path,
    source: Path | None,
    settings: dict[str, str],
    probe: str = "/health/ready",
    port: int | None = None,
    script: bool = False,
) -> Iterator[tuple[str, Callable[[], str]]]:
    port = port or free_port()
    env = {**os.environ, **{f"LMHEAD_{key.upper()}": value for key, value in settings.items()}}
    if source is not None:
        env["PYTHONPATH"] = str(source)
    entry = (
        [str(Path(sys.executable).with_name("lmhead"))]
        if script
        else [sys.executable, "-m", "service"]
    )
    command = [*entry, "serve", "--repository", str(repository)]
    with tempfile.TemporaryFile(mode="a+b") as log:  # appends: reading never races writes
        process = subprocess.Popen(
            [*command, "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=source,
        )
        base_url = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(process, base_url, log, probe)
            yield base_url, lambda: _text(log)
        finally:
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_ready(
    process: subprocess.Popen[bytes], base_url: str, log: IO[bytes], probe: str
) -> None:
    deadline = time.monotonic() + READY_DEADLINE_S
    with httpx.Client(base_url=base_url, timeout=5) as client:
        while time.monotonic() < deadline:
            try:
                if client.get(probe).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            try:
                process.wait(timeout=POLL_INTERVAL_S)
            except subprocess.TimeoutExpired:
                continue
            raise RuntimeError(f"server exited with {process.returncode}:\n{_text(log)}")
    raise TimeoutError(f"server not ready within {READY_DEADLINE_S}s:\n{_text(log)}")


def _text(log: IO[bytes]) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")
