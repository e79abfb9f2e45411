"""The control journal: what one engine's control calls leave for the engine started after it."""

from __future__ import annotations

import asyncio
from pathlib import Path

from service.journal import ControlJournal


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
    assert load == {"pinned": 1, "untouched": None, "by-hand": None, "back": None}
    assert unloaded == ["dropped"]
    assert not list(tmp_path.glob("*.partial"))  # written whole, then renamed


def test_without_a_file_or_with_a_broken_one_start_up_is_as_settings_say(tmp_path: Path) -> None:
    broken = tmp_path / "control.json"
    broken.write_text('{"head": 1, "bad": "x", "worse": 1.5', encoding="utf-8")
    assert ControlJournal(broken).plan(["head"]) == ({"head": None}, [])
    broken.write_text('{"head": 2, "bad": "x", "worse": 1.5, "flag": true}', encoding="utf-8")
    assert ControlJournal(broken).plan([]) == ({"head": 2}, [])  # only well-formed entries
    assert ControlJournal(tmp_path / "absent.json").plan(["a"]) == ({"a": None}, [])
    assert ControlJournal().plan(["a"]) == ({"a": None}, [])  # one process: memory only
