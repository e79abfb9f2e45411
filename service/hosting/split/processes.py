"""Process entries' helpers: a front's main (its own ``SO_REUSEPORT`` listener, then uvicorn),
and ``become``: the name each shows in ``ps`` (``lmhead-engine``, ``lmhead-front``), and its
end with the supervisor's."""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
from collections.abc import MutableSequence
from pathlib import Path

from service.repository import staging
from service.settings import Settings


def front_main(
    settings: Settings, engine_socket: str, connections: MutableSequence[int], index: int
) -> None:
    """Spawned by the supervisor; SIGTERM drains this front's requests, then it exits.
    ``connections[index]`` is this front's count of open connections (see
    ``SharedConnections``)."""
    ignore_group_signals()  # the supervisor turns Ctrl-C and SIGHUP into SIGTERM
    become("lmhead-front")
    yield_to_engine(settings.front_nice)
    from service.hosting.app import create_app
    from service.hosting.connection import SharedConnections
    from service.hosting.listeners import listening_sockets
    from service.hosting.server import run_on
    from service.hosting.split.remote_plane import connected_plane

    app = create_app(settings, front=lambda: connected_plane(engine_socket, settings))
    shared = SharedConnections(connections, index)
    sockets = listening_sockets(settings.host, settings.port, reuse_port=True)
    # The supervisor's directory is in use until this front ends (``staging.join``).
    with staging.join(Path(engine_socket).parent) or contextlib.nullcontext():
        run_on(app, settings, sockets, shared)


def ignore_group_signals() -> None:
    """Ignore SIGINT and SIGHUP (a Ctrl-C, a closed terminal: sent to every process of the
    group, which the supervisor stops in order), then let through the SIGINT the
    supervisor's start held back (dropped)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def yield_to_engine(steps: int) -> None:
    """Lower this front's CPU priority by ``steps`` nice levels (``LMHEAD_FRONT_NICE``).

    On a machine whose cores the engine's onnxruntime threads fill, a front decoding a
    request preempts one of them mid-run, and a run's parallel loop waits for its slowest
    thread; at nice 19 the fronts take the cores as the runs leave them (still with a share
    when both want one). A trade, so off by default. Measured on 2 cores against one
    process, alternated in one run: with N = 2, 64-row ``.npy`` at 16 / 64 clients went
    from 1.00-1.02x / 0.99-1.03x (nice 0) to 1.09-1.15x / 1.05-1.07x (nice 19; nice 10 was
    no better than 0), and 1-row JSON at 64 clients on a small head from 1.28-1.36x to
    1.40-1.49x. With 8 fronts of 1-row JSON the starved fronts fed the engine a few rows at
    a time (2-7 rows per run instead of 23): 0.51-0.88x. Where cores are spare (a GPU
    machine) nothing waits for them either way."""
    if steps:
        with contextlib.suppress(OSError):  # a platform without nice: priority unchanged
            os.nice(steps)


PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15


def become(name: str) -> None:
    """Name this child process (Linux ``comm``, shown by ``ps``; spawned children are all
    "python" otherwise) and have the kernel send it SIGTERM if the supervisor dies without
    stopping it (SIGKILL, OOM): it then drains and exits instead of living on orphaned."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # it died before the line above
        raise SystemExit(0)  # nobody would ever stop this process, nor free its port
