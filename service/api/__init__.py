"""Front ends: decode a request, call the data plane once, encode its answer.

HTTP routes (``routes``: native ``/v1``, the V2 protocol, the repository API, health), the
wire formats they share (``codec``), the native wire's pydantic schemas (``schemas``) and V2
over gRPC (``grpc_server``). Front ends depend on the ``Plane`` protocol only
(``service.plane.protocol``), so a request enters the same data plane whichever process holds
it. No numpy math and no onnxruntime here.

May import: ``service.plane`` and the shared basics at the package root (and, for types,
what the plane's messages carry). Never ``service.tools``, ``service.hosting`` or
``service.cli`` (``make layers`` checks the order).
"""
