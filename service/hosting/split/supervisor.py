"""The supervisor of ``LMHEAD_WORKERS`` > 1: one engine process, N front processes.

It makes a private directory (0700) for the engine's socket and the metrics files, checks the
ports are free, starts the engine, waits until it listens, then starts the fronts. Each front
binds the HTTP port with ``SO_REUSEPORT`` (and gRPC's, which grpc does on Linux), so the
kernel spreads connections over the fronts. Then it watches:

* a front that exits is started again; the engine and its loaded heads are untouched;
* an engine that exits is reported and started again; meanwhile the fronts answer 503 and
  fail readiness (never an answer from nothing), and reconnect by themselves;
* SIGTERM, SIGINT or SIGHUP stops the fronts first (each drains its requests, as uvicorn does), then
  the engine, then removes the directory.

Restarts back off (doubling, up to ``MAX_BACKOFF_S``) while a process keeps dying young.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from multiprocessing import resource_tracker
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType

from prometheus_client import multiprocess

from service.hosting.listeners import check_free, reserve
from service.repository import staging
from service.settings import Settings

logger = logging.getLogger("lmhead")
ENGINE_LISTEN_S = 120.0  # the engine listens before it loads anything; this is import time
STOP_MARGIN_S = 15.0
YOUNG_S = 5.0  # a process that dies younger than this is restarted after a backoff
MAX_BACKOFF_S = 5.0
#: The supervisor's private directory (the engine's socket, the journal, metrics files).
RUNTIME_PREFIX = "lmhead-run-"


def supervise(settings: Settings) -> int:
    """Run the processes until SIGTERM/SIGINT; the exit status of the service."""
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s %(message)s")
    logging.getLogger("lmhead").setLevel(settings.log_level.upper())  # `lmhead serve` set up
    # logging already (its level WARNING), so basicConfig alone left INFO unsaid
    held: list[socket.socket] = []
    runtime = Path(tempfile.mkdtemp(prefix=RUNTIME_PREFIX))
    # Held by every process of this service (``staging.join``): a supervisor killed outright
    # leaves it, swept by the next one once its engine and fronts have ended too.
    lock = staging.hold(runtime, shared=True)
    staging.sweep(Path(tempfile.gettempdir()), RUNTIME_PREFIX)
    try:
        metrics_dir = runtime / "metrics"
        metrics_dir.mkdir()
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)  # inherited by every child
        ports = {"port": settings.port, "grpc_port": settings.grpc_port}
        for name, port in ports.items():
            if port is not None:
                flag = name.replace("_", "-")
                check_free(settings.host, port, f"--{flag} or LMHEAD_{name.upper()}")
                holding = _hold(settings.host, port)
                held += holding
                ports[name] = holding[0].getsockname()[1] if holding else port  # 0: what it got
        settings = settings.model_copy(update=ports)
        return Group(settings, str(runtime / "engine.sock")).run()
    finally:
        for sock in held:
            sock.close()
        shutil.rmtree(runtime, ignore_errors=True)
        lock.close()


class Group:
    """The engine and the fronts, and what to do when one of them exits."""

    def __init__(self, settings: Settings, path: str) -> None:
        self._settings = settings
        self._path = path
        self._spawn = multiprocessing.get_context("spawn")
        self._engine: BaseProcess | None = None
        self._fronts: dict[int, BaseProcess] = {}
        self._started: dict[int | None, float] = {}
        self._backoff: dict[int | None, float] = {}
        self._stopping = False
        self._wake_r, self._wake_w = socket.socketpair()
        # Each front's open connections (``service.hosting.connection.SharedConnections``).
        self._connections = self._spawn.RawArray("q", settings.workers)

    def run(self) -> int:
        for number in (signal.SIGTERM, signal.SIGINT):
            signal.signal(number, self._stop)
        if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # `nohup` keeps it out
            signal.signal(signal.SIGHUP, self._stop)
        self._wake_w.setblocking(False)
        signal.set_wakeup_fd(self._wake_w.fileno())
        try:
            if not self._start_engine():
                return 0 if self._stopping else 1  # a stop asked for while starting
            for index in range(self._settings.workers):
                self._start_front(index)
            grpc = self._settings.grpc_port
            logger.info(
                "lmhead serving on %s:%d%s with %d front processes and one engine",
                self._settings.host,
                self._settings.port,
                "" if grpc is None else f" (gRPC on port {grpc})",
                self._settings.workers,
            )
            self._watch()
            return 0
        finally:
            self._shutdown()

    def _stop(self, signum: int, frame: FrameType | None) -> None:
        self._stopping = True

    def _start_engine(self) -> bool:
        from service.hosting.split.engine_server import engine_main

        listening, told = self._spawn.Pipe(duplex=False)
        engine = self._spawn.Process(
            target=engine_main,
            args=(self._settings, self._path, told),
            name="lmhead-engine",
        )
        _start_shielded(engine)
        told.close()  # the engine's end is its own now: this one reads EOF once it exits
        self._engine, self._started[None] = engine, time.monotonic()
        deadline = time.monotonic() + ENGINE_LISTEN_S
        try:
            while not listening.poll(0.1):  # the engine's word, or its death
                if not engine.is_alive() or time.monotonic() > deadline or self._stopping:
                    break
            else:
                return listening.recv_bytes() == b"listening"
        except (EOFError, OSError):
            pass
        finally:
            listening.close()
        logger.error("the engine process did not start (exit code %s)", engine.exitcode)
        return False

    def _start_front(self, index: int) -> None:
        from service.hosting.split.processes import front_main

        front = self._spawn.Process(
            target=front_main,
            args=(self._settings, self._path, self._connections, index),
            name=f"lmhead-front-{index}",
        )
        _start_shielded(front)
        self._fronts[index], self._started[index] = front, time.monotonic()

    def _watch(self) -> None:
        while not self._stopping:
            processes = [self._engine, *self._fronts.values()]
            sentinels = [p.sentinel for p in processes if p is not None]
            wait([*sentinels, self._wake_r], timeout=None)
            self._drain_wakeups()
            if self._stopping:
                return
            for index, front in list(self._fronts.items()):
                if not front.is_alive():
                    self._restart(index, front)
            if self._engine is not None and not self._engine.is_alive():
                self._restart(None, self._engine)

    def _restart(self, index: int | None, process: BaseProcess) -> None:
        what = "the engine" if index is None else f"front {index}"
        logger.error(
            "%s (pid %s) exited with code %s; restarting", what, process.pid, process.exitcode
        )
        if process.pid is not None:
            multiprocess.mark_process_dead(process.pid)  # type: ignore[no-untyped-call]
        if index is not None:
            self._connections[index] = 0  # its connections died with it
        young = time.monotonic() - self._started.get(index, 0.0) < YOUNG_S
        pause = min(2 * self._backoff.get(index, 0.05), MAX_BACKOFF_S) if young else 0.0
        self._backoff[index] = pause or 0.05
        if pause and wait([self._wake_r], timeout=pause):  # a stop may come meanwhile
            self._drain_wakeups()
        if self._stopping:
            return
        if index is None:
            self._start_engine()
        else:
            self._start_front(index)

    def _drain_wakeups(self) -> None:
        self._wake_r.setblocking(False)
        try:
            while self._wake_r.recv(64):
                pass
        except BlockingIOError:
            pass

    def _shutdown(self) -> None:
        """Fronts first (they drain), then the engine; anything left after the grace is killed."""
        grace = self._settings.drain_timeout_s + STOP_MARGIN_S
        _terminate(list(self._fronts.values()), grace)
        if self._engine is not None:
            _terminate([self._engine], grace)
        for process in [*self._fronts.values(), self._engine]:
            if process is not None and process.pid is not None:
                multiprocess.mark_process_dead(process.pid)  # type: ignore[no-untyped-call]
        signal.set_wakeup_fd(-1)


def _terminate(processes: list[BaseProcess], grace_s: float) -> None:
    for process in processes:
        if process.is_alive() and process.pid is not None:
            os.kill(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            logger.error("%s did not stop within %.0f s; killing it", process.name, grace_s)
            process.kill()
            process.join()


def _hold(host: str, port: int) -> list[socket.socket]:
    """``reserve``, or nothing (with a warning) where the kernel refuses it: an earlier server
    without ``SO_REUSEPORT`` on this port leaves connections in TIME_WAIT that only
    ``SO_REUSEADDR`` binds beside (the fronts still can; the port is then unguarded)."""
    try:
        return reserve(host, port)
    except SystemExit as refused:
        logger.warning("%s; the fronts bind it without a hold", refused)
        return []


def _start_shielded(process: BaseProcess) -> None:
    """Start ``process`` with Ctrl-C blocked: a child inherits the mask, so a Ctrl-C sent to
    the whole group while it starts waits until it ignores Ctrl-C
    (``processes.ignore_group_signals``) and is dropped, instead of ending in a
    ``KeyboardInterrupt`` traceback from deep in its bootstrap. The supervisor's own Ctrl-C
    waits those few milliseconds too. multiprocessing's resource tracker is started first:
    it starts on the first spawn, and unblocks Ctrl-C when it has (a start inside the shield
    left the engine unshielded; an ``Event`` made before had started it)."""
    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
