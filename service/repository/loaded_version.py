"""A loaded model version: its session, what the inspector found, labels, and its batcher.

``open_version`` is synchronous and runs in the loader thread: inspect the file, open the
session with the memory mode that fits (tied or not), read labels; ``warm_up`` then runs it
once, under a deadline, and checks the output shapes. Requests hold a reference to a
``LoadedVersion``, never a name, so a request always finishes on the version it started on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from functools import cached_property
from time import perf_counter
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from service.errors import InvalidInput
from service.heads.inspector import HeadReport
from service.messages import HeadInfo, VersionDetails
from service.repository.disk import ModelConfig, Signature
from service.repository.labels import LabelTable, TokenStrings
from service.runtime.batcher import Batcher, BatchLimits
from service.runtime.pending import BatchStats
from service.runtime.session import HeadSession, Projection
from service.runtime.vocabulary import TokenSpace, refuse_overflow

T = TypeVar("T")


@dataclass
class LoadedVersion:
    """One servable version of a model."""

    name: str
    version: int
    session: HeadSession
    report: HeadReport
    config: ModelConfig
    labels: list[str] | None
    default_k: int
    signature: Signature = ()
    rows_per_run: int = 1 << 30
    token_space: TokenSpace | None = None
    """A trimmed head's original ids (``service.tools.trim``); None: columns are token ids."""
    batcher: Batcher | None = field(default=None, repr=False)
    executor: Executor | None = field(default=None, repr=False)
    on_run: Callable[[BatchStats], None] | None = field(default=None, repr=False)
    _inflight: int = field(default=0, repr=False)
    _idle: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def __post_init__(self) -> None:
        self._idle.set()
        self._label_table: LabelTable | None = None
        if self.labels is not None:
            self._label_table = LabelTable.of(self.labels, self.report.vocab_size)

    def acquire(self) -> None:
        """Take a lease for one request: ``retire`` waits until every lease is released.

        Take it right after ``Registry.get`` with no ``await`` between, so a swap can never
        release a version that a request has already been given (the data plane does).
        """
        self._inflight += 1
        self._idle.clear()

    def release(self) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()

    async def retire(self, timeout_s: float) -> bool:
        """Let admitted requests finish (up to ``timeout_s``), then release the session.

        Returns whether it drained in time; after the timeout the remaining requests fail
        with 503 rather than hold the old weights forever.
        """
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            drained = True
        except TimeoutError:
            drained = False
        await self.close()
        self.session.close()
        return drained

    @cached_property
    def info(self) -> HeadInfo:
        """Who answered, as results carry it (computed once: a version never changes)."""
        report = self.report
        quantization = report.quantization or {}
        return HeadInfo(
            self.name,
            self.version,
            report.tied,
            report.vocab_size,
            report.d_model,
            report.dtype,
            quantization.get("block_size"),
            bool(quantization.get("table")),
        )

    @property
    def label(self) -> str:
        return f"{self.name}/{self.version}"

    @property
    def tied(self) -> bool:
        return self.report.tied

    @property
    def d_model(self) -> int:
        return self.session.d_model

    @property
    def vocab_size(self) -> int:
        return self.session.vocab_size

    @property
    def space(self) -> TokenSpace:
        """The ids requests name and answers return (``TokenSpace``)."""
        return self.token_space or TokenSpace(self.vocab_size)

    def start(
        self,
        executor: Executor,
        limits: BatchLimits,
        rows_per_run: int,
        on_batch: Callable[[BatchStats], None],
        on_reject: Callable[[], None],
    ) -> None:
        """Serve: runs of at most ``rows_per_run`` rows and the batch caps from now on. A
        request with more rows is cut into runs of that size, queued one after another, so the
        runs of other requests and other models come in between: a one-row request waits for
        one such run at most, not for a whole 4096-row request (measured on the demo head: a
        1048-row run at k=1000 took 392 ms; 128 rows, 50 ms)."""
        caps = (limits.max_batch_rows, self.config.max_batch_rows or rows_per_run, rows_per_run)
        self.rows_per_run = min(caps)
        limits = BatchLimits(limits.merge, min(caps), limits.max_wait_s, limits.max_queue_rows)
        self.executor = executor
        self.on_run = on_batch
        self.batcher = Batcher(
            self._run, executor, limits, label=self.label, on_batch=on_batch, on_reject=on_reject
        )
        self.batcher.start()

    async def close(self) -> None:
        if self.batcher is not None:
            await self.batcher.close()

    def group_room(self) -> int:
        """Rows calls served as one may hold (``DataPlane.topk_group``): what the queue takes
        now, and half a batch (``Batcher.room``)."""
        assert self.batcher is not None, "start() the version before serving it"
        return self.batcher.room

    async def project(
        self,
        hidden: npt.NDArray[np.float32],
        k: int,
        *,
        temperature: float = 1.0,
        full_logits: bool = False,
    ) -> Projection:
        """Project (..., d_model) float32 hidden states through the batcher.

        More rows than one run may take go in chunks, one after another: each run's logits
        stay within the byte limit, and other requests (other models too) run in between.
        """
        assert self.batcher is not None, "start() the version before serving it"
        leading = hidden.shape[:-1]
        rows = hidden.reshape(-1, self.d_model)
        step = self.rows_per_run
        if len(rows) <= step:
            flat = await self.batcher.submit(rows, k, full_logits, temperature)
        else:
            flat = await self._in_runs(rows, step, k, full_logits, temperature)
        refuse_overflow(flat.logsumexp, flat.topk_logits, temperature=temperature)
        return Projection(
            flat.topk_logits.reshape(*leading, -1),
            flat.topk_token_ids.reshape(*leading, -1),
            flat.logsumexp.reshape(leading),
            None if flat.logits is None else flat.logits.reshape(*leading, -1),
        )

    async def _in_runs(
        self,
        rows: npt.NDArray[np.float32],
        step: int,
        k: int,
        full_logits: bool,
        temperature: float,
    ) -> Projection:
        """Runs of ``step`` rows, one after another, each copied into the whole answer as it
        comes (one concatenation of 4096 rows at k=1000 held the event loop for ~30 ms)."""
        assert self.batcher is not None
        whole: Projection | None = None
        for start in range(0, len(rows), step):
            part = await self.batcher.submit(
                rows[start : start + step], k, full_logits, temperature
            )
            if whole is None:
                whole = _allocated(part, len(rows))
            _place(whole, part, start)
        assert whole is not None
        return whole

    def check_comparable(self, other: LoadedVersion) -> None:
        """Logits that line up column by column with ``other``'s (compare, shadow), or 422."""
        if self.d_model != other.d_model:
            raise InvalidInput(
                f"d_model differs: {self.name} has {self.d_model}, {other.name} has {other.d_model}"
            )
        if self.vocab_size != other.vocab_size or not self.space.same_tokens(other.space):
            raise InvalidInput(
                f"{self.name} and {other.name} do not name the same tokens (vocab sizes "
                f"{self.vocab_size} and {other.vocab_size}, or trimmed to other ids): comparing "
                "them needs a token mapping, which is not supported"
            )

    async def embed(self, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.float32]:
        """Rows of the input embedding (the Gather side), in the inference executor."""
        return await self.run_alone(ids.size, self.session.embed, ids)

    async def run_alone(self, rows: int, function: Callable[..., T], *args: Any) -> T:
        """A run outside the batcher (scoring, embedding rows, candidates' rows of W) in the
        inference executor, in the run metrics as a batch of one request."""

        def timed() -> tuple[T, float]:
            started = perf_counter()
            try:
                return function(*args), perf_counter() - started
            except Exception:
                self._observe(BatchStats(rows, 1, [], perf_counter() - started, failed=True))
                raise

        result, seconds = await asyncio.get_running_loop().run_in_executor(self.executor, timed)
        self._observe(BatchStats(rows, 1, [], seconds, failed=False))
        return result

    def _observe(self, stats: BatchStats) -> None:
        if self.on_run is not None:
            self.on_run(stats)

    async def rows_per_second(self, hidden: npt.NDArray[np.float32], rows: int, runs: int) -> float:
        """Rows/s of the bare session on a fixed batch tiled from ``hidden`` (no batcher)."""
        batch = np.resize(hidden.reshape(-1, self.d_model), (rows, self.d_model))

        def measure() -> float:
            self.session.project(batch, 10)
            start = perf_counter()
            for _ in range(runs):
                self.session.project(batch, 10)
            return rows * runs / (perf_counter() - start)

        return await asyncio.get_running_loop().run_in_executor(self.executor, measure)

    def tokens(self, ids: npt.NDArray[np.int64]) -> TokenStrings | None:
        """Token strings for (..., k) column ids, a list per flattened row, looked up when
        first read (``service.repository.labels``); None when the head has no labels."""
        if self._label_table is None:
            return None
        return TokenStrings(self._label_table, ids)

    @property
    def label_bytes(self) -> int:
        """The most bytes one returned token's string takes in a JSON answer, quotes and
        escapes included (``null``, 4, for a column without one), measured once at load and at
        most ``labels.MAX_LABEL_BYTES``; 0 when the head has no labels. An answer repeats a
        string per returned token, so its declared size counts this per token."""
        return 0 if self._label_table is None else self._label_table.encoded_bytes

    def details(self) -> VersionDetails:
        """What a client sees of this version (model descriptions, compare's blocks)."""
        report = self.report
        return VersionDetails(
            version=self.version,
            tied=report.tied,
            vocab_size=report.vocab_size,
            d_model=report.d_model,
            dtype=report.dtype,
            parameters=report.parameters,
            weight_bytes=report.weight_bytes,
            file_bytes=report.file_bytes,
            embedding_initializer=report.embedding_initializer,
            projection_initializer=report.projection_initializer,
            duplicate=report.duplicate,
            transforms=report.transforms,
            quantization=_shown(report.quantization),
            memory_mode=self.session.memory_mode,
            layout="split" if self.session.rows is not None else "one session",
            compute_dtype=self.session.compute_dtype,
            providers=tuple(self.session.providers),
            labels=self.labels is not None,
            default_k=self.default_k,
            trimmed_from=None if self.token_space is None else self.token_space.size,
            final_norm=_norm_shown(report.final_norm),
        )

    def _run(
        self,
        rows: npt.NDArray[np.float32],
        k: int,
        full_logits: bool,
        temperature: npt.NDArray[np.float32],
    ) -> Projection:
        return self.session.project(rows, k, temperature=temperature, full_logits=full_logits)


def _shown(quantization: dict[str, Any] | None) -> dict[str, Any] | None:
    """The inspector's quantization facts without tensor names (not a client's business)."""
    if quantization is None:
        return None
    names = ("table_tensors", "projection_tensors")
    return {key: value for key, value in quantization.items() if key not in names}


def _allocated(first: Projection, rows: int) -> Projection:
    """Empty arrays for ``rows`` rows shaped as ``first``'s."""

    def like(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
        return np.empty((rows, *array.shape[1:]), array.dtype)

    logits = None if first.logits is None else like(first.logits)
    return Projection(
        like(first.topk_logits), like(first.topk_token_ids), like(first.logsumexp), logits
    )


def _place(whole: Projection, part: Projection, start: int) -> None:
    stop = start + len(part.logsumexp)
    whole.topk_logits[start:stop] = part.topk_logits
    whole.topk_token_ids[start:stop] = part.topk_token_ids
    whole.logsumexp[start:stop] = part.logsumexp
    if whole.logits is not None and part.logits is not None:
        whole.logits[start:stop] = part.logits


def _norm_shown(norm: dict[str, Any] | None) -> dict[str, Any] | None:
    """The final norm as a client sees it (kind, epsilon, bias, source), or None: residual
    states and the lens are refused for such a head."""
    if norm is None:
        return None
    return {key: norm[key] for key in ("kind", "epsilon", "bias", "source") if key in norm}
