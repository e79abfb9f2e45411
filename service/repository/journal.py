"""What serves, as the control API and the poller left it, for an engine started again.

With ``LMHEAD_WORKERS`` > 1 the supervisor restarts an engine that died, and a new engine
loads what the settings and the repository say. Without this record every load, pin and
unload made through the control API since start-up would be lost while readiness says 200:
an unloaded model would serve again, a head pinned to its tied version 1 would come back as
the untied version 2. The registry notes what serves after each load and unload here (whoever
asked: the control API, the poller, start-up), in a small JSON file in the supervisor's
private directory, and a new engine applies it to its start-up loading before it reports
ready. One process has nothing to hand on (when it ends, the service ends): its
journal lives in memory only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

logger = logging.getLogger("lmhead")
UNLOADED: Literal["unloaded"] = "unloaded"


@dataclass(frozen=True)
class Served:
    """A model as an engine left it: its pinned version (None: the policy's choice) and the
    versions it served, which a new engine falls back to when the policy's choice fails
    (a version broken on disk while the one before it served on)."""

    pin: int | None = None
    versions: tuple[int, ...] = ()


#: Per model: loaded (``Served``), or unloaded by a control call.
Wanted = Served | Literal["unloaded"]


class ControlJournal:
    """The last control call's outcome per model: loaded (pinned or not) or unloaded."""

    def __init__(self, path: Path | None = None) -> None:
        self._path = path
        self._wanted: dict[str, Wanted] = _read(path) if path is not None else {}
        self._saving = asyncio.Lock()

    async def loaded(self, name: str, pin: int | None, versions: tuple[int, ...] = ()) -> None:
        self._wanted[name] = Served(pin, versions)
        await self._save()

    async def unloaded(self, name: str) -> None:
        self._wanted[name] = UNLOADED
        await self._save()

    async def forget(self, name: str) -> None:
        """The model left the repository: a new engine treats it as the disk says."""
        if self._wanted.pop(name, None) is not None:
            await self._save()

    def plan(self, at_start: list[str]) -> tuple[dict[str, Served], list[str]]:
        """Start-up's models as the operator left them: those to load (with their pins and
        served versions), and those to keep unloaded."""
        load: dict[str, Served] = dict.fromkeys(at_start, Served())
        unloaded = []
        for name, wanted in self._wanted.items():
            if wanted == UNLOADED:
                load.pop(name, None)
                unloaded.append(name)
            else:
                load[name] = wanted
        return load, unloaded

    async def _save(self) -> None:
        if self._path is None:
            return
        async with self._saving:  # the text is taken inside: the last write holds the last call
            text = json.dumps(
                {
                    name: wanted if wanted == UNLOADED else asdict(wanted)
                    for name, wanted in self._wanted.items()
                }
            )
            try:
                await asyncio.to_thread(_write_whole, self._path, text)
            except OSError as error:  # the call itself succeeded; only a restart would miss it
                logger.error("could not write the control journal %s: %s", self._path, error)


def _read(path: Path) -> dict[str, Wanted]:
    """The journal an engine before this one wrote; empty when there is none (a first start)."""
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        logger.warning("ignoring the control journal %s: %s", path, error)
        return {}
    if not isinstance(found, dict):
        return {}
    return {
        name: parsed for name, wanted in found.items() if (parsed := _wanted(wanted)) is not None
    }


def _wanted(entry: Any) -> Wanted | None:
    """One well-formed entry, or None."""
    if entry == UNLOADED:
        return UNLOADED
    if not isinstance(entry, dict):
        return None
    pin, versions = entry.get("pin"), entry.get("versions", [])
    if not (pin is None or type(pin) is int) or not isinstance(versions, list):
        return None
    if not all(type(version) is int for version in versions):
        return None
    return Served(pin, tuple(versions))


def _write_whole(path: Path, text: str) -> None:
    """Replace the file in one step: a crash mid-write leaves the previous journal whole."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)
