"""The control journal: what one engine's control calls leave for the engine started after it."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from service.heads.files import HeadWeights, save_head
from service.metrics import Metrics
from service.repository.journal import ControlJournal, Served
from service.repository.registry import Registry
from service.settings import Settings


def test_a_new_journal_plans_start_up_as_the_last_calls_left_it(tmp_path: Path) -> None:
    path = tmp_path / "control.json"

    async def calls() -> None:
        before = ControlJournal(path)
        await before.loaded("pinned", 1)
        await before.loaded("by-hand", None)
        await before.unloaded("dropped")
        await before.loaded("back", 2)
        await before.unloaded("back")
        await before.loaded("back", None)  # the last call wins

    asyncio.run(calls())
    load, unloaded = ControlJournal(path).plan(["pinned", "dropped", "untouched"])
    assert load == {
        "pinned": Served(1),
        "untouched": Served(),
        "by-hand": Served(),
        "back": Served(),
    }
    assert unloaded == ["dropped"]
    assert not list(tmp_path.glob("*.partial"))  # written whole, then renamed


def test_without_a_file_or_with_a_broken_one_start_up_is_as_settings_say(tmp_path: Path) -> None:
    broken = tmp_path / "control.json"
    broken.write_text('{"head": {"pin": 1}, "bad": "x"', encoding="utf-8")
    assert ControlJournal(broken).plan(["head"]) == ({"head": Served()}, [])
    entries = {
        "head": {"pin": 2, "versions": [1, 2]},
        "bad": "x",
        "worse": {"pin": 1.5},
        "flag": True,
        "odd": {"versions": ["1"]},
    }
    broken.write_text(json.dumps(entries), encoding="utf-8")
    expected = {"head": Served(2, (1, 2))}  # only well-formed entries
    assert ControlJournal(broken).plan([]) == (expected, [])
    assert ControlJournal(tmp_path / "absent.json").plan(["a"]) == ({"a": Served()}, [])
    assert ControlJournal().plan(["a"]) == ({"a": Served()}, [])  # one process: memory only


def _engines(
    repository: Path, journal: Path, *steps: Callable[[Registry], Awaitable[None]]
) -> None:
    """One registry (an engine) per step, each started from the journal the last one left."""

    async def main() -> None:
        with ThreadPoolExecutor(1) as executor:
            for step in steps:
                settings = Settings(repository=repository)
                registry = Registry(settings, executor, Metrics(), ControlJournal(journal))
                await registry.load_all()
                try:
                    await step(registry)
                finally:
                    await registry.close()

    asyncio.run(main())


def _head(repository: Path, name: str, version: int) -> None:
    table = np.random.default_rng(version).standard_normal((50, 8)).astype(np.float32)
    save_head(HeadWeights.from_arrays(table), repository / name / str(version))


def test_engines_started_again_follow_what_served_and_what_is_left_on_disk(
    tmp_path: Path,
) -> None:
    repository, journal = tmp_path / "models", tmp_path / "control.json"
    for name, version in [("pinned", 1), ("pinned", 2), ("gone", 1), ("polled", 1)]:
        _head(repository, name, version)

    async def first(registry: Registry) -> None:
        await registry.load("pinned", 1)
        await registry.load("polled", 1)
        _head(repository, "polled", 2)
        await registry.load("polled")  # a load without a version: unpinned, whoever pinned
        await registry.unload("gone")

    async def second(registry: Registry) -> None:
        assert registry.get("pinned").version == 1
        assert registry.get("polled").version == 2  # not the pin the poller's load replaced
        assert registry.record("gone").reason == "unloaded"
        shutil.rmtree(repository / "pinned" / "1")  # the pinned version goes
        shutil.rmtree(repository / "gone")  # and so does the unloaded model

    async def third(registry: Registry) -> None:
        assert registry.get("pinned").version == 2  # serving, not FAILED for an old pin
        assert not registry.knows("gone")  # absent, as for a new engine

    _engines(repository, journal, first, second, third)


def test_an_engine_started_again_serves_what_served_past_a_broken_version(
    tmp_path: Path,
) -> None:
    """Version 2 broke and version 1 served on; the next engine serves 1 too, not nothing."""
    repository, journal = tmp_path / "models", tmp_path / "control.json"
    _head(repository, "head", 1)

    async def first(registry: Registry) -> None:
        (repository / "head" / "2").mkdir()
        (repository / "head" / "2" / "model.onnx").write_bytes(b"not onnx")
        record = await registry.load("head")
        assert registry.get("head").version == 1
        assert "version 2" in record.reason

    async def second(registry: Registry) -> None:
        assert registry.get("head").version == 1
        record = registry.record("head")
        assert record.pinned is None  # not pinned: a fixed version 2 is taken when loaded
        assert "serve on, as before the engine restarted" in record.reason
        _head(repository, "head", 2)
        await registry.load("head")
        assert registry.get("head").version == 2

    _engines(repository, journal, first, second)


def test_a_pin_on_a_version_refused_for_now_stays_across_an_engine_restart(
    tmp_path: Path,
) -> None:
    """Pinned to 1; a copy "01" makes version 1 ambiguous. The next engine serves nothing
    rather than another version, keeps the pin, and serves 1 once the slip is gone."""
    repository, journal = tmp_path / "models", tmp_path / "control.json"
    _head(repository, "k", 1)
    _head(repository, "k", 2)

    async def first(registry: Registry) -> None:
        await registry.load("k", 1)
        shutil.copytree(repository / "k" / "1", repository / "k" / "01")

    async def second(registry: Registry) -> None:
        record = registry.record("k")
        assert (record.state, record.pinned, record.versions) == ("FAILED", 1, {})
        assert "are all version 1" in record.reason
        shutil.rmtree(repository / "k" / "01")
        await registry.reload("k")  # as the poller does once the directory changed
        assert (registry.get("k").version, registry.record("k").pinned) == (1, 1)

    _engines(repository, journal, first, second)


def test_a_slip_beside_an_old_version_does_not_block_the_next(tmp_path: Path) -> None:
    """Version 1 serves; "01" (a copy of it) and a good version 2 appear: 2 is taken, by the
    policy and by a pin (a refused served version blocked every load before)."""
    repository, journal = tmp_path / "models", tmp_path / "control.json"
    for name in ("m", "k"):
        _head(repository, name, 1)

    async def first(registry: Registry) -> None:
        await registry.load("k", 1)
        for name in ("m", "k"):
            shutil.copytree(repository / name / "1", repository / name / "01")
            _head(repository, name, 2)
        assert (await registry.load("m")).reason == ""
        assert registry.get("m").version == 2
        await registry.load("k", 2)
        assert (registry.get("k").version, registry.record("k").pinned) == (2, 2)

    _engines(repository, journal, first)
