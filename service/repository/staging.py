"""Directories in use, locked while they are, so that what a killed process left behind can
be swept by the next one: the private copies a version loads from (``private_copy``), the
staging directories new versions are written in (``write_whole``), and a split
service's private directory, which all its processes hold (``split.supervisor``).

A private copy is the one way a version's files are read, by the loader and by the commands
that make a version of another (``lmhead quantize``, ``lmhead trim``): ``bring_head`` copies
the files its head uses, each opened once, never through a link; nothing else of the version
is read.

The lock is an ``flock`` on a file inside the directory, named only once held: a directory
whose lock file can be opened and locked is nobody's, whatever process or container made it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from service.heads import MODEL_FILE
from service.repository.disk import (
    VOCAB_MAP_FILE,
    RepositoryError,
    Signature,
    open_regular,
    signature,
)
from service.repository.side_files import MAP_BYTES_PER_ROW, MAX_LABELS_BYTES

if TYPE_CHECKING:  # onnx stays out of the front processes, which hold directories only
    from service.heads.inspector import HeadReport

LOCK_FILE = ".lmhead-lock"
#: A new version's directory while it is written (hidden from the service and the poller).
STAGING_PREFIX = ".writing-"
#: A version's private copy, locked by its loader while it loads from it.
COPY_PREFIX = "lmhead-version-"
#: The largest graph onnx reads (protobuf's limit): a larger model.onnx is not copied at all.
MAX_MODEL_BYTES = 2**31


def hold(directory: Path, shared: bool = False) -> BinaryIO:
    """Lock ``directory`` as in use until the returned file is closed; ``shared``: others of
    the same service may hold it too (``join``)."""
    lock = (directory / f"{LOCK_FILE}.new").open("wb")
    fcntl.flock(lock, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
    os.rename(directory / f"{LOCK_FILE}.new", directory / LOCK_FILE)  # once held, never before
    return lock


def join(directory: Path) -> BinaryIO | None:
    """Hold ``directory`` (locked ``shared``) as in use too, until the returned file closes:
    the engine and fronts of a supervisor killed outright still use its directory while they
    drain. None if it is gone already."""
    try:
        lock = (directory / LOCK_FILE).open("rb")
    except OSError:
        return None
    fcntl.flock(lock, fcntl.LOCK_SH)
    return lock


def release(directory: Path, lock: BinaryIO) -> None:
    """Unlock a directory that stays (a version about to be published): the lock file goes
    first, while held, so no sweeper can take it and remove the directory."""
    (directory / LOCK_FILE).unlink(missing_ok=True)
    lock.close()


def write_whole(target: Path, write: Callable[[Path], None], replace: bool = False) -> None:
    """``write`` fills a directory beside ``target``, locked while written (the next call
    sweeps those a killed command left), renamed into place once whole: the poller never
    sees half of it, and a full disk leaves no half head that would count as present.
    ``replace``: an existing ``target`` goes then; else one there is a ``FileExistsError``.
    A parent made here and left empty by a failure goes too (the service would list an
    empty model directory as a failed model)."""
    parent = target.parent
    made = not parent.exists()
    parent.mkdir(parents=True, exist_ok=True)
    try:
        sweep(parent, STAGING_PREFIX)
        with tempfile.TemporaryDirectory(prefix=STAGING_PREFIX, dir=parent) as scratch:
            written = Path(scratch)
            lock = hold(written)
            try:
                write(written)
                os.chmod(written, 0o755)  # mkdtemp made it private
                release(written, lock)
                if replace and target.exists():
                    shutil.rmtree(target)
                _rename(written, target)
            finally:
                lock.close()
            written.mkdir()  # for the context manager to remove
    except BaseException:
        if made and not any(parent.iterdir()):
            parent.rmdir()
        raise


def _rename(written: Path, target: Path) -> None:
    try:
        os.rename(written, target)
    except OSError as error:  # another command wrote it meanwhile
        if target.exists():
            raise FileExistsError(
                errno.EEXIST, f"{target.name} was written meanwhile", str(target)
            ) from None
        raise error


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


class PrivateCopy:
    """A version's files, copied one by one into a directory nobody else can write
    (``private_copy``): only the files its head uses (``bring``), so another file in the
    version, however large or sparse, costs no scratch space."""

    def __init__(self, version_dir: Path, root: Path, path: Path, dir_fd: int) -> None:
        self.path = path
        self._version_dir = version_dir
        self._root = root
        self._dir_fd = dir_fd
        self._where = f"{version_dir.parent.name}/{version_dir.name}"

    def bring(self, name: str, most: int | None = None, refuse_past: int | None = None) -> bool:
        """Copy the version's file ``name``, False when it has none: opened once, beside the
        model, without following a link, checked through the open file and copied from it.
        ``most``: copy at most this many bytes (what the head reads of the file);
        ``refuse_past``: a larger file is refused before anything is copied."""
        where = f"{self._where}/{name}"
        opened = open_regular(self._version_dir, name, self._root, where, self._dir_fd)
        if opened is None:
            return False
        with opened, (self.path / name).open("xb") as copy:
            size = os.fstat(opened.fileno()).st_size
            if refuse_past is not None and size > refuse_past:
                raise RepositoryError(f"{where} has {size} bytes; at most {refuse_past}")
            _copy(opened, copy, size if most is None else min(most, size))
        return True

    def bring_head(self, labels: str) -> HeadReport:
        """Copy what the head uses, reading its graph once: the graph says which data files it
        needs and how much of each; the inspector says how large its vocabulary is, which
        bounds its id map. ``labels``: the labels file's name (``ModelConfig.labels``)."""
        # Imported here: the fronts of LMHEAD_WORKERS hold directories with this module
        # (``hold``) and never load onnx.
        from service.heads.external import external_extents
        from service.heads.inspector import inspect_head, read_model

        if not self.bring(MODEL_FILE, refuse_past=MAX_MODEL_BYTES):
            raise RepositoryError(f"{MODEL_FILE} is gone from the version")
        model = read_model(self.path / MODEL_FILE)
        for location, extent in external_extents(model).items():
            self.bring(location, most=extent)
        report = inspect_head(self.path / MODEL_FILE, model)
        self.bring(labels, refuse_past=MAX_LABELS_BYTES)
        self.bring(VOCAB_MAP_FILE, refuse_past=MAP_BYTES_PER_ROW * report.vocab_size + 1024)
        return report

    def check_unchanged(self, expected: Signature) -> None:
        """Fail the load if the version's files changed while they were copied (``expected``:
        ``ModelSource.files`` as scanned): never a mix of two versions."""
        if signature(self._version_dir) != expected:
            raise RepositoryError(
                f"the files of {self._where} changed while being loaded; publish a version by "
                "renaming a complete directory into place"
            )


@contextmanager
def private_copy(version_dir: Path, root: Path, into: Path | None = None) -> Iterator[PrivateCopy]:
    """A directory nobody else can write, for the files of ``version_dir`` the loader brings
    (``PrivateCopy.bring``); removed on exit.

    Load from the copy, then let it go: onnxruntime keeps what it mapped (an unlinked file
    stays readable while mapped), and no later write to the repository reaches it. Only
    regular files are copied, each opened once relative to the version's directory (itself
    inside the repository: ``disk`` checks it as it scans, and it is checked again here once
    open), never through a link: a FIFO would block the loader, a link would serve a file
    nobody put in the repository.
    """
    target = Path(tempfile.mkdtemp(prefix=COPY_PREFIX, dir=into))
    lock = hold(target)  # in use: ``sweep_stale_copies`` leaves it
    dir_fd = -1
    try:
        dir_fd = os.open(version_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        _check_open_inside(dir_fd, version_dir, root)
        yield PrivateCopy(version_dir, root, target, dir_fd)
    finally:
        if dir_fd >= 0:
            os.close(dir_fd)
        shutil.rmtree(target, ignore_errors=True)
        lock.close()


def _check_open_inside(dir_fd: int, version_dir: Path, root: Path) -> None:
    """The directory opened is inside the repository (where the system names open files: a
    directory swapped for a link after the scan is caught here)."""
    opened = Path(f"/proc/self/fd/{dir_fd}")
    if opened.exists() and not opened.resolve().is_relative_to(root):
        raise RepositoryError(
            f"{version_dir.parent.name}/{version_dir.name} resolves outside the repository"
        )


def _copy(source: BinaryIO, target: BinaryIO, size: int) -> None:
    """``size`` bytes from ``source``'s position, by the kernel where it can (``sendfile``)."""
    left = size
    try:
        while left > 0:
            sent = os.sendfile(target.fileno(), source.fileno(), None, min(left, 1 << 30))
            if sent == 0:
                return
            left -= sent
    except OSError as error:  # no sendfile between these files: copy through the process
        if error.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
        while left > 0:
            chunk = source.read(min(left, 1 << 20))
            if not chunk:
                return
            target.write(chunk)
            left -= len(chunk)


def sweep_stale_copies(into: Path | None) -> list[str]:
    """Remove the version copies left by processes killed mid-load (no ``finally`` ran; each
    holds a whole head): a copy in use is locked."""
    return sweep(into or Path(tempfile.gettempdir()), COPY_PREFIX)
