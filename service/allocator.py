"""glibc allocator settings every lmhead process applies (no-ops elsewhere), and the
resident high-water mark the memory measurements read (Linux).

Kept apart from ``service.tools.memory`` (the footprint measurements) so a front process, which
holds no head, applies them without importing onnxruntime.
"""

from __future__ import annotations

import ctypes
import gc
from pathlib import Path


def trim_heap() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise); no-op elsewhere."""
    gc.collect()
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


#: glibc's M_MMAP_THRESHOLD: allocations from this size up get their own mapping.
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 20


def settle_allocator() -> None:
    """Fix glibc's mmap threshold at 1 MiB (no-op elsewhere).

    By default glibc raises the threshold each time a large block is freed (up to 32 MB), so
    after a model's file passed through the heap, later request buffers of a few MB land in
    the heap too and stay resident once freed (+14 MB measured after one 4096-id embedding
    request). Fixed, every buffer from 1 MiB up is mapped alone and unmapped when freed.
    """
    libc = _glibc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


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
