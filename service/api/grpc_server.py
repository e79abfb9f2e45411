"""The Open Inference Protocol over gRPC (``inference.GRPCInferenceService``), in-process.

A third front end over the same data plane as ``/v1`` and ``/v2``: ModelInfer is decode
(``service.api.codec.grpc``) -> ``DataPlane.infer`` -> encode, under the same memory admission,
limits, leases and batcher. Health, metadata, and Triton's repository RPCs (index, load,
unload) follow the REST rules: the admin token comes as ``authorization: Bearer ...``
metadata, read-only and control mode refuse with PERMISSION_DENIED. Every ``ServiceError``
maps to one status code here, with its message; anything else is logged and answered
INTERNAL without detail. RPCs lmhead has no use for (shared memory, streaming, trace) answer
UNIMPLEMENTED. Started by the app's lifespan when ``LMHEAD_GRPC_PORT`` is set, stopped with a
drain of ``LMHEAD_DRAIN_TIMEOUT_S``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from service import __version__
from service.api.codec import grpc as codec
from service.api.codec import grpc_verify
from service.api.codec.v2_verify import VerifyCall
from service.api.codec.wire import off_loop
from service.budget import BODY_EXPANSION, charge
from service.errors import (
    InvalidInput,
    ModelNotReady,
    PayloadTooLarge,
    QueueFull,
    ServerBusy,
    ServiceError,
    Unauthorized,
)
from service.metrics import Metrics
from service.plane.protocol import Plane
from service.settings import Settings

logger = logging.getLogger("lmhead")
Answer = TypeVar("Answer")
EXTENSIONS = ["binary_tensor_data", "classification", "model_repository"]


def status_of(error: ServiceError) -> grpc.StatusCode:
    """The gRPC status for a service error (its HTTP status, where no class says more)."""
    if isinstance(error, PayloadTooLarge):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(error, QueueFull | ServerBusy | ModelNotReady):
        return grpc.StatusCode.UNAVAILABLE  # transient: retry with backoff
    return {
        400: grpc.StatusCode.INVALID_ARGUMENT,
        401: grpc.StatusCode.UNAUTHENTICATED,
        403: grpc.StatusCode.PERMISSION_DENIED,
        404: grpc.StatusCode.NOT_FOUND,
        406: grpc.StatusCode.INVALID_ARGUMENT,
        415: grpc.StatusCode.INVALID_ARGUMENT,
        422: grpc.StatusCode.INVALID_ARGUMENT,
    }.get(error.status, grpc.StatusCode.INTERNAL)


class InferenceService(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """The servicer: each RPC is one data-plane call between decode and encode."""

    def __init__(self, plane: Plane, metrics: Metrics) -> None:
        self._plane = plane
        self._metrics = metrics

    async def _answer(
        self, method: str, context: Any, call: Callable[[], Awaitable[Answer]]
    ) -> Answer:
        """Run one RPC: metrics, and every error mapped to a status code once."""
        started, code = time.perf_counter(), grpc.StatusCode.OK
        try:
            return await call()
        except asyncio.CancelledError:  # the client cancelled, or its deadline passed
            code = grpc.StatusCode.CANCELLED
            raise
        except ServiceError as error:
            code = status_of(error)
            await context.abort(code, error.message)  # raises: the RPC ends here
            raise
        except Exception:
            logger.exception("gRPC %s failed", method)
            code = grpc.StatusCode.INTERNAL
            await context.abort(code, "internal error (logged by the server)")
            raise
        finally:
            self._metrics.grpc_requests.labels(method, code.name).inc()
            self._metrics.grpc_duration.labels(method).observe(time.perf_counter() - started)

    # -- health and metadata ----------------------------------------------------------------

    async def ServerLive(self, request: Any, context: Any) -> Any:
        async def live() -> Any:
            return pb.ServerLiveResponse(live=True)

        return await self._answer("ServerLive", context, live)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        async def ready() -> Any:
            try:
                await self._plane.check_ready()
            except ModelNotReady:
                return pb.ServerReadyResponse(ready=False)
            return pb.ServerReadyResponse(ready=True)

        return await self._answer("ServerReady", context, ready)

    async def ModelReady(self, request: Any, context: Any) -> Any:
        async def ready() -> Any:
            try:
                await self._plane.head(codec.target(request.name, request.version))
            except ModelNotReady:
                return pb.ModelReadyResponse(ready=False)
            return pb.ModelReadyResponse(ready=True)

        return await self._answer("ModelReady", context, ready)

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        async def metadata() -> Any:
            return pb.ServerMetadataResponse(
                name="lmhead", version=__version__, extensions=EXTENSIONS
            )

        return await self._answer("ServerMetadata", context, metadata)

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        async def metadata() -> Any:
            head = await self._plane.head(codec.target(request.name, request.version))
            return codec.model_metadata(head, await self._plane.versions(head.name))

        return await self._answer("ModelMetadata", context, metadata)

    # -- inference --------------------------------------------------------------------------

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        async def infer() -> Any:
            with self._plane.admit():  # the request's memory, held until answered
                size = request.ByteSize()  # raw or typed contents alike
                charge(size * BODY_EXPANSION)
                decoded = await off_loop(size, grpc_verify.decode, request)
                if isinstance(decoded, VerifyCall):  # the input draft_token_ids: /verify
                    verified = await self._plane.verify(decoded.request)
                    return await off_loop(size, grpc_verify.encode, verified, decoded.plan)
                infer_request, plan = decoded
                result = await self._plane.infer(infer_request)
                return await off_loop(size, codec.encode, result, plan)

        return await self._answer("ModelInfer", context, infer)

    # -- repository (Triton's extension) ----------------------------------------------------

    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        async def index() -> Any:
            self._authorize(context)
            models = [
                pb.RepositoryIndexResponse.ModelIndex(
                    name=row.name, version=row.version, state=row.state, reason=row.reason
                )
                for row in await self._plane.index()
                if row.state == "READY" or not request.ready
            ]
            return pb.RepositoryIndexResponse(models=models)

        return await self._answer("RepositoryIndex", context, index)

    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        async def load() -> Any:
            self._authorize(context)
            given = codec.parameters(request.parameters)
            if set(given) - {"version"}:  # Triton's config / file: overrides: not taken
                unknown = ", ".join(sorted(given)[:8])[:200]
                raise InvalidInput(
                    f"load takes only the parameter version (a model comes from the "
                    f"repository on disk), got {unknown}"
                )
            version = given.get("version")
            if version is not None and (type(version) is not int or version < 0):  # not bool
                raise InvalidInput("parameter version must be a non-negative int64_param")
            await self._plane.load(request.model_name, version)
            return pb.RepositoryModelLoadResponse()

        return await self._answer("RepositoryModelLoad", context, load)

    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        async def unload() -> Any:
            self._authorize(context)
            await self._plane.unload(request.model_name)
            return pb.RepositoryModelUnloadResponse()

        return await self._answer("RepositoryModelUnload", context, unload)

    def _authorize(self, context: Any) -> None:
        metadata = dict(context.invocation_metadata() or ())
        scheme, _, presented = str(metadata.get("authorization", "")).partition(" ")
        try:
            self._plane.authorize(presented if scheme.lower() == "bearer" else None)
        except Unauthorized:
            raise Unauthorized(
                "the repository RPCs need metadata 'authorization: Bearer <admin token>'"
            ) from None


def _unimplemented(method: str) -> Callable[..., Awaitable[Any]]:
    async def refuse(self: InferenceService, request: Any, context: Any) -> Any:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            f"lmhead does not implement {method}; it serves health, metadata, ModelInfer and "
            "the repository RPCs",
        )

    return refuse


#: The protocol's other RPCs (statistics, config, streaming, shared memory, trace, logging)
#: answer UNIMPLEMENTED with a message, not the stub's bare NotImplementedError.
for _method in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods_by_name:
    if _method not in InferenceService.__dict__:
        setattr(InferenceService, _method, _unimplemented(_method))


@dataclass(frozen=True)
class Undecodable:
    """A request whose bytes are no message of its type (garbage, a non-UTF-8 string): the
    RPC answers INVALID_ARGUMENT (grpcio answered UNKNOWN with the parser's class name, and
    logged a traceback per call)."""

    message: str


def _handlers(servicer: InferenceService) -> grpc.GenericRpcHandler:
    """The service's RPCs as the generated stub registers them, but each unary request is
    parsed by ``_parse``, so an undecodable one reaches the servicer as ``Undecodable``."""
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    handlers = {}
    for method in service.methods:
        request, response = (
            getattr(pb, method.input_type.name),
            getattr(pb, method.output_type.name),
        )
        if method.client_streaming or method.server_streaming:  # not served: UNIMPLEMENTED
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                getattr(servicer, method.name), request.FromString, response.SerializeToString
            )
            continue
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            _decoded(servicer, method.name), _parse(request), response.SerializeToString
        )
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


def _parse(message: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return message.FromString(data)
        except DecodeError:
            return Undecodable(message.DESCRIPTOR.name)

    return parse


def _decoded(servicer: InferenceService, method: str) -> Callable[..., Awaitable[Any]]:
    serve = getattr(servicer, method)

    async def handle(request: Any, context: Any) -> Any:
        if isinstance(request, Undecodable):

            async def refuse() -> Any:
                raise InvalidInput(
                    f"the request is not a valid {request.message} (a protobuf message whose "
                    "strings are UTF-8)"
                )

            return await servicer._answer(method, context, refuse)
        return await serve(request, context)

    return handle


async def start(plane: Plane, settings: Settings, metrics: Metrics) -> grpc.aio.Server:
    """Serve gRPC on ``LMHEAD_HOST:LMHEAD_GRPC_PORT`` (messages up to the body limit)."""
    assert settings.grpc_port is not None
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", settings.max_body_bytes),
            ("grpc.max_send_message_length", -1),  # answers are bounded by the logits limit
            # A port already taken is an error, not shared; fronts of LMHEAD_WORKERS share
            # theirs (the supervisor checked it was free before any of them started).
            ("grpc.so_reuseport", int(settings.workers > 1)),
        ]
    )
    server.add_generic_rpc_handlers((_handlers(InferenceService(plane, metrics)),))
    address = f"{settings.host}:{settings.grpc_port}"
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen for gRPC on {address}")
    await server.start()
    logger.info("gRPC (Open Inference Protocol) on %s:%d", settings.host, port)
    return server
