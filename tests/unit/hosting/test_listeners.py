"""The ports, taken before models load (``service.hosting.listeners``), and answers written whole
(``service.hosting.coalesced_writes``), on real sockets."""

from __future__ import annotations

import asyncio
import socket

import pytest

from service.hosting.coalesced_writes import COALESCE_BYTES, CoalescedWrites
from service.hosting.listeners import check_free, describe, listening_sockets, reserve


def _listening(sock: socket.socket) -> bool:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1


def test_sockets_listen_on_every_address_and_say_where() -> None:
    (one,) = listening_sockets("127.0.0.1", 0)
    with one:
        assert _listening(one)
        assert describe([one]) == f"http://127.0.0.1:{one.getsockname()[1]}"
    every = listening_sockets("", 0)  # every interface, as asyncio's create_server reads ""
    try:
        assert "0.0.0.0" in {sock.getsockname()[0] for sock in every}
        assert all(_listening(sock) for sock in every)
    finally:
        for sock in every:
            sock.close()


def test_a_port_held_or_a_host_unknown_is_refused_at_once() -> None:
    """A second service on a port fails: the first already listens (two sockets with
    SO_REUSEADDR may both bind one port while neither listens, so binding proves nothing)."""
    (first,) = listening_sockets("127.0.0.1", 0)
    port = first.getsockname()[1]
    with first, pytest.raises(SystemExit, match=f"cannot serve on 127.0.0.1:{port}"):
        listening_sockets("127.0.0.1", port)
    with pytest.raises(SystemExit, match="cannot serve on no-such-host.invalid:80"):
        listening_sockets("no-such-host.invalid", 80)


def test_ipv6_sockets_are_v6_only() -> None:
    """As asyncio makes them (``::`` used to listen on IPv6 alone, and still does)."""
    try:
        (six,) = listening_sockets("::1", 0)
    except SystemExit:
        pytest.skip("no IPv6 loopback here")
    with six:
        assert six.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1
        assert describe([six]).startswith("http://[::1]:")


def test_writes_of_one_turn_leave_together_in_order_and_close_flushes() -> None:
    """Small writes wait for the end of the turn and leave in order; a write past
    ``COALESCE_BYTES`` leaves at once with what was pending; close sends what is pending,
    abort drops it, and a write after close goes nowhere (no error)."""

    async def scenario() -> None:
        writes, theirs = await _coalesced()
        writes.write(b"head ")
        writes.write(b"body")
        assert _pending(theirs) == b""  # still this turn
        await asyncio.sleep(0)  # one turn
        assert theirs.recv(100) == b"head body"
        writes.write(b"<")
        writes.write(b"x" * COALESCE_BYTES)
        assert len(_read(theirs, COALESCE_BYTES + 1)) == COALESCE_BYTES + 1  # this turn
        writes.write(b"last")
        writes.close()
        writes.write(b"after")
        assert await asyncio.to_thread(_read, theirs, 100) == b"last"  # then the end
        theirs.close()

    asyncio.run(scenario())


def test_abort_drops_what_is_pending() -> None:
    async def scenario() -> None:
        writes, theirs = await _coalesced()
        writes.write(b"never")
        writes.abort()
        assert await asyncio.to_thread(_read, theirs, 100) == b""
        theirs.close()

    asyncio.run(scenario())


async def _coalesced() -> tuple[CoalescedWrites, socket.socket]:
    """A real transport on one end of a socket pair, wrapped; the other end to read."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    theirs.settimeout(10)
    transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, ours)
    return CoalescedWrites(transport, loop), theirs


def _pending(sock: socket.socket) -> bytes:
    """What has arrived so far, without waiting."""
    timeout = sock.gettimeout()
    sock.settimeout(0)
    try:
        return sock.recv(1 << 20)
    except BlockingIOError:
        return b""
    finally:
        sock.settimeout(timeout)


def _read(sock: socket.socket, limit: int) -> bytes:
    """Up to ``limit`` bytes, until the peer closes (``b""``: closed with nothing sent)."""
    data = b""
    while len(data) < limit:
        chunk = sock.recv(limit - len(data))
        if not chunk:
            break
        data += chunk
    return data


def test_a_held_port_takes_only_this_services_fronts() -> None:
    """``reserve`` (the supervisor's hold, from its check until it exits): another service's
    check and a plain socket are refused, no connection is accepted by the hold itself, and
    the fronts (``SO_REUSEPORT``) listen beside it. Checking and letting go, two services
    started a second apart shared one port."""
    (held,) = reserve("127.0.0.1", 0)
    port = held.getsockname()[1]
    with held:
        with pytest.raises(SystemExit, match="in use"):
            check_free("127.0.0.1", port)
        with socket.socket() as plain, pytest.raises(OSError, match="in use"):
            plain.bind(("127.0.0.1", port))
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        fronts = [listening_sockets("127.0.0.1", port, reuse_port=True)[0] for _ in range(2)]
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                assert any(_listening(front) for front in fronts)
        finally:
            for front in fronts:
                front.close()
