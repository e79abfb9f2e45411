"""Poll mode, driven scan by scan: a version is loaded only once its files stopped changing."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import numpy.typing as npt

from service.heads import MODEL_FILE
from service.heads.files import HeadWeights, save_head
from service.metrics import Metrics
from service.repository.poller import RepositoryPoller
from service.repository.registry import Registry
from service.settings import Settings

Scenario = Callable[[Registry, RepositoryPoller], Awaitable[None]]


def _run(repository: Path, scenario: Scenario, lazy: bool = False) -> None:
    async def main() -> None:
        with ThreadPoolExecutor(1) as executor:
            metrics = Metrics()
            settings = Settings(repository=repository, load_at_start=not lazy)
            registry = Registry(settings, executor, metrics)
            await registry.load_all()
            poller = RepositoryPoller(registry, repository, 1.0, metrics, lazy=lazy)
            await poller.prime()
            try:
                await scenario(registry, poller)
            finally:
                await registry.close()

    asyncio.run(main())


def _staged_copy(source: Path, target: Path) -> list[bytes]:
    """The model file of ``source`` split in chunks, with the other files copied already."""
    target.mkdir(parents=True)
    data = (source / MODEL_FILE).read_bytes()
    step = len(data) // 4 + 1
    return [data[i : i + step] for i in range(0, len(data), step)]


def test_a_copy_in_progress_is_never_loaded(
    tmp_path: Path, table: npt.NDArray[np.float32], output_weight: npt.NDArray[np.float32]
) -> None:
    repository = tmp_path / "models"
    save_head(HeadWeights.from_arrays(table), repository / "head" / "1")
    staging = save_head(HeadWeights.from_arrays(table, output_weight), tmp_path / "v2").parent
    chunks = _staged_copy(staging, repository / "head" / "2")

    async def scenario(registry: Registry, poller: RepositoryPoller) -> None:
        with (repository / "head" / "2" / MODEL_FILE).open("wb") as stream:
            for chunk in chunks:  # a slow copy: the file grows between every two scans
                stream.write(chunk)
                stream.flush()
                await poller.scan()
                assert registry.get("head").version == 1
                assert registry.record("head").failed == {}
        # The last scan in the loop saw the finished file once; unchanged in the next: complete.
        await poller.scan()
        served = registry.get("head")
        assert (served.version, served.tied) == (2, False)

    _run(repository, scenario)


def test_a_version_renamed_into_place_is_loaded_after_two_scans(
    tmp_path: Path, table: npt.NDArray[np.float32]
) -> None:
    repository = tmp_path / "models"
    save_head(HeadWeights.from_arrays(table), repository / "head" / "1")

    async def scenario(registry: Registry, poller: RepositoryPoller) -> None:
        incoming = repository / "head" / ".incoming"
        save_head(HeadWeights.from_arrays(table * 2), incoming)
        await poller.scan()
        await poller.scan()
        assert registry.get("head").version == 1  # hidden directories are not versions
        incoming.rename(repository / "head" / "3")
        await poller.scan()
        await poller.scan()
        assert registry.get("head").version == 3

    _run(repository, scenario)


def test_a_stalled_copy_fails_keeps_the_old_version_and_is_retried(
    tmp_path: Path, table: npt.NDArray[np.float32]
) -> None:
    repository = tmp_path / "models"
    save_head(HeadWeights.from_arrays(table), repository / "head" / "1")
    staging = save_head(HeadWeights.from_arrays(table * 3), tmp_path / "v2").parent
    chunks = _staged_copy(staging, repository / "head" / "2")
    model_file = repository / "head" / "2" / MODEL_FILE

    async def scenario(registry: Registry, poller: RepositoryPoller) -> None:
        model_file.write_bytes(chunks[0])  # the copy stalls for longer than two scans
        await poller.scan()
        await poller.scan()
        assert registry.get("head").version == 1
        assert "not a readable ONNX model" in registry.record("head").failed[2]
        model_file.write_bytes(b"".join(chunks))  # the copy finishes
        await poller.scan()
        await poller.scan()
        assert registry.get("head").version == 2

    _run(repository, scenario)


def test_a_removed_model_is_unloaded_and_a_new_one_loaded(
    tmp_path: Path, table: npt.NDArray[np.float32]
) -> None:
    repository = tmp_path / "models"
    save_head(HeadWeights.from_arrays(table), repository / "old" / "1")

    async def scenario(registry: Registry, poller: RepositoryPoller) -> None:
        shutil.rmtree(repository / "old")
        save_head(HeadWeights.from_arrays(table), repository / "new" / "1")
        await poller.scan()
        assert registry.record("old").state == "UNAVAILABLE"
        await poller.scan()
        assert registry.get("new").version == 1

    _run(repository, scenario)


def test_a_repository_that_is_gone_for_a_while_unloads_nothing(
    tmp_path: Path, table: npt.NDArray[np.float32]
) -> None:
    """Moved away and back (or re-linked): its absence is no model removed."""
    repository = tmp_path / "models"
    save_head(HeadWeights.from_arrays(table), repository / "kept" / "1")

    async def scenario(registry: Registry, poller: RepositoryPoller) -> None:
        repository.rename(tmp_path / "away")
        await poller.scan()
        await poller.scan()
        assert registry.get("kept").version == 1
        (tmp_path / "away").rename(repository)
        await poller.scan()
        assert registry.get("kept").version == 1

    _run(repository, scenario)


def test_started_empty_it_follows_only_the_models_asked_for(
    tmp_path: Path, table: npt.NDArray[np.float32]
) -> None:
    """LMHEAD_LOAD_AT_START=false (Ray Serve multiplexing): new versions of a model that was
    loaded on request are followed; one never asked for, or unloaded since, stays out."""
    repository = tmp_path / "models"
    for name in ("asked", "never", "evicted"):
        save_head(HeadWeights.from_arrays(table), repository / name / "1")

    async def scenario(registry: Registry, poller: RepositoryPoller) -> None:
        assert registry.records() == []
        await registry.load("asked")
        await registry.load("evicted")
        await registry.unload("evicted")
        for name in ("asked", "never", "evicted"):
            save_head(HeadWeights.from_arrays(table * 2), repository / name / "2")
        await poller.scan()
        await poller.scan()
        assert registry.get("asked").version == 2
        assert not registry.knows("never")
        assert registry.record("evicted").state == "UNAVAILABLE"

    _run(repository, scenario, lazy=True)


def test_version_directories_named_in_other_digits_are_ignored(
    tmp_path: Path, table: npt.NDArray[np.float32]
) -> None:
    """ "²" and "٣" are digits to ``str.isdigit`` but not numbers to ``int``: a careless copy
    named so is skipped by the load and by every scan, never a crash of either."""
    repository = tmp_path / "models"
    save_head(HeadWeights.from_arrays(table), repository / "head" / "1")
    for name in ("\u00b2", "\u0663", "9" * 40):
        save_head(HeadWeights.from_arrays(table * 2), repository / "head" / name)

    async def scenario(registry: Registry, poller: RepositoryPoller) -> None:
        assert registry.get("head").version == 1
        assert registry.record("head").versions.keys() == {1}
        save_head(HeadWeights.from_arrays(table * 3), repository / "head" / "2")
        await poller.scan()
        await poller.scan()
        assert registry.get("head").version == 2

    _run(repository, scenario)


async def _settle(poller: RepositoryPoller) -> None:
    """Two scans: a change is taken once it has stayed the same for one."""
    for _ in range(2):
        await poller.scan()


def _unreadable(path: Path) -> None:
    """An entry whose stat fails (ENAMETOOLONG), as a link into a directory the service may
    not search fails with EACCES for a user other than root."""
    path.symlink_to("x" * 300)


def test_an_unreadable_entry_fails_its_model_alone_and_the_others_are_followed(
    tmp_path: Path, table: npt.NDArray[np.float32], output_weight: npt.NDArray[np.float32]
) -> None:
    repository = tmp_path / "models"
    for name in ("a", "b", "c"):
        save_head(HeadWeights.from_arrays(table), repository / name / "1")
    _unreadable(repository / "stray")  # in the root: listed, fails alone

    async def scenario(registry: Registry, poller: RepositoryPoller) -> None:
        assert "cannot be read (File name too long)" in registry.record("stray").reason
        _unreadable(repository / "a" / "9")
        save_head(HeadWeights.from_arrays(table, output_weight), repository / "b" / "2")
        shutil.rmtree(repository / "c")
        await _settle(poller)
        assert registry.get("a").version == 1  # serving on; its unreadable version refused
        assert "version '9' cannot be read" in registry.record("a").failed[9]
        assert (registry.get("b").version, registry.get("b").tied) == (2, False)
        assert registry.record("c").state == "UNAVAILABLE"

    _run(repository, scenario)


def test_a_file_replaced_with_its_size_and_mtime_is_a_change(
    tmp_path: Path, table: npt.NDArray[np.float32], output_weight: npt.NDArray[np.float32]
) -> None:
    """``rsync -a`` or ``tar x`` of a file built at a fixed time: same size, same mtime, new
    bytes in a new file renamed over the old one (another inode)."""
    repository = tmp_path / "models"
    model = save_head(HeadWeights.from_arrays(table), repository / "head" / "1")
    other = save_head(HeadWeights.from_arrays(output_weight), tmp_path / "other" / "1")
    assert other.stat().st_size == model.stat().st_size

    async def scenario(registry: Registry, poller: RepositoryPoller) -> None:
        before = registry.get("head")
        incoming = model.with_name(".model.onnx.tmp")
        shutil.copy(other, incoming)
        os.utime(incoming, ns=(model.stat().st_atime_ns, model.stat().st_mtime_ns))
        os.replace(incoming, model)
        await _settle(poller)
        after = registry.get("head")
        assert after is not before
        assert "files changed on disk" in " ".join(registry.record("head").notes)

    _run(repository, scenario)


def test_a_hard_link_to_a_served_file_is_no_change(
    tmp_path: Path, table: npt.NDArray[np.float32]
) -> None:
    """Staging the next version with ``cp -al 1 .incoming`` links the served files: their
    ctime changes, their contents do not; nothing is loaded again."""
    repository = tmp_path / "models"
    model = save_head(HeadWeights.from_arrays(table), repository / "head" / "1")

    async def scenario(registry: Registry, poller: RepositoryPoller) -> None:
        before = registry.get("head")
        os.link(model, tmp_path / "linked.onnx")
        await _settle(poller)
        assert registry.get("head") is before

    _run(repository, scenario)


def test_removing_what_failed_a_load_tries_it_again(
    tmp_path: Path, table: npt.NDArray[np.float32]
) -> None:
    """A FIFO where the labels file goes failed its load; removing it changes no regular
    file. (A FIFO the head does not use is never opened: it fails nothing.)"""
    repository = tmp_path / "models"
    save_head(HeadWeights.from_arrays(table), repository / "head" / "1")
    fifo = repository / "head" / "1" / "vocab.txt"
    os.mkfifo(fifo)

    async def scenario(registry: Registry, poller: RepositoryPoller) -> None:
        assert "not a regular file" in registry.record("head").reason
        fifo.unlink()
        await _settle(poller)
        assert registry.get("head").version == 1

    _run(repository, scenario)


def test_pins_and_unloads_by_call_stand_while_the_poller_follows_the_disk(
    tmp_path: Path, table: npt.NDArray[np.float32], output_weight: npt.NDArray[np.float32]
) -> None:
    repository = tmp_path / "models"
    save_head(HeadWeights.from_arrays(table), repository / "head" / "1")
    save_head(HeadWeights.from_arrays(table, output_weight), repository / "head" / "2")
    save_head(HeadWeights.from_arrays(table), repository / "other" / "1")

    async def scenario(registry: Registry, poller: RepositoryPoller) -> None:
        await registry.load("head", 1)
        await registry.unload("other")
        (repository / "head" / "config.json").write_text('{"default_k": 3}')
        (repository / "other" / "1" / "notes.txt").write_text("changed")
        await _settle(poller)
        assert registry.get("head").version == 1  # still pinned, config taken
        assert registry.get("head").default_k == 3
        assert registry.record("other").reason == "unloaded"  # until a load by call
        shutil.rmtree(repository / "head" / "1")  # the pinned version goes: unpinned
        await _settle(poller)
        assert registry.get("head").version == 2

    _run(repository, scenario)


def test_a_model_removed_and_put_back_is_loaded_again(
    tmp_path: Path, table: npt.NDArray[np.float32]
) -> None:
    repository = tmp_path / "models"
    save_head(HeadWeights.from_arrays(table), repository / "head" / "1")

    async def scenario(registry: Registry, poller: RepositoryPoller) -> None:
        shutil.move(repository / "head", tmp_path / "away")
        await poller.scan()
        assert registry.record("head").reason == "removed from the repository"
        shutil.move(tmp_path / "away", repository / "head")
        await _settle(poller)
        assert registry.get("head").version == 1

    _run(repository, scenario)


def test_a_lazy_poller_leaves_a_pinned_load_pinned(
    tmp_path: Path, table: npt.NDArray[np.float32], output_weight: npt.NDArray[np.float32]
) -> None:
    """Started with nothing loaded: a model loaded by call is followed from then on, with
    its pin (two scans later it was loaded again unpinned, with no change on disk)."""
    repository = tmp_path / "models"
    save_head(HeadWeights.from_arrays(table), repository / "head" / "1")
    save_head(HeadWeights.from_arrays(table, output_weight), repository / "head" / "2")

    async def scenario(registry: Registry, poller: RepositoryPoller) -> None:
        await poller.scan()  # unheld: not followed
        await registry.load("head", 1)
        for _ in range(3):
            await poller.scan()
        assert (registry.get("head").version, registry.record("head").pinned) == (1, 1)

    _run(repository, scenario, lazy=True)


def test_a_reload_queued_behind_a_control_call_follows_what_that_call_left(
    tmp_path: Path, table: npt.NDArray[np.float32], output_weight: npt.NDArray[np.float32]
) -> None:
    """The poller's reload waits for the model's lock; the pin or the unload of the call
    that held it stands (they were read before waiting, and undone)."""
    repository = tmp_path / "models"
    save_head(HeadWeights.from_arrays(table), repository / "head" / "1")
    save_head(HeadWeights.from_arrays(table, output_weight), repository / "head" / "2")

    async def scenario(registry: Registry, _: RepositoryPoller) -> None:
        await asyncio.gather(registry.load("head", 1), registry.reload("head"))
        assert (registry.get("head").version, registry.record("head").pinned) == (1, 1)
        await asyncio.gather(
            registry.load("head"), registry.unload("head"), registry.reload("head")
        )
        assert registry.record("head").reason == "unloaded"

    _run(repository, scenario)
