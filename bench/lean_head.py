"""The leanest head server this stack allows, for ``bench.latency`` to run beside lmhead and
the floor: a raw ASGI app that parses a JSON top-k request, runs the head's onnxruntime
session on one thread, and answers in JSON. No check of anything, no batching, no metrics,
no limits, no lease against a swap: what a Python head server cannot do without, so its
CPU per request is the least one could cost here (``python -m uvicorn
bench.lean_head:app --loop uvloop --http httptools``, the head's file in
``LMHEAD_LEAN_MODEL``)."""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from service.runtime.session import HeadSession


@cache
def _session() -> HeadSession:
    return HeadSession(Path(os.environ["LMHEAD_LEAN_MODEL"]), tied=True, intra_op_threads=1)


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":  # lifespan: open the session before the first request
        message = await receive()
        if message["type"] == "lifespan.startup":
            _session()
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await send({"type": "lifespan.shutdown.complete"})
        return
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    if not body:  # a readiness probe
        answer = b"{}"
    else:
        asked = orjson.loads(body)
        hidden = np.asarray(asked["hidden_states"], np.float32)
        projection = _session().project(hidden, asked.get("k", 10))
        answer = orjson.dumps(
            {
                "token_ids": projection.topk_token_ids,
                "logits": projection.topk_logits,
                "logsumexp": projection.logsumexp,
            },
            option=orjson.OPT_SERIALIZE_NUMPY,
        )
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(answer))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": answer})
