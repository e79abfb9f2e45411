"""Prometheus collectors, one registry per app (so tests can build apps side by side).

Names follow Triton's split where it helps operators: request counts by status, queue time
vs compute time, and the batch-size histogram (mean batch = rows / batches).

With several processes (``LMHEAD_WORKERS`` > 1) every process writes its samples to files in
``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's multiprocess mode, set by the supervisor
before any process starts) and ``/metrics`` on any front sums them: the engine's inference,
batch and model metrics and every front's HTTP and gRPC metrics. Per-process collectors
(``process_*``) are left out there, as prometheus_client does in that mode.
"""

from __future__ import annotations

import contextlib

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
    multiprocess,
)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


class Metrics:
    """All collectors of one service instance."""

    def __init__(self, *, multiprocess: bool = False) -> None:
        self.multiprocess = multiprocess
        self.registry = CollectorRegistry()
        if not multiprocess:
            ProcessCollector(registry=self.registry)  # process_resident_memory_bytes and friends
        model_version = ["model", "version"]
        self.requests = Counter(
            "lmhead_requests",
            "Data-plane calls (any front end) by model, version, verb and outcome "
            "(ok or the error code); model is empty when the name is unknown, version when "
            "the lookup failed.",
            ["model", "version", "verb", "outcome"],
            registry=self.registry,
        )
        self.request_duration = Histogram(
            "lmhead_request_duration_seconds",
            "Wall time of data-plane calls, lookup to result (decode and encode excluded).",
            ["model", "verb"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.http_requests = Counter(
            "lmhead_http_requests",
            "HTTP requests by route template and status code.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.http_refused = Counter(
            "lmhead_http_refused",
            "Requests (or new connections) the HTTP layer answered itself and closed before "
            "the app saw them, by error code: slow or oversized heads, the connection cap, "
            "unparsable HTTP (not in lmhead_http_requests_total).",
            ["code"],
            registry=self.registry,
        )
        self.http_duration = Histogram(
            "lmhead_http_request_duration_seconds",
            "Wall time of HTTP requests, first byte in to last byte out.",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.requests_in_flight = Gauge(
            "lmhead_requests_in_flight",
            "Inference requests admitted and not yet answered (REST and gRPC).",
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.grpc_requests = Counter(
            "lmhead_grpc_requests",
            "gRPC calls by method and status code.",
            ["method", "code"],
            registry=self.registry,
        )
        self.grpc_duration = Histogram(
            "lmhead_grpc_request_duration_seconds",
            "Wall time of gRPC calls, request decoded to answer built.",
            ["method"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue_duration = Histogram(
            "lmhead_queue_duration_seconds",
            "Time a batcher entry (see lmhead_batch_requests) waited in its model's queue.",
            model_version,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inference_duration = Histogram(
            "lmhead_inference_duration_seconds",
            "Time of one onnxruntime run: a batch, or a score, embedding or candidate run "
            "(those run alone, as a batch of one).",
            model_version,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.batch_rows = Histogram(
            "lmhead_batch_rows",
            "Rows per onnxruntime run: above 1 means requests were merged.",
            model_version,
            buckets=ROW_BUCKETS,
            registry=self.registry,
        )
        self.batch_requests = Histogram(
            "lmhead_batch_requests",
            "Batcher entries merged into one onnxruntime run: a request, calls a front sent "
            "together (served as one), or one run's rows of a request larger than a run.",
            model_version,
            buckets=ROW_BUCKETS,
            registry=self.registry,
        )
        self.inference_failures = Counter(
            "lmhead_inference_failures",
            "onnxruntime runs that raised; each caller in the batch got a 500.",
            model_version,
            registry=self.registry,
        )
        self.queue_full = Counter(
            "lmhead_queue_full",
            "Requests refused with 503 because the model's queue was full.",
            model_version,
            registry=self.registry,
        )
        self._per_version = (
            self.queue_duration,
            self.inference_duration,
            self.batch_rows,
            self.batch_requests,
            self.inference_failures,
            self.queue_full,
        )
        self.models_loaded = Gauge(
            "lmhead_model_loaded",
            "1 for each loaded model version.",
            ["model", "version", "tied"],
            registry=self.registry,
            multiprocess_mode="livemax",
        )
        self.load_failures = Counter(
            "lmhead_model_load_failures",
            "Model versions that failed to load.",
            ["model"],
            registry=self.registry,
        )
        self.loads = Counter(
            "lmhead_model_loads",
            "Load or reload calls by outcome (published, kept_previous, failed; changed_in_place "
            "per version whose files changed under the same number).",
            ["model", "outcome"],
            registry=self.registry,
        )
        self.unloads = Counter(
            "lmhead_model_unloads",
            "Model versions released (replaced or unloaded).",
            ["model"],
            registry=self.registry,
        )
        self.swap_duration = Histogram(
            "lmhead_model_swap_seconds",
            "Load call to publication: read, inspect, open, warm, then one atomic swap.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        pair = ["primary", "shadow"]
        self.shadow_requests = Counter(
            "lmhead_shadow_requests",
            "Sampled requests replayed on a shadow model, by outcome (ran, failed; dropped when "
            "the queue was full, too_large when their logits would pass the byte limit).",
            [*pair, "outcome"],
            registry=self.registry,
        )
        self.shadow_rows = Counter(
            "lmhead_shadow_top1_rows",
            "Shadowed rows by whether primary and shadow agree on the top-1 token.",
            [*pair, "agree"],
            registry=self.registry,
        )
        self.shadow_topk_overlap = Histogram(
            "lmhead_shadow_topk_overlap",
            "Per-row top-k overlap (Jaccard) between primary and shadow.",
            pair,
            buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0),
            registry=self.registry,
        )
        self.shadow_kl = Histogram(
            "lmhead_shadow_kl",
            "Per-row KL(primary || shadow) over the full softmax, in nats.",
            pair,
            buckets=(1e-6, 1e-4, 1e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0),
            registry=self.registry,
        )
        self.drafted_tokens = Counter(
            "lmhead_verify_drafted_tokens",
            "Drafted tokens /verify checked, by model (a tree's nodes all count).",
            ["model"],
            registry=self.registry,
        )
        self.accepted_tokens = Counter(
            "lmhead_verify_accepted_tokens",
            "Drafted tokens /verify accepted, by model (the emitted token not counted).",
            ["model"],
            registry=self.registry,
        )
        self.repository_scans = Counter(
            "lmhead_repository_scans",
            "Repository scans done by the poller.",
            registry=self.registry,
        )

        # Label children cached per label set: ``labels()`` costs more than the update itself.
        self._calls: dict[tuple[str, str, str, str], tuple[Counter, Histogram]] = {}
        self._http: dict[tuple[str, int], tuple[Counter, Histogram]] = {}

    def observe_call(
        self, model: str, version: str, verb: str, outcome: str, seconds: float, calls: int = 1
    ) -> None:
        """Count and time data-plane calls that took ``seconds`` together (hot path)."""
        if calls <= 0:
            return
        key = (model, version, verb, outcome)
        children = self._calls.get(key)
        if children is None:
            children = (
                self.requests.labels(model, version, verb, outcome),
                self.request_duration.labels(model, verb),
            )
            self._calls[key] = children
        children[0].inc(calls)
        for _ in range(calls):
            children[1].observe(seconds)

    def observe_http(self, endpoint: str, status: int, seconds: float) -> None:
        """Count and time one HTTP request by route template (hot path)."""
        key = (endpoint, status)
        children = self._http.get(key)
        if children is None:
            children = (
                self.http_requests.labels(endpoint, str(status)),
                self.http_duration.labels(endpoint),
            )
            self._http[key] = children
        children[0].inc()
        children[1].observe(seconds)

    def refused(self, code: str) -> None:
        """The HTTP layer refused a request or a connection itself
        (``service.hosting.connection``)."""
        self.http_refused.labels(code).inc()

    def model_released(self, model: str, version: str, tied: str, runs: bool = True) -> None:
        """A version left memory: its ``lmhead_model_loaded`` series and (``runs``: unless
        the same number serves on, loaded again) its run metrics go; in multiprocess mode,
        whose files keep every series written, the gauge reads 0."""
        if self.multiprocess:
            self.models_loaded.labels(model, version, tied).set(0)
            return
        self.models_loaded.remove(model, version, tied)
        if not runs:
            return
        for per_version in self._per_version:  # else each version published stays listed
            with contextlib.suppress(KeyError):
                per_version.remove(model, version)
        for key in [key for key in self._calls if key[:2] == (model, version)]:
            self.requests.remove(*key)  # its calls, one series per verb and outcome (the
            del self._calls[key]  # cache holds every one; kept, a reload counted unseen)

    def render(self) -> bytes:
        if not self.multiprocess:
            return generate_latest(self.registry)
        summed = CollectorRegistry()
        multiprocess.MultiProcessCollector(summed)  # type: ignore[no-untyped-call]
        return generate_latest(summed)
