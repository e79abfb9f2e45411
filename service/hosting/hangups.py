"""Clients that hang up: a request whose client has gone stops where it stands.

Starlette serves a request to its end whether or not anyone waits for the answer: a client
that sends 4096 rows and closes its connection had every row computed, holding queue places
honest clients were refused. ``Hangup`` watches the connection once the request's body is in
(before, ``receive`` is the handler's to read) and cancels the handler when the server says
the client disconnected. The cancellation reaches whatever the handler awaits: a batcher's
future (its rows leave the queue, ``Batcher._drop_if_gone``), the engine process's answer in
split mode (the engine is told, ``EngineLink.call``), a run in the executor not yet started.
A run already started finishes; its answer is dropped.

Served by ``service.hosting.connection`` (``lmhead serve``), the connection itself says when
it is lost (``scope["lmhead.on_lost"]``, from the body's end on): no watcher task per
request. Under another server (``uvicorn --factory``) a watcher task reads ``receive``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect
from starlette.types import Message, Receive

T = TypeVar("T")
#: ``scope["lmhead.on_lost"]``: register a callback for the connection's loss (None: forget).
OnLost = Callable[[Callable[[], None] | None], None]


class Hangup:
    """One request's ``receive``, watched for its client going away."""

    def __init__(self, receive: Receive, on_lost: OnLost | None = None) -> None:
        self._receive = receive
        self._on_lost = on_lost
        self._body_in = asyncio.Event()
        self._gone = False
        self._answered = False
        self._task: asyncio.Task[Any] | None = None

    async def receive(self) -> Message:
        """The request's own ``receive`` (hand this to the handler's ``Request``)."""
        message = await self._receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            self._body_in.set()  # the whole body, or the client is gone already
            if self._on_lost is not None and not self._answered:
                self._on_lost(self._lost)  # the connection tells of its loss from now on
        return message

    async def run(self, handler: Coroutine[Any, Any, T]) -> T:
        """``handler``'s result, awaited in this task (one watcher task beside it, not a task
        more per request); ``ClientDisconnect`` if the client left before it."""
        current = self._task = asyncio.current_task()
        assert current is not None
        # The connection tells once the body is in (``receive``); else a watcher task.
        watch = None if self._on_lost else asyncio.ensure_future(self._watch(current))
        try:
            result = await handler
            self._answered = True  # no await since: the watcher cannot have cancelled us
            return result
        except asyncio.CancelledError:
            if self._gone and current.cancelling() == 1:  # only the watcher cancelled us
                current.uncancel()
                raise ClientDisconnect from None
            raise
        finally:
            self._answered = True
            if watch is None:
                self._on_lost(None)  # type: ignore[misc]
            else:
                watch.cancel()

    def _lost(self) -> None:
        """The connection is gone (told by the connection, on the event loop)."""
        if not self._answered and self._task is not None:
            self._gone = True
            self._task.cancel()

    async def _watch(self, request: asyncio.Task[Any]) -> None:
        await self._body_in.wait()
        while not self._answered:
            message = await self._receive()
            if message["type"] == "http.disconnect" and not self._answered:
                self._gone = True
                request.cancel()
                return
