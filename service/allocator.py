"""glibc allocator settings every lmhead process applies (no-ops elsewhere), and the
resident high-water mark the memory measurements read (Linux).

Kept apart from ``service.tools.memory`` (the footprint measurements) so a front process, which
holds no head, applies them without importing onnxruntime.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path

#: How long after going idle a process hands freed memory back (``IdleRelease``), and how
#: many times that long it does so once more.
RELEASE_AFTER_S = 0.5
AGAIN_AFTER = 10.0


def trim_heap() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise); no-op elsewhere."""
    gc.collect()
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def release_free_memory() -> None:
    """``malloc_trim``: the heap pages every glibc arena holds free, handed back to the OS
    (threads allocate in arenas of their own, and each keeps what its requests freed), after
    a garbage collection. Run it in a thread: ``malloc_trim`` lets go of Python's lock."""
    gc.collect()  # cycles left by requests (an exception's frames) hold their buffers
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


class IdleRelease:
    """``release`` (by default ``release_free_memory``) a moment after a process goes idle
    after big requests (the last answer is still being sent meanwhile, and freed once sent),
    and once more a while later; in ``executor`` (None: the event loop's default one), one
    release at a time, and only while ``idle()`` holds: a busy process is left alone (a
    release then would cost the requests in flight) and looked at again later."""

    def __init__(
        self,
        executor: Executor | None,
        idle: Callable[[], bool],
        release: Callable[[], None] = release_free_memory,
        after_s: float = RELEASE_AFTER_S,
    ) -> None:
        self._executor = executor
        self._idle = idle
        self._release = release
        self._after_s = after_s
        self._pending = False

    def soon(self) -> None:
        if self._pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # idle outside an event loop (in-process callers): nothing to do
            return
        self._pending = True
        loop.call_later(self._after_s, self._start, loop, AGAIN_AFTER)

    def _start(self, loop: asyncio.AbstractEventLoop, again: float) -> None:
        if not self._idle():  # busy again: look later
            loop.call_later(self._after_s, self._start, loop, again)
            return
        running = loop.run_in_executor(self._executor, self._release)
        running.add_done_callback(lambda _: self._done(loop, again))

    def _done(self, loop: asyncio.AbstractEventLoop, again: float) -> None:
        """Once more a while later: what cancelled calls and closed connections hold is freed
        over the next seconds (a gRPC storm's buffers, answers still being sent)."""
        if again and not loop.is_closed():
            loop.call_later(self._after_s * again, self._start, loop, 0.0)
        else:
            self._pending = False


#: glibc's M_MMAP_THRESHOLD: allocations from this size up get their own mapping.
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 20
#: glibc's M_TRIM_THRESHOLD: free heap past this much at an arena's top goes back to the OS.
M_TRIM_THRESHOLD = -1
TRIM_THRESHOLD_BYTES = 4 << 20


def settle_allocator() -> None:
    """Fix glibc's mmap threshold at 1 MiB and its trim threshold at 4 MiB (no-op elsewhere).

    By default glibc raises the mmap threshold each time a large block is freed (up to 32 MB),
    so after a model's file passed through the heap, later request buffers of a few MB land in
    the heap too and stay resident once freed (+14 MB measured after one 4096-id embedding
    request). Fixed, every buffer from 1 MiB up is mapped alone and unmapped when freed.

    Fixing it also fixes the trim threshold, at glibc's 128 kB: every request's temporaries
    of a few hundred kB (the decoding step's and verification's chunks, kept below 1 MiB so
    they stay in the heap) were handed back when freed and faulted in again by the next
    (an 896 kB temporary: 0.30 ms against 0.03; the demo head's decoding step 11-12.7 ms
    against 9.7-10.2). At 4 MiB an arena keeps at most that much free at its top; an idle
    process hands it all back (``release_free_memory``).
    """
    libc = _glibc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None


def reset_peak() -> None:
    """Reset this process's resident high-water mark (VmHWM) to its current RSS (Linux)."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_resident_bytes(pid: int | str = "self") -> int:
    """A process's resident high-water mark since start or ``reset_peak`` (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")
