"""The data plane: the inference and control rules every front end shares.

``protocol`` declares the verbs a front end may call (the ``Plane`` protocol), once;
``dataplane`` implements them over the registry: lookup and lease (``serving``), request
options checked once before any math (``options``), the shaped distribution (``distribution``),
scoring (``scoring``), two heads compared (``comparison``), shadow traffic (``shadow``),
calls served as one (``grouping``) and the control API (``control``).

May import: ``service.repository``, ``service.runtime``, ``service.heads`` and the shared
basics at the package root. Nothing HTTP, gRPC or process-related (``make layers`` checks
the order).
"""
