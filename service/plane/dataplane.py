"""The data plane: the one API under every front end (native REST, V2 over REST and gRPC).

Front ends decode a request into a typed message (``service.messages``), call one method here
and encode the result. This module alone owns the inference rules:

* model and version lookup paired with the lease, with no ``await`` between (``_serving``), so
  a concurrent swap never releases a version a request was given;
* every limit: rows, k, temperature range, and the bytes of every (rows x vocab) tensor a
  request materialises (``/logits``, score, compare and shadow alike), via ``Limits``;
* shadow sampling, and the replay of sampled rows on the shadow head;
* per-call metrics by model, version, verb and outcome;
* readiness, metadata and the control API's rules: who may load and unload, and when
  (``service.plane.control``, inherited);
* top-k (and V2 infer) calls that differ only in their rows served as one (``topk_group``).

Nothing here knows HTTP: errors are ``ServiceError`` subclasses that each front end maps once.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt

from service.allocator import IdleRelease, release_free_memory
from service.budget import MemoryBudget, Reservation
from service.errors import LogitsOverflow, ServiceError
from service.limits import Limits
from service.messages import (
    CandidateScores,
    CompareRequest,
    CompareResult,
    EmbedRequest,
    EmbedResult,
    InferRequest,
    InferResult,
    LensRequest,
    LensResult,
    LogitsRequest,
    LogitsResult,
    ScoreRequest,
    ScoreResult,
    Target,
    TopKRequest,
    TopKResult,
)
from service.metrics import Metrics
from service.plane import (
    comparing,
    costs,
    decoding,
    distribution,
    grouping,
    lens_options,
    options,
    scoring,
    verify,
    verify_checks,
)
from service.plane.control import ControlAPI
from service.plane.lens import final_states, read_lens
from service.plane.serving import Serving
from service.plane.shadow import ShadowTraffic
from service.repository.loaded_version import LoadedVersion
from service.repository.registry import Registry
from service.runtime.session import Projection
from service.runtime.vocabulary import refuse_overflow
from service.settings import Settings
from service.verify_messages import VerifyRequest, VerifyResult

SHADOW_CLOSE_S = 2.0


class DataPlane(ControlAPI):
    """Inference and control for every front end; see the module docstring."""

    def __init__(self, registry: Registry, settings: Settings, metrics: Metrics) -> None:
        super().__init__(registry, settings)
        self._limits = Limits.from_settings(settings)
        self._metrics = metrics
        # Statistics of compare and shadow run here, never on the inference threads; so does
        # handing freed memory back once the service is idle after big requests.
        self._stats = ThreadPoolExecutor(1, thread_name_prefix="lmhead-stats")
        self._budget = MemoryBudget(self._limits.max_inflight_bytes)
        idle = IdleRelease(self._stats, lambda: self._budget.used == 0, self._release_memory)
        self._budget.on_idle = idle.soon
        self._shadow = ShadowTraffic(
            metrics, settings.shadow_max_pending, self._shadow_logits, self._stats
        )

    def _release_memory(self) -> None:
        """Idle after big requests (``allocator.IdleRelease``): what the loaded sessions'
        arenas and the allocator hold unused goes back to the OS."""
        for record in self._registry.records():
            for version in list(record.versions.values()):
                version.session.release_arena()
        release_free_memory()

    async def close(self) -> None:
        await self._shadow.close(SHADOW_CLOSE_S)
        self._stats.shutdown(wait=False, cancel_futures=True)

    async def shadow_settled(self) -> None:
        """Return once the shadow replays started so far have finished (their metrics are in)."""
        await self._shadow.settle()

    @contextmanager
    def admit(self, calls: int = 1) -> Iterator[Reservation]:
        """Front ends: hold a request's memory (body, logits, answer) until answered (or that
        of ``calls`` requests served together, counted in flight each)."""
        in_flight = self._metrics.requests_in_flight
        in_flight.inc(calls)
        try:
            with self._budget.request() as held:
                yield held
        finally:
            in_flight.dec(calls)

    def reserve(self) -> AbstractContextManager[Reservation]:
        """The engine process, per forwarded metadata or control call: the memory it holds
        (inference calls are ``admit``ted: counted in flight; the front holds the body)."""
        return self._budget.request()

    # -- inference --------------------------------------------------------------------------

    async def topk(self, request: TopKRequest) -> TopKResult:
        with self._serving("topk", request.target) as (model,):
            checked = options.topk(request, model, self._limits)
            residual = lens_options.residual(request.states, model)
            self._admit(
                costs.topk(
                    model,
                    checked,
                    logprobs=request.logprobs,
                    tokens=request.tokens,
                    residual=residual,
                ),
                "topk",
            )
            checked = await self._final(model, checked, residual)
            if checked.shape is not None:
                shaped = await decoding.shaped_topk(model, checked, checked.shape, request.tokens)
                return shaped if request.logprobs else replace(shaped, logprobs=None)
            projection = await self._project(model, checked, full_logits=False)
            return self._topk_result(model, projection, request.logprobs, request.tokens)

    async def topk_group(
        self,
        requests: Sequence[TopKRequest],
        verb: str = "topk",
        alone: Callable[[int], Awaitable[Any]] | None = None,
    ) -> list[Any]:
        """``topk`` for calls that differ only in their rows, as one (``service.plane.grouping``):
        one lookup and lease, one projection of every row that passes its checks; each call
        keeps its own answer or error and metrics. The rules are ``topk``'s, in its order
        (rows, k, temperature). ``verb`` and ``alone`` (call ``i`` by itself): for V2 infer."""
        first = requests[0]
        answers: list[TopKResult | ServiceError | None] = [None] * len(requests)
        serving = Serving(self._registry, self._metrics, verb, (first.target,), len(requests))
        try:
            with serving as (model,):
                kept, failed = options.group_rows(requests, model, self._limits)
                k, temperature = options.group_options(first, model, self._limits)
                residual = lens_options.residual(first.states, model)
                each_alone = len(kept) > 1 and grouping.rows(kept) > model.group_room()
                if not each_alone:  # alone, each call is admitted by ``topk``
                    kept, refused = costs.admit_each(model, kept, k, first, residual, self._limits)
                    kept = [(i, await final_states(model, rows, residual)) for i, rows in kept]
                    failed += refused
                for index, error in failed:
                    answers[index] = error
                    serving.record(error.code)
                serving.calls = len(kept)
                outcomes: list[Any] = []
                if kept and not each_alone:
                    try:
                        outcomes = await self._grouped(model, kept, k, temperature, first)
                    except LogitsOverflow:  # one call's rows: alone, only that call fails
                        if len(kept) == 1:
                            raise
                        each_alone = True
                if each_alone:
                    serving.calls = 0  # each call is queued (or refused) and batched alone
                    by_itself = alone or (lambda index: self.topk(requests[index]))
                    outcomes = await grouping.one_by_one([by_itself(i) for i, _ in kept])
                for (index, _), outcome in zip(kept, outcomes, strict=True):
                    answers[index] = outcome
        except ServiceError as error:
            return [error if answer is None else answer for answer in answers]
        except Exception as error:  # a bug: the calls not yet answered fail, and only they
            failure = grouping.internal(error)
            return [failure if answer is None else answer for answer in answers]
        return [answer for answer in answers if answer is not None]

    async def infer_group(self, requests: Sequence[InferRequest]) -> list[Any]:
        """V2 ``infer`` calls that ask only the top-k of their rows, served as one."""
        calls = [grouping.as_topk(request) for request in requests]
        outcomes = await self.topk_group(calls, "infer", lambda i: self.infer(requests[i]))
        return [InferResult(o.head, o) if isinstance(o, TopKResult) else o for o in outcomes]

    async def _grouped(
        self,
        model: LoadedVersion,
        kept: list[grouping.Kept],
        k: int,
        temperature: float,
        options: TopKRequest,
    ) -> list[TopKResult | ServiceError]:
        """One projection of the calls' rows together, split back into one result per call.
        Shadow traffic samples each call, as ``_project`` does one call alone."""
        shapes = [hidden.shape[:-1] for _, hidden in kept]
        sampled = [
            self._shadow.wants(
                model, self._limits.fits_logits(math.prod(shape), model.vocab_size, 2)
            )
            for shape in shapes
        ]
        rows = np.concatenate([hidden.reshape(-1, model.d_model) for _, hidden in kept])
        projection = await model.project(rows, k, temperature=temperature, full_logits=any(sampled))
        parts = list(grouping.split(projection, shapes))
        for (_, hidden), part, wanted in zip(kept, parts, sampled, strict=True):
            if wanted:
                assert part.logits is not None
                self._shadow.submit(model, hidden, part.logits, temperature)
        return [self._topk_result(model, part, options.logprobs, options.tokens) for part in parts]

    async def logits(self, request: LogitsRequest) -> LogitsResult:
        with self._serving("logits", request.target) as (model,):
            checked = options.logits(request, model, self._limits)
            residual = lens_options.residual(request.states, model)
            count = math.prod(checked.hidden.shape[:-1])
            width = model.vocab_size if checked.allowed is None else checked.allowed.shape[-1]
            cost = costs.logits(model, count, width, residual, request.text, checked.processors)
            self._admit(cost, "logits")
            hidden = await final_states(model, checked.hidden, residual)
            ids, temperature = checked.allowed, checked.temperature
            if checked.processors is not None:  # the decoding step's processed logits
                rows = hidden.reshape(-1, model.d_model)
                logits = await decoding.processed_logits(
                    model, rows, temperature, checked.processors
                )
                return decoding.logits_result(model, hidden.shape[:-1], logits, ids)
            if ids is not None:
                rows = hidden.reshape(-1, model.d_model)
                logits = await distribution.candidate_logits(model, rows, ids, temperature)
                columns = np.broadcast_to(ids, logits.shape) if ids.ndim == 1 else ids
                leading = hidden.shape[:-1]
                return LogitsResult(
                    model.info,
                    logits.reshape(*leading, -1),
                    model.space.original(np.ascontiguousarray(columns)).reshape(*leading, -1),
                )
            whole = options.CheckedTopK(hidden, 1, temperature)
            projection = await self._project(model, whole, full_logits=True)
            assert projection.logits is not None
            return LogitsResult(model.info, projection.logits, model.space.kept)

    async def embed(self, request: EmbedRequest) -> EmbedResult:
        with self._serving("embed", request.target) as (model,):
            ids = options.embed(request.input_ids, model, self._limits)
            self._admit(costs.embed(model, ids.size), "embed")
            return EmbedResult(model.info, await model.embed(ids))

    async def infer(self, request: InferRequest) -> InferResult:
        """Projection and/or embeddings from one version (the V2 protocol's infer)."""
        with self._serving("infer", request.target) as (model,):
            checked = options.infer(request, model, self._limits)
            residual = checked.topk is not None and lens_options.residual(request.states, model)
            self._admit(costs.infer(model, checked, request.tokens, residual), "infer")
            if checked.topk is not None:
                final = await self._final(model, checked.topk, residual)
                checked = replace(checked, topk=final)
            topk, logits = None, None
            if checked.topk is not None and checked.topk.shape is not None:
                topk = await decoding.shaped_topk(
                    model, checked.topk, checked.topk.shape, request.tokens
                )
            elif checked.topk is not None:
                full = checked.full_logits
                projection = await self._project(model, checked.topk, full_logits=full)
                topk = self._topk_result(model, projection, True, request.tokens)
                logits = projection.logits if full else None
            ids = checked.input_ids
            embeddings = None if ids is None else await model.embed(ids)
            return InferResult(model.info, topk, logits, embeddings)

    async def score(self, request: ScoreRequest) -> ScoreResult:
        """Per position the target's logit, log-prob and rank, top-k alternatives; NLL and
        perplexity; candidates. Runs in chunks (``scoring.score_chunks``): any number of
        rows within the row limit, never a (rows x vocab) tensor for the whole request."""
        with self._serving("score", request.target) as (model,):
            checked = options.score(request, model, self._limits)
            residual = lens_options.residual(request.states, model)
            width = 0 if checked.candidates is None else checked.candidates.shape[-1]
            cost = costs.score(model, len(checked.rows), checked.k, width, residual)
            self._admit(cost, "score")
            rows = await final_states(model, checked.rows, residual)
            ids = checked.candidates
            candidates = None
            if ids is not None:
                logits = await distribution.candidate_logits(model, rows, ids, 1.0)
                every = np.broadcast_to(ids, logits.shape) if ids.ndim == 1 else ids
                candidates = CandidateScores(np.ascontiguousarray(every), logits, logits)
            if checked.within:
                assert candidates is not None
                return scoring.score_within(model.info, candidates, checked.targets, model.space)
            scored = await scoring.score_chunks(model, rows, checked.targets, checked.run_k)
            return scoring.score_result(model.info, scored, candidates, checked.k, model.space)

    async def compare(self, request: CompareRequest) -> CompareResult:
        """The same rows through two heads (``service.plane.comparing``)."""
        first, second = (Target(name) for name in request.models)
        with self._serving("compare", first, second) as (a, b):
            return await comparing.compare_heads(request, (a, b), self._limits, self._statistics)

    async def lens(self, request: LensRequest) -> LensResult:
        """Every layer's states through the head (the logit lens; ``service.plane.lens``)."""
        with self._serving("lens", request.target) as (model,):
            checked = lens_options.lens(request, model, self._limits)
            layers, tokens, _ = checked.states.shape
            targets = checked.targets is not None
            cost = costs.lens(model, layers, tokens, checked.k, targets, request.tokens)
            self._admit(cost, "lens")
            return await read_lens(model, checked, request.tokens)

    async def verify(self, request: VerifyRequest) -> VerifyResult:
        """Speculative verification: drafts accepted or not, one token emitted (``verify``);
        with ``draft_model``, the draft's distribution from that head too."""
        drafter = () if request.draft_model is None else (Target(request.draft_model),)
        with self._serving("verify", request.target, *drafter) as (model, *draft):
            checked = verify_checks.check(request, model, self._limits, *draft)
            residual = lens_options.residual(request.states, model)
            cost = costs.verify_call(model, draft, checked, residual)
            self._admit(cost, "verify")
            result = await verify.run(model, draft, checked, residual)
            self._metrics.drafted_tokens.labels(model.name).inc(checked.draft_ids.size)
            self._metrics.accepted_tokens.labels(model.name).inc(int(result.accepted.sum()))
            return result

    # -- the rules' helpers -----------------------------------------------------------------

    async def _final(
        self, model: LoadedVersion, checked: options.CheckedTopK, residual: bool
    ) -> options.CheckedTopK:
        """Top-k's rows as final states: residual ones through the head's norm first."""
        return replace(checked, hidden=await final_states(model, checked.hidden, residual))

    def _admit(self, cost: costs.Cost, verb: str) -> None:
        """The request's declared cost, admitted or refused before any run (``costs``)."""
        costs.admit(cost, self._limits, verb)

    def _serving(self, verb: str, *targets: Target) -> Serving:
        """Look up and lease each target (no ``await`` between), and record the call."""
        return Serving(self._registry, self._metrics, verb, targets)

    async def _project(
        self, model: LoadedVersion, checked: options.CheckedTopK, *, full_logits: bool
    ) -> Projection:
        """Run the projection; a request sampled for shadow traffic also fetches its logits
        (full logits asked by the request were checked against the byte limit already)."""
        hidden, k, temperature = checked.hidden, checked.k, checked.temperature
        rows = math.prod(hidden.shape[:-1])
        affordable = self._limits.fits_logits(rows, model.vocab_size, copies=2)
        sampled = self._shadow.wants(model, affordable)
        projection = await model.project(
            hidden, k, temperature=temperature, full_logits=full_logits or sampled
        )
        if full_logits:  # the answer's (a shadow copes with what it is sent)
            assert projection.logits is not None
            refuse_overflow(projection.logsumexp, projection.logits, temperature=temperature)
        if sampled:
            assert projection.logits is not None
            self._shadow.submit(model, hidden, projection.logits, temperature)
        return projection

    async def _shadow_logits(
        self, primary: LoadedVersion, name: str, rows: npt.NDArray[np.float32], temperature: float
    ) -> npt.NDArray[np.float32]:
        """The shadow's full logits for sampled rows, leased and limited like any request."""
        with self._serving("shadow", Target(name)) as (shadow,):
            primary.check_comparable(shadow)
            self._limits.logits(len(rows), shadow.vocab_size, copies=2)
            projection = await shadow.project(rows, 1, temperature=temperature, full_logits=True)
            assert projection.logits is not None
            return projection.logits

    async def _statistics(self, function: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._stats, function, *args)

    def _topk_result(
        self, model: LoadedVersion, projection: Projection, logprobs: bool, tokens: bool
    ) -> TopKResult:
        ids = projection.topk_token_ids
        return TopKResult(
            model.info,
            model.space.original(ids),
            projection.topk_logits,
            projection.logsumexp,
            projection.topk_logprobs if logprobs else None,
            model.tokens(ids) if tokens else None,
        )
