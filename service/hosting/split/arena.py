"""Shared memory that tensors cross in: one anonymous file, mapped by a front and the engine.

The memory is a ``memfd`` (Linux; elsewhere a temporary file unlinked at once), handed to the
other process as a file descriptor over the Unix socket (``SCM_RIGHTS``). It never has a name,
so nothing can leak in ``/dev/shm``: the pages go when the last process mapping them exits,
whatever way it exits. The file is sized sparse: pages are touched only as tensors are written,
and a freed block of a megabyte or more is handed back to the kernel (``MADV_REMOVE``).

One side allocates in an arena (a front for requests, the engine for answers) and the other
only reads; the reader says when a block may be reused.
"""

from __future__ import annotations

import bisect
import mmap
import os
import tempfile

ALIGN = 64
#: Freed blocks this large give their pages back (a 32 MB logits answer should not stay resident).
RELEASE_BYTES = 1 << 20


class ArenaFull(RuntimeError):
    """No free block is large enough (the caller sends the bytes in the frame instead)."""


class Arena:
    """A mapped shared file with a first-fit allocator (used by the allocating side only)."""

    def __init__(self, fd: int, size: int) -> None:
        self.size = size
        self._map = mmap.mmap(fd, size)
        os.close(fd)  # the mapping keeps the memory; descriptors are opened again to be sent
        self.view = memoryview(self._map)
        self.readonly = self.view.toreadonly()
        self._starts: list[int] = [0]  # free blocks, sorted by offset
        self._lengths: dict[int, int] = {0: size}
        self._used: dict[int, int] = {}

    @classmethod
    def create(cls, size: int, name: str) -> tuple[Arena, int]:
        """A new arena and a descriptor of its file to send (the caller closes it)."""
        fd = _anonymous_file(name)
        os.ftruncate(fd, size)
        return cls(os.dup(fd), size), fd

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    def allocate(self, nbytes: int) -> int:
        """The offset of a free block of ``nbytes`` (rounded up), or ``ArenaFull``."""
        need = -(-max(nbytes, 1) // ALIGN) * ALIGN
        for index, start in enumerate(self._starts):
            length = self._lengths[start]
            if length < need:
                continue
            del self._lengths[start]
            if length == need:
                del self._starts[index]
            else:
                self._starts[index] = start + need
                self._lengths[start + need] = length - need
            self._used[start] = need
            return start
        raise ArenaFull(f"no free block of {need} bytes in a {self.size}-byte arena")

    def free(self, offset: int) -> None:
        """Return a block (unknown offsets are ignored: a stale release after a reconnect)."""
        length = self._used.pop(offset, None)
        if length is None:
            return
        if length >= RELEASE_BYTES:
            self._release_pages(offset, length)
        index = bisect.bisect(self._starts, offset)
        after = offset + length
        if after in self._lengths:  # merge with the next free block
            length += self._lengths.pop(after)
            del self._starts[index]
        if index > 0:
            before = self._starts[index - 1]
            if before + self._lengths[before] == offset:  # merge with the previous one
                self._lengths[before] += length
                return
        self._starts.insert(index, offset)
        self._lengths[offset] = length

    def _release_pages(self, offset: int, length: int) -> None:
        page = mmap.PAGESIZE
        start = -(-offset // page) * page
        stop = (offset + length) // page * page
        advice = getattr(mmap, "MADV_REMOVE", None)
        if advice is not None and stop > start:
            self._map.madvise(advice, start, stop - start)


def attach(fd: int, size: int) -> Arena:
    """Map the arena another process created (its allocator is unused on this side)."""
    return Arena(fd, size)


def _anonymous_file(name: str) -> int:
    if hasattr(os, "memfd_create"):
        return os.memfd_create(name, os.MFD_CLOEXEC)
    handle, path = tempfile.mkstemp(prefix=name)  # not Linux: unlinked at once, same effect
    os.unlink(path)
    return handle
