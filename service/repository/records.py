"""A model's state as the registry publishes it: an immutable record, replaced whole on every
load, swap, failure or unload, so a request reading it never sees half a change."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property

from service.messages import IndexEntry, ModelStatus
from service.repository.loaded_version import LoadedVersion


class ModelState(StrEnum):
    LOADING = "LOADING"
    READY = "READY"
    FAILED = "FAILED"
    UNAVAILABLE = "UNAVAILABLE"


@dataclass(frozen=True)
class ModelRecord:
    """An immutable snapshot of one model; replaced whole, never edited."""

    name: str
    state: ModelState
    reason: str = ""
    versions: dict[int, LoadedVersion] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)
    pinned: int | None = None
    notes: tuple[str, ...] = ()

    @cached_property  # read on every request; the record never changes
    def latest(self) -> LoadedVersion | None:
        if self.pinned in self.versions:
            return self.versions[self.pinned]
        return self.versions[max(self.versions)] if self.versions else None

    def status(self) -> ModelStatus:
        """The model as the control calls answer it."""
        latest = self.latest
        return ModelStatus(
            name=self.name,
            state=self.state.value,
            reason=self.reason,
            versions=tuple(sorted(self.versions)),
            served_version=latest.version if latest else None,
            pinned_version=self.pinned,
            failed_versions=dict(sorted(self.failed.items())),
            notes=self.notes,
            served=latest.details() if latest else None,
        )

    def index_rows(self) -> list[IndexEntry]:
        """Triton's repository index: one row per version (or one for the model). A served
        version's row carries the model's reason, if its last load failed (a roll-out that
        did not happen shows in the index, not only in the model's description)."""
        rows = [IndexEntry(self.name, str(v), "READY", self.reason) for v in sorted(self.versions)]
        rows += [
            IndexEntry(self.name, str(v), "FAILED", reason)
            for v, reason in sorted(self.failed.items())
            if v not in self.versions
        ]
        if not rows:
            rows.append(IndexEntry(self.name, "", self.state.value, self.reason))
        return rows
