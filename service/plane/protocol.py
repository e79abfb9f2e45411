"""What a front end may call: the ``Plane`` protocol, met by the in-process ``DataPlane`` and by
``service.hosting.split.remote_plane.RemotePlane`` (the same calls, answered by the engine process).

Front ends (REST routes, gRPC) depend on this protocol only, so a request enters the same
data plane whichever process holds it.
"""

from __future__ import annotations

import secrets
from contextlib import AbstractContextManager
from typing import Any, Protocol

from service.errors import Unauthorized
from service.limits import Reservation
from service.messages import (
    CompareRequest,
    CompareResult,
    EmbedRequest,
    EmbedResult,
    HeadInfo,
    InferRequest,
    InferResult,
    LogitsRequest,
    LogitsResult,
    ScoreRequest,
    ScoreResult,
    Target,
    TopKRequest,
    TopKResult,
)


class Plane(Protocol):
    """Inference, metadata and control for every front end (see ``service.plane.dataplane``)."""

    def admit(self) -> AbstractContextManager[Reservation]: ...

    def authorize(self, presented: str | None) -> None: ...

    async def check_ready(self) -> None: ...

    async def models(self) -> list[dict[str, Any]]: ...

    async def model(self, name: str) -> dict[str, Any]: ...

    async def head(self, target: Target) -> HeadInfo: ...

    async def versions(self, name: str) -> list[int]: ...

    async def index(self) -> list[dict[str, Any]]: ...

    async def topk(self, request: TopKRequest) -> TopKResult: ...

    async def logits(self, request: LogitsRequest) -> LogitsResult: ...

    async def embed(self, request: EmbedRequest) -> EmbedResult: ...

    async def infer(self, request: InferRequest) -> InferResult: ...

    async def score(self, request: ScoreRequest) -> ScoreResult: ...

    async def compare(self, request: CompareRequest) -> CompareResult: ...

    async def load(self, name: str, version: int | None = None) -> dict[str, Any]: ...

    async def unload(self, name: str) -> dict[str, Any]: ...


#: The calls a front may forward to the engine process (the protocol's async methods).
REMOTE_CALLS = frozenset(
    {
        "check_ready",
        "models",
        "model",
        "head",
        "versions",
        "index",
        "topk",
        "logits",
        "embed",
        "infer",
        "score",
        "compare",
        "load",
        "unload",
    }
)


def check_token(expected: str | None, presented: str | None) -> None:
    """The control API's rule, shared by both planes: the admin token, compared in constant
    time, when one is set."""
    if expected is None:
        return
    if presented is None or not secrets.compare_digest(presented.encode(), expected.encode()):
        raise Unauthorized("the repository API needs 'Authorization: Bearer <admin token>'")
