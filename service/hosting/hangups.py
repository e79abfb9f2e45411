"""Clients that hang up: a request whose client has gone stops where it stands.

Starlette serves a request to its end whether or not anyone waits for the answer: a client
that sends 4096 rows and closes its connection had every row computed, holding queue places
honest clients were refused. ``Hangup`` watches the connection once the request's body is in
(before, ``receive`` is the handler's to read) and cancels the handler when the server says
the client disconnected. The cancellation reaches whatever the handler awaits: a batcher's
future (its rows leave the queue, ``Batcher._drop_if_gone``), the engine process's answer in
split mode (the engine is told, ``EngineLink.call``), a run in the executor not yet started.
A run already started finishes; its answer is dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect
from starlette.types import Message, Receive

T = TypeVar("T")


class Hangup:
    """One request's ``receive``, watched for its client going away."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._body_in = asyncio.Event()
        self._gone = False
        self._answered = False

    async def receive(self) -> Message:
        """The request's own ``receive`` (hand this to the handler's ``Request``)."""
        message = await self._receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            self._body_in.set()  # the whole body, or the client is gone already
        return message

    async def run(self, handler: Coroutine[Any, Any, T]) -> T:
        """``handler``'s result, awaited in this task (one watcher task beside it, not a task
        more per request); ``ClientDisconnect`` if the client left before it."""
        current = asyncio.current_task()
        assert current is not None
        watch = asyncio.ensure_future(self._watch(current))
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
            watch.cancel()

    async def _watch(self, request: asyncio.Task[Any]) -> None:
        await self._body_in.wait()
        while not self._answered:
            message = await self._receive()
            if message["type"] == "http.disconnect" and not self._answered:
                self._gone = True
                request.cancel()
                return
