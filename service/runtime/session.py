"""One onnxruntime session per head file; synchronous, so it is trivially testable.

The session options decide what a head costs in memory:

* a session holding W for its Gemm alone (untied heads, and tied heads split by
  ``service.runtime.layout``) keeps MLAS prepacking: onnxruntime packs W and frees the original, so
  the packed copy is the only one. Constant folding is capped at a few MB in ``shared`` mode
  so an imported ``Transpose(W)`` is never folded into a second copy.
* a session whose one W feeds both the Gather and the Gemm (a tied head run unsplit) in
  ``memory_mode="shared"`` runs with ``session.disable_prepacking=1``: MLAS would otherwise
  add a packed copy while the original stays alive for the Gather (2x W), and without it
  MLAS re-packs W on every call (1.2-1.8x slower). ``service.runtime.layout`` avoids that case on a
  CPU; ``HeadSession(..., tied=True)`` used directly still gets it.
* ``memory_mode="fast"``: onnxruntime defaults (a tied head unsplit holds ~2x W).
* on CUDA both modes are one: initializers go to plain device allocations (one copy of W on
  the device), and ``tf32`` chooses TensorFloat-32 matmuls (faster, ~1e-3 logit error).

``InferenceSession.run`` is safe to call from several threads on one session.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from service.heads.graph import (
    EMBEDDINGS,
    HIDDEN_STATES,
    INPUT_IDS,
    LOGITS,
    LOGSUMEXP,
    QUANTIZATION,
    TEMPERATURE,
    TOPK_LOGITS,
    TOPK_TOKEN_IDS,
    K,
)
from service.heads.lse_graph import LSE_IN_CHUNKS
from service.heads.norm import NORMED_STATES, RESIDUAL_STATES, within_norm_range
from service.runtime.logmath import target_ranks
from service.runtime.providers import (
    CUDA,
    provider_entries,
    session_options,
)
from service.runtime.rows import RowSource
from service.runtime.vocabulary import CandidateLogits
from service.settings import MemoryMode

logger = logging.getLogger("lmhead")


@dataclass(frozen=True)
class Projection:
    """Projection outputs with the caller's leading dims restored."""

    topk_logits: npt.NDArray[np.float32]
    topk_token_ids: npt.NDArray[np.int64]
    logsumexp: npt.NDArray[np.float32]
    logits: npt.NDArray[np.float32] | None = None

    @property
    def topk_logprobs(self) -> npt.NDArray[np.float32]:
        """log-softmax of the top-k entries, exact over the full vocabulary."""
        return self.topk_logits - self.logsumexp[..., None]


@dataclass(frozen=True)
class Scored:
    """``HeadSession.score`` of some rows: top-k, log-sum-exp, target logit and rank."""

    topk_logits: npt.NDArray[np.float32]
    topk_token_ids: npt.NDArray[np.int64]
    logsumexp: npt.NDArray[np.float32]
    target_logit: npt.NDArray[np.float32]
    rank: npt.NDArray[np.int64]


#: This onnxruntime's (major, minor) version.
RUNTIME_VERSION = tuple(int(part) for part in ort.__version__.split(".")[:2])
#: onnxruntime before 1.31 divides by zero (SIGFPE: the process dies) in TopK on 0 rows with
#: k >= 1, and a run computes every node: there an embedding run carries one zero row (one
#: row of projection wasted per lookup, and per load's warm-up).
_FILLER_ROWS = 0 if RUNTIME_VERSION >= (1, 31) else 1


class HeadSession:
    """A loaded head: top-k projection and embedding lookup on one onnxruntime session."""

    def __init__(
        self,
        path: str | Path,
        *,
        tied: bool,
        memory_mode: MemoryMode = "shared",
        intra_op_threads: int = 0,
        providers: tuple[str, ...] = ("CPUExecutionProvider",),
        tf32: bool = False,
        io_binding: bool = False,
        rows: RowSource | None = None,
    ) -> None:
        """``rows``: where embedding rows come from when the file is projection-only
        (``projection_only.without_embedding``, so its session packs W for the Gemm as it likes)."""
        self.path = Path(path)
        self.io_binding = io_binding
        self.rows = rows
        #: Logits of chosen tokens from their rows of W (``service.runtime.layout`` sets it).
        self.candidates: CandidateLogits | None = None
        on_cuda = CUDA in providers
        self.memory_mode: MemoryMode = "shared" if on_cuda else memory_mode
        options = session_options(
            shares_weight=tied,
            memory_mode=memory_mode,
            intra_op_threads=intra_op_threads,
            on_cuda=on_cuda,
        )
        self._session: ort.InferenceSession | None = ort.InferenceSession(
            str(self.path), options, providers=provider_entries(providers, tf32)
        )
        if on_cuda and CUDA not in self._session.get_providers():  # e.g. a driver too old
            logger.warning(
                "%s: CUDA was asked for but its session runs on the CPU (CUDA could not start:"
                " see onnxruntime's log above; onnxruntime-gpu needs a matching driver)",
                self.path.parent.name,
            )
        shapes = {value.name: value.shape for value in self._session.get_outputs()}
        self.vocab_size = int(shapes[LOGITS][1])
        inputs = {value.name: value.shape for value in self._session.get_inputs()}
        self.d_model = int(inputs[HIDDEN_STATES][1])
        self._inputs = set(inputs)
        _check_per_row_temperature(self._session, self.path)
        self.compute_dtype = _weight_dtype(self._session)
        #: rows x vocab float32 tensors a scoring run holds: 1 where the graph can take its
        #: log-sum-exp in row chunks (``service.heads.lse_graph``) and the run writes the logits
        #: into a buffer of its thread's, else 2 (logits and log-softmax, or transforms').
        self.score_copies = 1 if LSE_IN_CHUNKS in self._inputs else 2
        #: Each inference thread's scoring buffer, by thread (``release_arena`` drops them).
        self._score_buffers: dict[int, npt.NDArray[np.float32]] = {}
        #: The head holds its model's final norm: residual states can be read through it.
        self.has_norm = RESIDUAL_STATES in self._inputs
        self._filler_rows = np.zeros((_FILLER_ROWS, self.d_model), np.float32)
        self._filler_temperature = np.ones((_FILLER_ROWS, 1), np.float32)
        self._no_ids = np.zeros((0,), np.int64)
        #: Given to every run: ``terminate`` ends them all (onnxruntime checks between nodes).
        self._run_options = ort.RunOptions()

    @property
    def providers(self) -> list[str]:
        return [] if self._session is None else list(self._session.get_providers())

    def terminate(self) -> None:
        """End this session's runs now, from any thread, and fail every later one: a warm-up
        past its deadline, or a stopping service's runs (``repository.warm_up``, ``Registry``).
        A run ends at its next node, not mid-kernel."""
        self._run_options.terminate = True

    def close(self) -> None:
        """Release the onnxruntime session (weights, arena) now rather than at GC time."""
        self._session = None

    def release_arena(self) -> None:
        """Hand back what onnxruntime's memory arena holds unused: it keeps the buffers of the
        largest runs so far for good (~200 MB after 4096-row k=1000 scoring on the demo head,
        none of it freed by ``malloc_trim``), the scoring buffers and the rows of W gathers
        mapped. A one-row run that ends by shrinking the arena; for an idle service
        (``allocator.IdleRelease``)."""
        self._score_buffers.clear()  # a run using one holds its own reference meanwhile
        for source in (self.rows, None if self.candidates is None else self.candidates.rows):
            if source is not None:
                source.drop()  # rows of W mapped by gathers (``service.runtime.rows``)
        session = self._session
        if session is None:
            return
        devices = "cpu:0" + (";gpu:0" if CUDA in session.get_providers() else "")
        options = ort.RunOptions()
        options.add_run_config_entry("memory.enable_memory_arena_shrinkage", devices)
        one = np.zeros((1, self.d_model), np.float32)
        session.run(
            [LOGSUMEXP], self._feeds(one, self._no_ids, 1, np.ones((1, 1), np.float32)), options
        )

    def project(
        self,
        hidden_states: npt.ArrayLike,
        k: int,
        *,
        temperature: float | npt.NDArray[np.float32] = 1.0,
        full_logits: bool = False,
    ) -> Projection:
        """Top-k logits and ids, log-sum-exp, and optionally all logits for (..., d_model).

        ``temperature`` is one value for every row or one per row (rows,).
        """
        hidden = np.asarray(hidden_states)
        if hidden.ndim == 0 or hidden.shape[-1] != self.d_model:
            raise ValueError(
                f"hidden_states must be (..., {self.d_model}), got shape {hidden.shape}"
            )
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        leading = hidden.shape[:-1]
        rows = np.ascontiguousarray(hidden.reshape(-1, self.d_model), dtype=np.float32)
        per_row = np.empty((len(rows), 1), np.float32)
        per_row[:, 0] = temperature
        if not (per_row > 0).all():
            raise ValueError("temperature must be > 0")
        names = [TOPK_LOGITS, TOPK_TOKEN_IDS, LOGSUMEXP] + ([LOGITS] if full_logits else [])
        outputs = self._run(names, rows, self._no_ids, k, per_row)
        values, ids, lse, *rest = (out.reshape(*leading, *out.shape[1:]) for out in outputs)
        return Projection(values, ids, lse, rest[0] if rest else None)

    def score(
        self, rows: npt.NDArray[np.float32], targets: npt.NDArray[np.int64], k: int
    ) -> Scored:
        """Top-k, log-sum-exp and each row's target logit and rank (tokens scoring strictly
        higher, and equal ones with lower ids: ``logmath.target_ranks``) for (rows, d_model)
        rows at temperature 1.

        With ``score_copies == 1`` the run writes its logits into one buffer per calling
        thread, kept for the next call (as onnxruntime's arena keeps a run's buffers): fresh
        pages cost each run their page faults, measured ~7% of a 98-row run; one buffer per
        inference thread keeps the memory bound of ``budget.worst_case_extra_bytes``."""
        values, ids, lse, logits = self.logits_run(rows, k)
        target, rank = target_ranks(logits, targets)
        return Scored(values, ids, lse, target, rank)

    def logits_run(
        self, rows: npt.NDArray[np.float32], k: int
    ) -> tuple[
        npt.NDArray[np.float32],
        npt.NDArray[np.int64],
        npt.NDArray[np.float32],
        npt.NDArray[np.float32],
    ]:
        """Top-k values and ids, log-sum-exp and the (rows, vocab) logits of final states at
        temperature 1, the logits in this thread's scoring buffer (valid until its next
        run; scoring and the lens read them there)."""
        temperature = np.ones((len(rows), 1), np.float32)
        names = [TOPK_LOGITS, TOPK_TOKEN_IDS, LOGSUMEXP, LOGITS]
        into = self._score_buffer(len(rows)) if self.score_copies == 1 else None
        values, ids, lse, logits = self._run(names, rows, self._no_ids, k, temperature, into)
        return values, ids, lse, logits

    def _score_buffer(self, rows: int) -> npt.NDArray[np.float32]:
        size = rows * self.vocab_size
        thread = threading.get_ident()
        buffer = self._score_buffers.get(thread)
        if buffer is None or buffer.size < size:
            buffer = self._score_buffers[thread] = np.empty(size, np.float32)
        return buffer[:size].reshape(rows, self.vocab_size)

    def embed(self, input_ids: npt.ArrayLike) -> npt.NDArray[np.float32]:
        """Rows of the input embedding table, shaped ``input_ids.shape + (d_model,)``."""
        ids = np.asarray(input_ids)
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"input_ids must be integers, got dtype {ids.dtype}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(
                f"input_ids must be in [0, {self.vocab_size}), got values in "
                f"[{ids.min()}, {ids.max()}]"
            )
        flat = np.ascontiguousarray(ids.reshape(-1), dtype=np.int64)
        if self.rows is not None:
            embeddings = self.rows.rows(flat)
            # A prompt's ids spread over the table and map most of it (the kernel maps large
            # folios): an embedding lookup hands its mapped pages back at once (~0.26 ms of
            # faults per 1,000 rows), where allowed tokens' gathers keep theirs for a while.
            self.rows.drop()
        else:
            (embeddings,) = self._run(
                [EMBEDDINGS], self._filler_rows, flat, 1, self._filler_temperature
            )
        return embeddings.reshape(*ids.shape, self.d_model)

    def normalize(self, residual: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """(rows, d_model) residual states through the head's final norm (its graph's norm
        side, ``service.heads.norm``): what the model's last layer hands its head. Rows too
        large for its float32 sum of squares are scaled first (``within_norm_range``)."""
        if not self.has_norm:
            raise ValueError(f"{self.path.parent.name} holds no final norm")
        rows = within_norm_range(np.ascontiguousarray(residual, dtype=np.float32))
        (normed,) = self._run(
            [NORMED_STATES],
            self._filler_rows,
            self._no_ids,
            1,
            self._filler_temperature,
            residual=rows,
        )
        return np.asarray(normed, np.float32)

    def _feeds(
        self,
        rows: npt.NDArray[np.float32],
        ids: npt.NDArray[np.int64],
        k: int,
        temperature: npt.NDArray[np.float32],
        *,
        chunked: bool = False,
        residual: npt.NDArray[np.float32] | None = None,
    ) -> dict[str, npt.NDArray[Any]]:
        feeds: dict[str, npt.NDArray[Any]] = {
            HIDDEN_STATES: rows,
            INPUT_IDS: ids,
            K: np.array([k], np.int64),
            TEMPERATURE: temperature,
        }
        if self.has_norm:  # the norm side runs on what it is given: nothing, or these rows
            feeds[RESIDUAL_STATES] = self._filler_rows if residual is None else residual
        if INPUT_IDS not in self._inputs:  # a projection-only session (``rows`` given)
            del feeds[INPUT_IDS]
        if LSE_IN_CHUNKS in self._inputs:  # scoring: the log-sum-exp a few rows at a time
            feeds[LSE_IN_CHUNKS] = np.array([chunked])
        return feeds

    def _run(
        self,
        names: list[str],
        rows: npt.NDArray[np.float32],
        ids: npt.NDArray[np.int64],
        k: int,
        temperature: npt.NDArray[np.float32],
        logits_into: npt.NDArray[np.float32] | None = None,
        residual: npt.NDArray[np.float32] | None = None,
    ) -> list[npt.NDArray[Any]]:
        """``logits_into``: a (rows, vocab) array the run writes the logits into (bound as
        the output, so no second rows x vocab copy is made when they reach Python); such a
        run takes its log-sum-exp in row chunks where the graph can
        (``service.heads.lse_graph``)."""
        chunked = logits_into is not None
        feeds = self._feeds(rows, ids, k, temperature, chunked=chunked, residual=residual)
        if self._session is None:
            raise RuntimeError(f"session for {self.path} was closed")
        if not self.io_binding and logits_into is None:
            return list(self._session.run(names, feeds, self._run_options))
        binding = self._session.io_binding()
        for name, array in feeds.items():
            binding.bind_cpu_input(name, array)
        for name in names:
            if name == LOGITS and logits_into is not None:  # the run writes there: no copy
                shape = logits_into.shape
                binding.bind_output(name, "cpu", 0, np.float32, shape, logits_into.ctypes.data)
            else:
                binding.bind_output(name, "cpu")  # only what was asked crosses to the host
        self._session.run_with_iobinding(binding, self._run_options)
        outputs = binding.get_outputs()
        return [
            logits_into if name == LOGITS and logits_into is not None else value.numpy()
            for name, value in zip(names, outputs, strict=True)
        ]


def _check_per_row_temperature(session: ort.InferenceSession, path: Path) -> None:
    """Heads written before per-row temperature (lmhead format 1) take one value per run."""
    shape = next(value.shape for value in session.get_inputs() if value.name == TEMPERATURE)
    if len(shape) != 2:
        raise ValueError(
            f"{path.name} was written by an older lmhead (one temperature per run); "
            "write it again with `lmhead demo --force` or `lmhead import`"
        )


def _weight_dtype(session: ort.InferenceSession) -> str:
    """float32, or the half type the Gemm runs in (the hidden state is cast to it); int8 for
    a block-quantized projection (``MatMulNBits`` accuracy level 4: int8 activations)."""
    metadata: dict[str, str] = session.get_modelmeta().custom_metadata_map
    if QUANTIZATION in metadata:
        return "int8"
    return metadata.get("lmhead.dtype", "float32")
