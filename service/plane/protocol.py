"""What a front end may call: the ``Plane`` protocol, declared here once.

Front ends (REST routes, gRPC) depend on this protocol only, so a request enters the same
data plane whichever process holds it. Two planes meet it: ``service.plane.dataplane``'s
``DataPlane``, which answers every verb in this process, and the split mode's
``RemotePlane`` (``service.hosting.split.remote_plane``), which forwards them to the engine
process. Neither lists the verbs again: the verbs are the protocol's ``async`` methods
(``VERBS``), the split mode's call table and the remote plane's methods are made from them, and
whether a verb runs inference (counted in flight) is which protocol declares it.
"""

from __future__ import annotations

import inspect
import secrets
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

from service.budget import Reservation
from service.errors import Unauthorized
from service.messages import (
    CompareRequest,
    CompareResult,
    EmbedRequest,
    EmbedResult,
    HeadInfo,
    IndexEntry,
    InferRequest,
    InferResult,
    LensRequest,
    LensResult,
    LogitsRequest,
    LogitsResult,
    ModelStatus,
    ScoreRequest,
    ScoreResult,
    Target,
    TopKRequest,
    TopKResult,
)
from service.verify_messages import VerifyRequest, VerifyResult


class InferencePlane(Protocol):
    """The inference verbs: each runs a head (counted in ``lmhead_requests_in_flight``)."""

    async def topk(self, request: TopKRequest) -> TopKResult: ...

    async def logits(self, request: LogitsRequest) -> LogitsResult: ...

    async def embed(self, request: EmbedRequest) -> EmbedResult: ...

    async def infer(self, request: InferRequest) -> InferResult: ...

    async def score(self, request: ScoreRequest) -> ScoreResult: ...

    async def compare(self, request: CompareRequest) -> CompareResult: ...

    async def lens(self, request: LensRequest) -> LensResult: ...

    async def verify(self, request: VerifyRequest) -> VerifyResult: ...


class ControlPlane(Protocol):
    """Readiness, metadata and the control API's verbs (no head runs)."""

    async def check_ready(self) -> None: ...

    async def models(self) -> list[ModelStatus]: ...

    async def model(self, name: str) -> ModelStatus: ...

    async def head(self, target: Target) -> HeadInfo: ...

    async def versions(self, name: str) -> list[int]: ...

    async def index(self) -> list[IndexEntry]: ...

    async def load(self, name: str, version: int | None = None) -> ModelStatus: ...

    async def unload(self, name: str) -> ModelStatus: ...


class Plane(InferencePlane, ControlPlane, Protocol):
    """Inference, metadata and control for every front end (see ``service.plane.dataplane``).

    ``admit`` and ``authorize`` are answered where the request is (they hold its memory and
    check its token); every ``async`` verb may be answered in another process."""

    def admit(self) -> AbstractContextManager[Reservation]: ...

    def authorize(self, presented: str | None) -> None: ...


def _verbs(protocol: type) -> frozenset[str]:
    return frozenset(
        name
        for name, member in vars(protocol).items()
        if not name.startswith("_") and inspect.iscoroutinefunction(member)
    )


#: Verbs that run a head, and the others: read from the protocols above, never listed.
INFERENCE_VERBS = _verbs(InferencePlane)
CONTROL_VERBS = _verbs(ControlPlane)
#: Every verb a front may forward to the engine process (and the only calls it answers).
VERBS = INFERENCE_VERBS | CONTROL_VERBS

Forwarder = TypeVar("Forwarder", bound=type)


def forwarding(cls: Forwarder) -> Forwarder:
    """Give ``cls`` every verb it does not define itself, as a call of its ``forward(verb,
    arguments, keywords)``: a plane that answers elsewhere (the split mode's ``RemotePlane``)
    is made from the protocol, so a new verb needs no second list. Declare the class a
    ``Plane`` subclass so type checkers take the protocol's signatures for the verbs."""
    for verb in sorted(VERBS - set(vars(cls))):
        setattr(cls, verb, _forwarder(verb))
    return cls


def _forwarder(verb: str) -> Callable[..., Awaitable[Any]]:
    """``verb`` taking what the protocol declares, positionally or by keyword, as a plane in
    this process does (it took positions only: a keyword call raised ``TypeError`` in split
    mode alone). The call is bound to the declared signature here, so a wrong argument is the
    caller's ``TypeError``, not a failure in the other process; what goes is in the declared
    order, by position where it can be (the engine groups calls by their arguments), the rest
    by name. Defaults are left to the plane that answers."""
    declared = inspect.signature(getattr(Plane, verb))

    async def forwarded(self: Any, *arguments: Any, **keywords: Any) -> Any:
        bound = declared.bind(self, *arguments, **keywords)
        return await self.forward(verb, bound.args[1:], bound.kwargs)

    forwarded.__name__ = forwarded.__qualname__ = verb
    forwarded.__doc__ = f"``{verb}``, answered where ``forward`` sends it."
    forwarded.__signature__ = declared  # type: ignore[attr-defined]
    return forwarded


def check_token(expected: str | None, presented: str | None) -> None:
    """The control API's rule, shared by both planes: the admin token, compared in constant
    time, when one is set."""
    if expected is None:
        return
    if presented is None or not secrets.compare_digest(presented.encode(), expected.encode()):
        raise Unauthorized("the repository API needs 'Authorization: Bearer <admin token>'")
