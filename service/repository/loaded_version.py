"""A loaded model version: its session, what the inspector found, labels, and its leases.

``open_version`` (``service.repository.open_version``) is synchronous and runs in the loader
thread: copy and inspect the files, open the session with the memory mode that fits (tied or
not), read labels; ``service.repository.warm_up`` then runs it once, under a deadline.
Requests hold a reference to a ``LoadedVersion``, never a name, so a request always finishes
on the version it started on, and ``retire`` waits for their leases. How its rows run (the
batcher, the executor, the size of a run) is the runtime's ``Runner``: the version delegates.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from service.errors import InvalidInput
from service.heads.inspector import HeadReport
from service.messages import HeadInfo, VersionDetails
from service.repository.disk import ModelConfig, Signature
from service.repository.labels import LabelTable, TokenStrings
from service.runtime.batcher import BatchLimits
from service.runtime.pending import BatchStats
from service.runtime.runner import Runner
from service.runtime.session import HeadSession, Projection
from service.runtime.vocabulary import TokenSpace

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
    token_space: TokenSpace | None = None
    """A trimmed head's original ids (``service.tools.trim``); None: columns are token ids."""
    _inflight: int = field(default=0, repr=False)
    _idle: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def __post_init__(self) -> None:
        self._idle.set()
        self.runner = Runner(self.session, self.label)
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

    @property
    def rows_per_run(self) -> int:
        """The most rows one run of this head takes (``Runner.rows_per_run``)."""
        return self.runner.rows_per_run

    def start(
        self,
        executor: Executor,
        limits: BatchLimits,
        rows_per_run: int,
        on_batch: Callable[[BatchStats], None],
        on_reject: Callable[[], None],
    ) -> None:
        """Serve (``Runner.start``), a run taking no more rows than ``config.json``'s
        ``max_batch_rows`` either."""
        rows_per_run = min(self.config.max_batch_rows or rows_per_run, rows_per_run)
        self.runner.start(executor, limits, rows_per_run, on_batch, on_reject)

    async def close(self) -> None:
        await self.runner.close()

    def group_room(self) -> int:
        return self.runner.group_room()

    async def project(
        self,
        hidden: npt.NDArray[np.float32],
        k: int,
        *,
        temperature: float = 1.0,
        full_logits: bool = False,
    ) -> Projection:
        """``Runner.project``: through the batcher, in runs of at most ``rows_per_run``."""
        return await self.runner.project(
            hidden, k, temperature=temperature, full_logits=full_logits
        )

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
        return await self.runner.embed(ids)

    async def run_alone(self, rows: int, function: Callable[..., T], *args: Any) -> T:
        """``Runner.run_alone``: a run beside the batcher, in the run metrics."""
        return await self.runner.run_alone(rows, function, *args)

    async def rows_per_second(self, hidden: npt.NDArray[np.float32], rows: int, runs: int) -> float:
        return await self.runner.rows_per_second(hidden, rows, runs)

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


def _shown(quantization: dict[str, Any] | None) -> dict[str, Any] | None:
    """The inspector's quantization facts without tensor names (not a client's business)."""
    if quantization is None:
        return None
    names = ("table_tensors", "projection_tensors")
    return {key: value for key, value in quantization.items() if key not in names}


def _norm_shown(norm: dict[str, Any] | None) -> dict[str, Any] | None:
    """The final norm as a client sees it (kind, epsilon, bias, source), or None: residual
    states and the lens are refused for such a head."""
    if norm is None:
        return None
    return {key: norm[key] for key in ("kind", "epsilon", "bias", "source") if key in norm}
