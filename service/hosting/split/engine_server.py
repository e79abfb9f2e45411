"""The engine process: one registry, batchers and sessions, serving every front over a socket.

Each front connects to the Unix socket, hands over the descriptor of its request arena and
gets one for an answer arena the engine makes for it (``_handshake``). A forwarded call is a
frame: the engine reads the request as views of the front's arena, runs the data-plane method
under its own memory reservation, and answers with the result's arrays in the answer arena (or
with the error's code, message and headers); the front's next call says which answer blocks
it is done with. Requests from all fronts reach the same
``DataPlane``, so dynamic batching merges them. The engine never keeps a view of a front's
arena after answering (the shadow copies the rows it replays later).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import signal
import socket
import struct
from collections.abc import Coroutine, Hashable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from service.errors import ServiceError
from service.hosting.engine import running_engine
from service.hosting.split.arena import Arena, attach
from service.hosting.split.channel import (
    HANDSHAKE_S,
    HELLO_BYTES,
    FrameProtocol,
    arena_bytes,
)
from service.hosting.split.processes import become, ignore_group_signals
from service.metrics import Metrics
from service.plane.dataplane import DataPlane
from service.plane.grouping import group_key
from service.plane.protocol import INFERENCE_VERBS, VERBS
from service.repository import staging
from service.repository.journal import ControlJournal
from service.settings import Settings

logger = logging.getLogger("lmhead")
#: The outcome of a call that raised something other than a ``ServiceError`` (a bug).
FAILED = object()
#: The outcome of a call whose client went away before it was answered.
CANCELLED = object()
INTERNAL: tuple[str, str, dict[str, str]] = (
    "internal_error",
    "the engine failed on this request (see its log)",
    {},
)


class FrontConnection(FrameProtocol):
    """One front: its calls run as tasks; the blocks it has read are freed in its arena."""

    def __init__(self, plane: DataPlane, requests: Arena, answers: Arena) -> None:
        super().__init__(requests, answers)
        self._plane = plane
        self.calls: set[asyncio.Task[None]] = set()
        self._serving: dict[int, asyncio.Task[None]] = {}  # call id -> the task answering it
        self._callers: dict[asyncio.Task[None], set[int]] = {}  # its calls still wanted

    def on_frame(self, released: list[int], messages: list[Any], block: int | None) -> None:
        for offset in released:
            self.outgoing.free(offset)
        groups: dict[tuple[Hashable, ...], list[tuple[int, Any]]] = {}
        for kind, call_id, method, arguments, keywords in messages:
            if kind == "cancel":
                self._cancel(call_id)
                continue
            key = None if keywords else group_key(method, arguments)
            if key is None:
                self._spawn(self._answer(call_id, method, arguments, keywords), [call_id])
            else:
                groups.setdefault(key, []).append((call_id, arguments[0]))
        for key, members in groups.items():
            method = str(key[0])  # a group key starts with its method
            if len(members) == 1:
                call_id, request = members[0]
                self._spawn(self._answer(call_id, method, (request,), {}), [call_id])
            else:
                ids = [call_id for call_id, _ in members]
                self._spawn(self._answer_group(method, members), ids)

    def _spawn(self, answering: Coroutine[Any, Any, None], call_ids: list[int]) -> None:
        task = asyncio.get_running_loop().create_task(answering)
        self.calls.add(task)
        self._callers[task] = set(call_ids)
        for call_id in call_ids:
            self._serving[call_id] = task
        task.add_done_callback(lambda _: self._forget(task, call_ids))

    def _forget(self, task: asyncio.Task[None], call_ids: list[int]) -> None:
        self.calls.discard(task)
        self._callers.pop(task, None)
        for call_id in call_ids:
            self._serving.pop(call_id, None)

    def _cancel(self, call_id: int) -> None:
        """A front's client went away: its call stops where it stands (nothing queued for it
        is computed), a call served with others once none of them is wanted."""
        task = self._serving.pop(call_id, None)
        if task is None:  # answered already
            return
        wanted = self._callers.get(task, set())
        wanted.discard(call_id)
        if not wanted:
            task.cancel()

    async def _answer_group(self, method: str, members: list[tuple[int, Any]]) -> None:
        """Calls that differ only in their rows, served as one (``DataPlane.topk_group``)."""
        outcomes: list[Any]
        requests = [request for _, request in members]
        try:
            with self._plane.admit(len(members)):
                if method == "topk":
                    outcomes = await self._plane.topk_group(requests)
                else:
                    outcomes = await self._plane.infer_group(requests)
        except asyncio.CancelledError:  # every caller went away (``_cancel``)
            outcomes = [CANCELLED] * len(members)
        except Exception:
            logger.exception("engine call %s failed for %d grouped calls", method, len(members))
            outcomes = [FAILED] * len(members)
        for (call_id, _), outcome in zip(members, outcomes, strict=True):
            self._reply(_message(call_id, outcome))

    async def _answer(
        self, call_id: int, method: str, arguments: tuple[Any, ...], keywords: dict[str, Any]
    ) -> None:
        """One call: the plane's ``method`` with the arguments as the front bound them
        (positional in the declared order; keyword-only ones by name)."""
        outcome: Any
        try:
            if method not in VERBS:
                raise ServiceError(f"the engine has no call {method!r}")
            # inference verbs are counted in flight (``admit``); metadata and control are not
            hold = self._plane.admit if method in INFERENCE_VERBS else self._plane.reserve
            with hold():
                outcome = await getattr(self._plane, method)(*arguments, **keywords)
        except ServiceError as error:
            outcome = error
        except asyncio.CancelledError:  # its caller went away (``_cancel``), or a shutdown
            outcome = CANCELLED
        except Exception:
            logger.exception("engine call %s failed", method)
            outcome = FAILED
        self._reply(_message(call_id, outcome))

    def _reply(self, message: tuple[Any, ...]) -> None:
        with contextlib.suppress(ConnectionError):  # the front is gone: nobody to answer
            self.post(message)  # with the other answers of this turn, in one frame


def _message(call_id: int, outcome: Any) -> tuple[Any, ...]:
    """The answer to one call: its result, its error, or the engine's own failure."""
    if isinstance(outcome, ServiceError):
        return ("error", call_id, (outcome.code, outcome.message, outcome.headers))
    if outcome is FAILED:
        return ("error", call_id, INTERNAL)
    if outcome is CANCELLED:  # answered still: the front frees the call's bookkeeping then
        return ("error", call_id, ("cancelled", "the call's client went away", {}))
    return ("ok", call_id, outcome)


class EngineServer:
    """Accepts fronts on ``path`` and keeps their connections until ``close``."""

    def __init__(self, plane: DataPlane, path: str, arena_bytes: int) -> None:
        self._plane = plane
        self._path = path
        self._arena_bytes = arena_bytes
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._accepting: asyncio.Task[None] | None = None
        self._fronts: set[FrontConnection] = set()

    def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)
        self._listener.bind(self._path)
        os.chmod(self._path, 0o600)
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._accepting = asyncio.get_running_loop().create_task(self._accept())

    async def close(self, drain_s: float) -> None:
        """Stop accepting; give the fronts up to ``drain_s`` to finish and disconnect (a
        SIGTERM sent to the whole process group reaches the engine as early as the fronts
        that are still draining), then let the calls in flight answer, and close."""
        if self._accepting is not None:
            self._accepting.cancel()
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)
        connected = [front.closed for front in self._fronts]
        if connected:
            await asyncio.wait(connected, timeout=drain_s)
        calls = {task for front in self._fronts for task in front.calls}
        if calls:
            await asyncio.wait(calls, timeout=drain_s)
        for front in self._fronts:
            if front.transport is not None:
                front.transport.close()

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            connection, _ = await loop.sock_accept(self._listener)
            loop.create_task(self._open(connection))

    async def _open(self, connection: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            requests, answers = await asyncio.to_thread(_handshake, connection, self._arena_bytes)
        except (OSError, ValueError, pickle.UnpicklingError) as error:
            logger.warning("a front's handshake failed: %s", error)
            connection.close()
            return
        _, front = await loop.connect_accepted_socket(
            lambda: FrontConnection(self._plane, requests, answers), connection
        )
        self._fronts.add(front)
        front.closed.add_done_callback(lambda _: self._fronts.discard(front))


def _handshake(connection: socket.socket, arena_bytes: int) -> tuple[Arena, Arena]:
    """Check the peer is this user, map its request arena, send it a new answer arena."""
    connection.setblocking(True)
    connection.settimeout(HANDSHAKE_S)
    _check_peer(connection)
    hello, fds, _, _ = socket.recv_fds(connection, HELLO_BYTES, 1)
    kind, pid, size = pickle.loads(hello)
    if kind != "hello" or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ValueError("a connection that is not a front")
    requests = attach(fds[0], size)
    answers, fd = Arena.create(arena_bytes, f"lmhead-answers-{pid}")
    try:
        socket.send_fds(connection, [pickle.dumps(("welcome", os.getpid(), arena_bytes))], [fd])
    finally:
        os.close(fd)
    connection.setblocking(False)
    return requests, answers


def _check_peer(connection: socket.socket) -> None:
    """Only processes of this user may feed the engine (the socket is 0600 too)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return
    credentials = connection.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i"))
    _, uid, _ = struct.unpack("3i", credentials)
    if uid != os.getuid():
        raise ValueError(f"a connection from user {uid}, not this service's user")


def engine_main(settings: Settings, path: str, listening: Connection) -> None:
    """The engine process's entry (spawned by the supervisor); runs until SIGTERM."""
    ignore_group_signals()  # Ctrl-C reaches every process: the
    # supervisor stops the fronts first, then this one, so no front loses its engine early
    become("lmhead-engine")
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s engine %(message)s")
    with (  # the supervisor's directory is in use until this process ends
        staging.join(Path(path).parent) or contextlib.nullcontext(),
        asyncio.Runner(loop_factory=_loop_factory()) as runner,
    ):
        runner.run(_serve(settings, path, listening))


async def _serve(settings: Settings, path: str, listening: Connection) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    # Kept in the supervisor's private directory: an engine started after this one dies
    # serves what the control API made of this one (``service.repository.journal``).
    journal = ControlJournal(Path(path).with_name("control.json"))
    async with running_engine(settings, Metrics(multiprocess=True), journal) as engine:
        server = EngineServer(engine.plane, path, arena_bytes(settings))
        server.start()
        _say_listening(listening)
        await stop.wait()
        await server.close(settings.drain_timeout_s)


def _say_listening(listening: Connection) -> None:
    """Tell the supervisor through the pipe it gave (not a ``multiprocessing.Event``: setting
    one waits for every process that waited on it, and a supervisor killed meanwhile never
    answers, which held this loop, and its SIGTERM, for good)."""
    with contextlib.suppress(OSError):  # the supervisor is gone: its end of the pipe too
        listening.send_bytes(b"listening")
    listening.close()


def _loop_factory() -> Any:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
