"""The floor of a Python HTTP server here: a raw ASGI app that reads the request's body and
answers a fixed one, for ``bench.latency`` to run under the same uvicorn, uvloop and httptools
as lmhead (``python -m uvicorn bench.floor:app --loop uvloop --http httptools``)."""

from __future__ import annotations

from typing import Any

BODY = b'{"model":"floor","k":10,"token_ids":[1,2,3,4,5,6,7,8,9,10]}'
HEAD = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(BODY))],
}


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":  # lifespan: nothing to start
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await send({"type": "lifespan.shutdown.complete"})
        return
    more = True
    while more:  # the whole body, as any server must
        message = await receive()
        more = message.get("more_body", False)
    await send(HEAD)
    await send({"type": "http.response.body", "body": BODY})
