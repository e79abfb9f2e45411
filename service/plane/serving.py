"""The context of one data-plane call: the versions it leases and the metrics it records."""

from __future__ import annotations

import asyncio
from time import perf_counter

from service.errors import ServiceError
from service.messages import Target
from service.metrics import Metrics
from service.repository.loaded_version import LoadedVersion
from service.repository.registry import Registry


class Serving:
    """The context of one data-plane call: leased versions in, call metrics out.

    A class rather than a generator: it runs twice per request on the hot path.
    """

    def __init__(
        self,
        registry: Registry,
        metrics: Metrics,
        verb: str,
        targets: tuple[Target, ...],
        calls: int = 1,
    ) -> None:
        self._registry, self._metrics = registry, metrics
        self._verb, self._targets = verb, targets
        #: Calls this context serves together (``DataPlane.topk_group``); each is recorded.
        self.calls = calls
        self._heads: list[LoadedVersion] = []
        self._missing: Target | None = None  # the target whose lookup failed
        self._started = perf_counter()

    def __enter__(self) -> list[LoadedVersion]:
        try:
            for target in self._targets:
                self._missing = target
                head = self._registry.get(target.model, target.version)
                head.acquire()
                self._heads.append(head)
            self._missing = None
        except BaseException as error:
            self.__exit__(type(error), error, None)
            raise
        return self._heads

    def record(self, outcome: str, calls: int = 1) -> None:
        """Record ``calls`` calls now, with this outcome (``__exit__`` records ``calls``; a
        call of a group that failed its own checks is recorded alone, and not counted there).
        A failed lookup is recorded under the model it named, if the repository has it (no
        version: the one asked may not exist), else under "" (names are the client's)."""
        model = version = ""
        if self._missing is not None:
            if self._registry.knows(self._missing.model):
                model = self._missing.model
        elif self._heads:
            model, version = self._heads[0].name, str(self._heads[0].version)
        self._metrics.observe_call(
            model, version, self._verb, outcome, perf_counter() - self._started, calls
        )

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, _: object
    ) -> None:
        for head in self._heads:
            head.release()
        outcome = "ok" if error is None else "internal_error"
        if isinstance(error, ServiceError):
            outcome = error.code
        elif isinstance(error, asyncio.CancelledError):  # the client went away first
            outcome = "cancelled"
        self.record(outcome, self.calls)
