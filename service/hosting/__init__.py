"""Hosting: composes a running service out of the layers below it.

The app factory (``app``), the engine that owns the registry, batchers and data plane
(``engine``), uvicorn with its connection limits (``server``, ``connection``, ``listeners``),
the split mode's processes (``split``: engine process, fronts, supervisor) and Ray Serve
(``rayserve``). Nothing here computes or judges a request: it starts, wires and stops things.

May import: ``service.api``, ``service.tools``, ``service.plane``, ``service.repository``,
``service.runtime``, ``service.heads`` and the shared basics at the package root. Only
``service.cli`` imports it (``make layers`` checks the order).
"""
