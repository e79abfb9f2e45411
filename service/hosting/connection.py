"""One HTTP connection as lmhead serves it: uvicorn's httptools protocol, with the limits a
public endpoint needs.

uvicorn (httptools) has no limit on header bytes, no timeout for a request head or body that
never completes, and accepts every connection until file descriptors run out. Measured against
lmhead: ten connections sending headers that never end held +480 MB; 1,100 idle connections
made normal requests fail. ``LimitedHttp`` adds, per connection:

* header bytes (request line and headers) above ``max_header_bytes`` -> 431 and close;
* a head not complete within ``header_timeout_s`` of its first byte (or of the connection,
  for the first request) -> 408 and close; a body that stalls for ``body_timeout_s`` -> 408;
* more than ``max_pipelined`` requests read ahead of their answers -> 503 and close;
* a request httptools cannot parse -> a JSON 400 once the requests before it are answered
  (uvicorn wrote a text 400 at once: read as an earlier request's answer, which was lost);
  a transfer coding other than ``chunked`` -> 501; an HTTP/1.1 request without exactly one
  ``Host`` -> 400 (RFC 9112 3.2); an answer given without asking for a body the client holds
  back for ``100 Continue`` says ``connection: close`` and closes (the next request would be
  read as the body);
* connections beyond ``max_connections`` -> 503 at once and close (uvicorn's own
  ``limit_concurrency`` answers only once a request arrives, holding the descriptor); with
  ``LMHEAD_WORKERS`` > 1 the cap holds for all fronts together (``SharedConnections``).
* a body bringing less than ``MIN_BODY_BYTES`` per ``body_timeout_s`` -> 408; an answer the
  client reads none of for ``body_timeout_s`` -> dropped (until then its request keeps its
  share of ``LMHEAD_MAX_INFLIGHT_BYTES``: the app waits for ``scope["lmhead.sent"]``).

``service.hosting.server`` serves the app with these limits (``limited_protocol``).

Doing so overrides and reads uvicorn internals, none of them public API (``_start_asgi_task``,
``_unset_keepalive_if_required``, ``data_received`` replaced whole, ``pipeline``, the cycles'
and flow control's state): pyproject.toml bounds uvicorn below its next minor release, and
``tests/unit/hosting/test_uvicorn_hooks.py`` names any of them an upgrade removes or reshapes
(and fails on a use of a uvicorn name here that it does not list).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, MutableSequence
from typing import Any

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.budget import hold
from service.hosting.coalesced_writes import CoalescedWrites

logger = logging.getLogger("lmhead")
HEAD_LATE = "the request head did not arrive in time (LMHEAD_HEADER_TIMEOUT_S)"
BODY_STALLED = "the request body stalled (LMHEAD_BODY_TIMEOUT_S)"
#: A body must bring at least this much per ``body_timeout_s`` (mod_reqtimeout's idea: a rate).
MIN_BODY_BYTES = 1024
UPGRADE_WITH_BODY = "no protocol upgrades here; send the request without Upgrade"
#: An answer must leave at this rate per ``body_timeout_s`` (1 MiB per 30 s: ~35 KB/s), or
#: what remains of it: a reader that trickles would hold its request's budget for hours.
MIN_SEND_BYTES = 2**20


class SharedConnections:
    """The open connections of every front, so ``max_connections`` caps their sum, as it caps
    one process's connections: one counter per front in shared memory, each written by its
    own front only (no lock that a front dying at the wrong moment could leave held). A front
    publishes its new count before it adds up the others', so two connections arriving at
    once on two fronts near the cap may both be refused, and never both let past it."""

    def __init__(self, counts: MutableSequence[int], index: int) -> None:
        self._counts = counts
        self._index = index

    def publish(self, mine: int) -> int:
        """Set this front's count; the count of every front."""
        self._counts[self._index] = mine
        return sum(self._counts)


class LimitedHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol with header-size, read-timeout and connection limits."""

    max_header_bytes = 32 * 1024
    header_timeout_s = 10.0
    body_timeout_s = 30.0
    max_connections = 1000
    #: Requests read ahead of their answers on one connection: uvicorn parses every request in
    #: what it reads and queues them all (one client flooding GETs held 129k, +600 MB in 10 s).
    max_pipelined = 32
    shared: SharedConnections | None = None  # the other fronts' connections count too
    refused: Callable[[str], None] | None = None  # told the code of each refusal (metrics)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes = 0
        self._in_body = False
        self._refused: tuple[int, str] | None = None
        self._pending: tuple[int, str] | None = None  # a refusal waiting for earlier answers
        self._running: Any = None  # the request cycle whose app runs (uvicorn's is the last)
        self._timer: asyncio.TimerHandle | None = None
        self._body_bytes = 0
        self._send_timer: asyncio.TimerHandle | None = None
        self._unsent = 0
        self._upgraded = False
        self._backstop: asyncio.TimerHandle | None = None
        self._on_lost: Callable[[], None] | None = None  # the running request's (hangups)
        self._lost = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(CoalescedWrites(transport, self.loop))  # type: ignore[arg-type]
        if self._open_connections() > self.max_connections:
            self._refuse(503, "too many connections (LMHEAD_MAX_CONNECTIONS); retry shortly")
            return
        self._arm(self.header_timeout_s, HEAD_LATE)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._lost = True
        told, self._on_lost = self._on_lost, None
        if told is not None:  # a request whose answer is not made yet stops (hangups)
            told()
        for timer in (self._send_timer, self._backstop):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)
        self._open_connections()

    def _open_connections(self) -> int:
        """Connections open now (this one included, until it is lost), over all fronts."""
        mine = len(self.connections)
        return mine if self.shared is None else self.shared.publish(mine)

    def data_received(self, data: bytes) -> None:
        """uvicorn's, but a parse error keeps its reason and waits for earlier answers, and an
        ``Upgrade`` (WebSocket is off, h2c unsupported) is served as HTTP/1.1 without logging
        two warnings per request."""
        if self.transport.is_closing() or self._pending is not None or self._upgraded:
            return
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # httptools stops at the head: what follows (a body, a next request) is not
            # parsed. Read nothing more, and close after this answer (no desync); a request
            # with a body is refused (it would be served without it).
            self._upgraded = True
            if self._refused is not None:
                self._refuse(*self._refused)
            elif self.cycle is not None:
                self.cycle.keep_alive = False
            return
        except httptools.HttpParserError as error:  # a refusal decided on a header comes first
            self._refuse(*(self._refused or (400, f"malformed HTTP request: {str(error)[:100]}")))
            return
        if self._refused is not None and not self.transport.is_closing():
            self._refuse(*self._refused)

    @property
    def _stopped(self) -> bool:
        """A refusal is decided: requests parsed after it (same read) are not served."""
        return self._refused is not None or self._pending is not None

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:  # uvicorn >= 0.45 calls it
        self._running = cycle
        if cycle.waiting_for_100_continue:
            cycle.send = _closing_unasked(cycle, cycle.send)
        super()._start_asgi_task(cycle, app)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes, self._in_body = 0, False
        self._arm(self.header_timeout_s, HEAD_LATE)

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        if self._refused is not None:
            return
        if name.lower() == b"transfer-encoding" and value.strip().lower() != b"chunked":
            self._refused = (501, "only the chunked transfer coding is supported")
            return
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._refused is None and self.parser.get_http_version() == "1.1":
            hosts = sum(name == b"host" for name, _ in self.headers)
            if hosts != 1:
                self._refused = (400, f"an HTTP/1.1 request needs one Host header, got {hosts}")
        if self._refused is None and self.parser.should_upgrade() and _has_body(self.headers):
            self._refused = (400, UPGRADE_WITH_BODY)
        if self._stopped:
            return
        super().on_headers_complete()
        self.scope["lmhead.sent"] = self._sent  # type: ignore[typeddict-unknown-key]
        self.scope["lmhead.on_lost"] = self._tell_lost  # type: ignore[typeddict-unknown-key]
        if len(self.pipeline) > self.max_pipelined:
            self._in_body = True  # this request's cycle is dropped with it (it was left queued)
            self._refuse(503, f"more than {self.max_pipelined} pipelined requests waiting")
            return
        self._in_body = True
        self._body_bytes = 0
        self._arm_body()

    def on_body(self, body: bytes) -> None:
        if self._stopped:
            return
        super().on_body(body)
        self._body_bytes += len(body)

    def on_message_complete(self) -> None:
        if self._stopped:
            return
        self._disarm()
        self._in_body = False
        super().on_message_complete()

    def on_response_complete(self) -> None:
        answered = self._running
        if self._in_body and self.cycle is answered:  # answered without its whole body: the
            self._disarm()  # rest is absorbed, and the keep-alive timeout bounds it
        super().on_response_complete()  # arms uvicorn's keep-alive timeout for idle time
        if self._pending is not None and not self._answering():
            self._answer(*self._pending)

    def _answering(self, refused: Any = None) -> bool:
        """Whether a request read before ``refused`` still waits for (all of) its answer."""
        running = self._running
        earlier = running is not None and running is not refused
        return bool(self.pipeline) or (earlier and not running.response_complete)

    def _tell_lost(self, callback: Callable[[], None] | None) -> None:
        """``scope["lmhead.on_lost"]``: call ``callback`` once this connection is lost (at
        once if it is already), until it is replaced or forgotten (None). Reading resumes,
        as uvicorn's ``receive`` resumes it, or a close would go unseen behind a large body
        (read paused)."""
        self._on_lost = callback
        if callback is None:
            return
        if self._lost:
            self._on_lost = None
            callback()
        else:
            self.flow.resume_reading()

    async def _sent(self) -> None:
        """``scope["lmhead.sent"]``: return once the answer has left the process's buffer (or
        the client was dropped); meanwhile its bytes count in the request's reservation."""
        if self.flow.write_paused:
            hold(self.transport.get_write_buffer_size())
            await self.flow.drain()

    def _count(self, nbytes: int) -> None:
        self._head_bytes += nbytes
        if self._head_bytes > self.max_header_bytes and self._refused is None:
            self._refused = (
                431,
                f"request headers over {self.max_header_bytes} bytes (LMHEAD_MAX_HEADER_BYTES)",
            )

    def _arm_body(self) -> None:
        """Every ``body_timeout_s`` the body must have brought ``MIN_BODY_BYTES`` more: a byte
        now and then no longer keeps a connection (re-armed at each read, one byte every 20 s
        held a slot for ever, and 40 such clients every slot of a cap of 40)."""
        self._disarm()
        self._timer = self.loop.call_later(self.body_timeout_s, self._check_body)

    def _check_body(self) -> None:
        if self._body_bytes < MIN_BODY_BYTES and not self.flow.read_paused:  # (paused: ours)
            self._refuse(408, BODY_STALLED)
            return
        self._body_bytes = 0
        self._arm_body()

    def pause_writing(self) -> None:
        """The client reads its answer slower than it is written: it must read
        ``MIN_SEND_BYTES`` per ``body_timeout_s`` (or the rest), or the connection is dropped
        (an answer never read sat in memory for ever, and its request holds its budget)."""
        super().pause_writing()
        self._unsent = self.transport.get_write_buffer_size()
        self._send_timer = self.loop.call_later(self.body_timeout_s, self._check_sending)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _check_sending(self) -> None:
        unsent = self.transport.get_write_buffer_size()
        if self._unsent - unsent < min(MIN_SEND_BYTES, self._unsent):  # too slow a reader
            logger.info(
                "a client read under %d bytes of its answer in %.0f s: dropped",
                MIN_SEND_BYTES,
                self.body_timeout_s,
            )
            self.transport.abort()
            return
        self._unsent = unsent
        self._send_timer = self.loop.call_later(self.body_timeout_s, self._check_sending)

    def _arm(self, seconds: float, reason: str) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._refuse, 408, reason)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _refuse(self, status: int, reason: str) -> None:
        """Answer ``status`` with a JSON error and close, once every request read before this
        one is answered: a status line sooner is read as an earlier request's answer, which
        was lost. The refused request's own cycle, if its head was read, is dropped (its app,
        if running, sees a disconnect); nothing more is read."""
        self._disarm()
        if self.transport.is_closing() or self._pending is not None:
            return
        refused = self.cycle if self._in_body else None
        self.pipeline = type(self.pipeline)(
            (cycle, app) for cycle, app in self.pipeline if cycle is not refused
        )
        if self._answering(refused):
            self._pending = (status, reason)  # a backstop, should the answers never come:
            self._backstop = self.loop.call_later(self.body_timeout_s, self._check_pending)
            return
        self._answer(status, reason)

    def _check_pending(self) -> None:
        """The deferred refusal's backstop: answer it once nothing earlier is left, and wait
        while an earlier answer is still being made or sent (the slow-reader check bounds
        that; aborting here cut a long answer short)."""
        if self._answering():
            self._backstop = self.loop.call_later(self.body_timeout_s, self._check_pending)
        elif self._pending is not None and not self.transport.is_closing():
            self._answer(*self._pending)

    def _answer(self, status: int, reason: str) -> None:
        """A JSON error of this layer's own, and close."""
        code, phrase = _ERRORS[status]
        if self.refused is not None:
            self.refused(code)
        body = orjson.dumps({"error": {"code": code, "message": reason}})
        head = (
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % (status, phrase.encode(), len(body))
        )
        self.transport.write(head + body)
        self.transport.close()


def _closing_unasked(cycle: Any, send: Any) -> Any:
    """``send`` of a request whose client waits for ``100 Continue``: an answer started
    before the body was asked for (a 413, a 404) ends the connection, saying
    ``connection: close`` (the client never sends that body, and its next request would be
    read as it). Once ``100 Continue`` went out the body comes, and an answer given before
    its end keeps the connection like any other (the rest is absorbed)."""

    async def sending(message: Any) -> None:
        if message["type"] == "http.response.start" and cycle.waiting_for_100_continue:
            cycle.keep_alive = False
            headers = list(message.get("headers", ()))
            if not any(name.lower() == b"connection" for name, _ in headers):
                # said by uvicorn >= 0.53 for keep_alive=False; older ones only closed
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await send(message)

    return sending


def _has_body(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(
        (name == b"content-length" and value.strip() not in (b"", b"0"))
        or name == b"transfer-encoding"
        for name, value in headers
    )


_ERRORS = {
    400: ("malformed_request", "Bad Request"),
    408: ("request_timeout", "Request Timeout"),
    431: ("headers_too_large", "Request Header Fields Too Large"),
    501: ("not_implemented", "Not Implemented"),
    503: ("too_many_connections", "Service Unavailable"),
}
