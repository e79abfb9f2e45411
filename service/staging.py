"""Directories being written or read by one process, locked while in use, so that what a
killed process left behind can be swept by the next one: the private copies a version loads
from (``repository.private_copy``) and the staging directories new versions are written in
(``importer.write_version``).

The lock is an ``flock`` on a file inside the directory, named only once held: a directory
whose lock file can be opened and locked is nobody's, whatever process or container made it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path
from typing import BinaryIO

LOCK_FILE = ".lmhead-lock"


def hold(directory: Path) -> BinaryIO:
    """Lock ``directory`` as in use until the returned file is closed."""
    lock = (directory / f"{LOCK_FILE}.new").open("wb")
    fcntl.flock(lock, fcntl.LOCK_EX)
    os.rename(directory / f"{LOCK_FILE}.new", directory / LOCK_FILE)  # once held, never before
    return lock


def release(directory: Path, lock: BinaryIO) -> None:
    """Unlock a directory that stays (a version about to be published): the lock file goes
    first, while held, so no sweeper can take it and remove the directory."""
    (directory / LOCK_FILE).unlink(missing_ok=True)
    lock.close()


def sweep(parent: Path, prefix: str) -> list[str]:
    """Remove the directories named ``prefix*`` in ``parent`` that nobody holds; their names.
    One without a lock file is left (being made, or released to be published)."""
    removed = []
    for entry in parent.glob(f"{prefix}*"):
        if entry.is_symlink() or not entry.is_dir():
            continue
        try:
            with (entry / LOCK_FILE).open("rb") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when closed
                if os.fstat(lock.fileno()).st_ino != (entry / LOCK_FILE).stat().st_ino:
                    continue  # released meanwhile (``release``): no longer stale
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry.name)
        except OSError:  # held (BlockingIOError), not ours to open, or no lock: in use
            continue
    return removed
