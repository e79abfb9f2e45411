"""A front's data plane: the ``Plane`` calls, answered by the engine process.

``RemotePlane`` keeps one connection (``EngineLink``) to the engine and reconnects when it is
lost (an engine restarted by the supervisor). Requests are packed into this front's arena
(``service.hosting.split.channel``); answers come back as read-only views of the engine's answer
arena, valid until the request that asked is done (``admit`` releases them then, so encoders
read the engine's memory directly). A call outside a request copies its answer out instead.
Calls made in one event-loop turn go in one frame; released blocks ride on the next frame
to the engine (or go alone after ``FREE_AFTER_S``).

While no engine is connected every call is a 503 ``model_not_ready`` (readiness fails, never
an answer from nothing); calls in flight when the engine dies get the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import logging
import os
import pickle
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from contextvars import ContextVar
from typing import Any

from service.allocator import IdleRelease
from service.budget import MemoryBudget, Reservation
from service.errors import ModelNotReady, ServiceError, by_code
from service.hosting.split.arena import Arena, attach
from service.hosting.split.channel import HANDSHAKE_S, HELLO_BYTES, FrameProtocol, arena_bytes
from service.plane.protocol import Plane, check_token, forwarding
from service.settings import Settings

logger = logging.getLogger("lmhead")
RECONNECT_S = (0.02, 1.0)  # first and longest pause between attempts
#: A front waits this long for the engine before serving (it listens before fronts start, so
#: normally milliseconds); past it, a front started during an engine outage answers 503.
CONNECT_S = 5.0
NOT_CONNECTED = "the engine process is not connected (starting or restarting); retry shortly"

#: A readiness check waits this long for the engine, then says not ready (a probe's own
#: timeout may be shorter: it then fails the same way, only without the reason). Loading a
#: head stored inside its .onnx file holds the engine's interpreter for seconds (measured
#: 5-6 s for 512 MiB: protobuf parsing keeps the GIL), so a shorter wait would fail
#: readiness on every such swap.
ENGINE_SILENT_S = 10.0
FREE_AFTER_S = 0.01  # released blocks ride on the next call, or go alone after this

_answers: ContextVar[list[tuple[EngineLink, int]] | None] = ContextVar(
    "lmhead_answer_blocks", default=None
)


class EngineLink(FrameProtocol):
    """One connection to the engine: calls by id, answers matched back, blocks accounted.

    A frame's block holds the arrays of every message in it: a request block is freed once
    every call in it is answered, an answer block is released to the engine once every
    request it answered is done with it (``release``)."""

    def __init__(self, requests: Arena, answers: Arena) -> None:
        super().__init__(answers, requests)
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._request_block: dict[int, int] = {}  # call id -> its frame's block
        self._calls_in: dict[int, int] = {}  # request block -> calls not yet answered
        self._readers: dict[int, int] = {}  # answer block -> requests still reading it
        self._done: list[int] = []  # answer blocks to hand back
        self._free_timer: asyncio.TimerHandle | None = None

    async def call(
        self, method: str, arguments: tuple[Any, ...], keywords: dict[str, Any] | None = None
    ) -> Any:
        call_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        try:
            self.post(("call", call_id, method, arguments, keywords or {}))
        except ConnectionError:
            del self._pending[call_id]
            raise ModelNotReady(NOT_CONNECTED, headers={"Retry-After": "1"}) from None
        try:
            kind, payload, block = await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # answered as the caller went away
                self.release(future.result()[2])
            else:  # the engine drops the call (its answer, an error, frees its bookkeeping)
                with contextlib.suppress(ConnectionError):
                    self.post(("cancel", call_id, "", (), {}))
            raise
        held = _answers.get()
        if block is not None:
            if held is None:  # nobody to release it after encoding: copy out, release now
                payload = copy.deepcopy(payload)
                self.release(block)
            else:
                held.append((self, block))
        if kind == "error":
            code, text, headers = payload
            error = by_code(code).__new__(by_code(code))
            ServiceError.__init__(error, text, headers=headers)
            raise error
        return payload

    def release(self, block: int | None) -> None:
        """One request is done reading ``block``; the last one hands it back to the engine
        (with the next frame, or alone after ``FREE_AFTER_S``)."""
        if block is None:
            return
        left = self._readers.get(block, 1) - 1
        if left > 0:
            self._readers[block] = left
            return
        self._readers.pop(block, None)
        self._done.append(block)
        if self._free_timer is None:
            loop = asyncio.get_running_loop()
            self._free_timer = loop.call_later(FREE_AFTER_S, self._hand_back)

    def released(self) -> list[int]:
        done, self._done = self._done, []
        return done

    def on_sent(self, messages: list[Any], block: int | None) -> None:
        if block is None:
            return
        calls = [message for message in messages if message[0] == "call"]
        self._calls_in[block] = len(calls)
        for message in calls:
            self._request_block[message[1]] = block

    def on_unsent(self, messages: list[Any]) -> None:
        for message in messages:
            if message[0] == "call":
                self._fail(message[1])

    def on_frame(self, released: list[int], messages: list[Any], block: int | None) -> None:
        readers = 0
        for kind, call_id, payload in messages:
            self._answered(call_id)
            future = self._pending.pop(call_id, None)
            if future is not None and not future.cancelled():  # else: the client went away
                future.set_result((kind, payload, block))
                readers += 1
        if block is not None:
            if readers:
                self._readers[block] = readers
            else:
                self.release(block)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self._free_timer is not None:
            self._free_timer.cancel()
        for call_id in list(self._pending):
            self._answered(call_id)
            self._fail(call_id)

    def _answered(self, call_id: int) -> None:
        block = self._request_block.pop(call_id, None)
        if block is None:
            return
        left = self._calls_in[block] - 1
        if left:
            self._calls_in[block] = left
        else:
            del self._calls_in[block]
            self.outgoing.free(block)

    def _fail(self, call_id: int) -> None:
        future = self._pending.pop(call_id, None)
        if future is not None and not future.done():
            future.set_exception(
                ModelNotReady(
                    "the engine process stopped before answering; retry shortly",
                    headers={"Retry-After": "1"},
                )
            )

    def _hand_back(self) -> None:
        self._free_timer = None
        if self._done and self.transport is not None and not self.transport.is_closing():
            self.flush_soon()


@forwarding
class RemotePlane(Plane):
    """The ``Plane`` of a front process (see the module docstring): ``admit`` and ``authorize``
    here, ``check_ready`` with a deadline, every other verb forwarded as it is declared."""

    def __init__(self, path: str, settings: Settings) -> None:
        self._path = path
        self._settings = settings
        # freed memory back to the OS once idle after big bodies, as the engine does
        self._budget = MemoryBudget(settings.max_inflight_bytes)
        self._budget.on_idle = IdleRelease(None, lambda: self._budget.used == 0).soon
        self._arena, self._arena_fd = Arena.create(arena_bytes(settings), "lmhead-requests")
        self._link: EngineLink | None = None
        self._keeper: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()

    async def start(self, timeout_s: float) -> None:
        """Connect in the background, keep connected; return once connected (a front serves
        no request before it can reach the engine), or after ``timeout_s`` regardless."""
        self._keeper = asyncio.get_running_loop().create_task(self._keep_connected())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._connected.wait(), timeout_s)

    async def close(self) -> None:
        if self._keeper is not None:
            self._keeper.cancel()
            await asyncio.gather(self._keeper, return_exceptions=True)
        if self._link is not None and self._link.transport is not None:
            self._link.transport.close()
        os.close(self._arena_fd)

    @contextmanager
    def admit(self) -> Iterator[Reservation]:
        """Hold the request's memory (its body) and the engine's answer blocks until answered.
        (The engine counts the request in flight: one process writes that gauge, not N.)"""
        held: list[tuple[EngineLink, int]] = []
        token = _answers.set(held)
        try:
            with self._budget.request() as reservation:
                yield reservation
        finally:
            _answers.reset(token)
            for link, block in held:
                link.release(block)

    def authorize(self, presented: str | None) -> None:
        token = self._settings.admin_token
        check_token(None if token is None else token.get_secret_value(), presented)

    async def check_ready(self) -> None:
        """Ready only if the engine says so within ``ENGINE_SILENT_S``: a frozen engine (a
        stopped process, a stuck event loop) is alive to the supervisor, not ready."""
        try:
            await asyncio.wait_for(self.forward("check_ready", (), {}), ENGINE_SILENT_S)
        except TimeoutError:
            raise ModelNotReady(
                f"the engine process has not answered in {ENGINE_SILENT_S:g} s",
                headers={"Retry-After": "1"},
            ) from None

    async def forward(self, verb: str, arguments: tuple[Any, ...], keywords: dict[str, Any]) -> Any:
        """Every other verb of the ``Plane`` (``forwarding`` makes them, binding what it is
        given to the declared signature): the engine answers."""
        link = self._link
        if link is None:
            raise ModelNotReady(NOT_CONNECTED, headers={"Retry-After": "1"})
        return await link.call(verb, arguments, keywords)

    async def _keep_connected(self) -> None:
        pause = RECONNECT_S[0]
        while True:
            try:
                link = await self._connect()
            except OSError as error:
                logger.debug("engine not reachable yet: %s", error)
                await asyncio.sleep(pause)  # a backoff between attempts, not a readiness wait
                pause = min(2 * pause, RECONNECT_S[1])
                continue
            pause = RECONNECT_S[0]
            self._link = link
            self._connected.set()
            logger.info("connected to the engine process")
            await link.closed
            self._link = None
            logger.error("lost the engine process; reconnecting (readiness fails until then)")

    async def _connect(self) -> EngineLink:
        connection, size, fd = await asyncio.to_thread(self._handshake)
        loop = asyncio.get_running_loop()
        answers = attach(fd, size)
        _, link = await loop.create_unix_connection(
            lambda: EngineLink(self._arena, answers), sock=connection
        )
        return link

    def _handshake(self) -> tuple[socket.socket, int, int]:
        """Connect, send this front's arena, receive the engine's answer arena."""
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.settimeout(HANDSHAKE_S)
            connection.connect(self._path)
            hello = pickle.dumps(("hello", os.getpid(), self._arena.size))
            socket.send_fds(connection, [hello], [self._arena_fd])
            welcome, fds, _, _ = socket.recv_fds(connection, HELLO_BYTES, 1)
            if not welcome or len(fds) != 1:
                raise ConnectionError("the engine closed the handshake")
            kind, _, size = pickle.loads(welcome)
            if kind != "welcome":
                raise ConnectionError("not an lmhead engine")
            connection.setblocking(False)
            return connection, size, fds[0]
        except BaseException:
            connection.close()
            raise


@asynccontextmanager
async def connected_plane(path: str, settings: Settings) -> AsyncIterator[RemotePlane]:
    """A started ``RemotePlane`` (it connects in the background), closed on exit."""
    plane = RemotePlane(path, settings)  # type: ignore[abstract]  # verbs: ``forwarding``
    await plane.start(CONNECT_S)
    try:
        yield plane
    finally:
        await plane.close()
