"""Execution providers and session options of a head's onnxruntime session."""

from __future__ import annotations

import logging
from typing import Any, get_args

import onnxruntime as ort

from service.settings import MemoryMode, ProviderChoice

logger = logging.getLogger("lmhead")
MEMORY_MODES: tuple[MemoryMode, ...] = get_args(MemoryMode)
CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"


def select_providers(choice: ProviderChoice, available: list[str] | None = None) -> tuple[str, ...]:
    """Execution providers for a session, CPU always last as the fallback.

    ``cuda`` and ``auto`` use CUDA when this onnxruntime build has it (the ``gpu`` extra
    installs onnxruntime-gpu); otherwise they fall back to CPU, and the model metadata shows
    which provider each model really runs on.
    """
    present = ort.get_available_providers() if available is None else available
    if choice != "cpu" and CUDA in present:
        return (CUDA, CPU)
    if choice == "cuda":
        logger.warning("CUDA requested but this onnxruntime has no CUDA provider; using CPU")
    return (CPU,)


FOLDING_CAP_BYTES = 4 * 2**20


def session_options(
    *,
    shares_weight: bool,
    memory_mode: MemoryMode = "shared",
    intra_op_threads: int = 0,
    on_cuda: bool = False,
) -> ort.SessionOptions:
    """Session options for a head; see the module docstring for the memory trade-off."""
    if memory_mode not in MEMORY_MODES:
        raise ValueError(f"memory_mode must be one of {MEMORY_MODES}, got {memory_mode!r}")
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads
    # Idle worker threads of one session would otherwise spin for a while after each run and
    # steal the cores from the next session's run: with several heads loaded (A/B, hot-swap)
    # spinning measured up to 3x slower here. Without it a run wakes its threads (~tens of us).
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if on_cuda:
        # Initializers in plain device allocations, not the arena (which grew by ~1.2x W past
        # them): one copy of W on the device. No packed copy exists there to trade for speed,
        # so both memory modes are the same.
        options.add_session_config_entry("session.use_device_allocator_for_initializers", "1")
    if memory_mode == "shared" or on_cuda:
        options.add_session_config_entry(
            "optimization.constant_folding_max_output_size_in_bytes", str(FOLDING_CAP_BYTES)
        )
        if shares_weight and not on_cuda:
            options.add_session_config_entry("session.disable_prepacking", "1")
    return options


def provider_entries(providers: tuple[str, ...], tf32: bool) -> list[Any]:
    """onnxruntime's provider list, with the CUDA options this service relies on."""
    cuda = {"use_tf32": "1" if tf32 else "0", "arena_extend_strategy": "kSameAsRequested"}
    return [(name, cuda) if name == CUDA else name for name in providers]
