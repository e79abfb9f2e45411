"""CI's docker stage works in a repository of its own, whatever the developer's ./models
holds, and leaves nothing behind (it used to assert exactly the two demo models in ./models
and leave models/demo-tied/.incoming after a failure, failing every run after)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAGE = (ROOT / ".ci" / "docker").read_text(encoding="utf-8")
COMPOSE = (ROOT / "docker-compose.yml").read_text(encoding="utf-8")


def test_the_docker_stage_never_touches_the_developers_models() -> None:
    for line in STAGE.splitlines():
        code = line.split("#", 1)[0]
        for match in re.finditer(r"\S*models\S*", code):
            word = match.group(0)
            assert "$WORK" in word or "LMHEAD_MODELS" in word, f"{word!r} in: {line.strip()}"


def test_everything_the_stage_makes_is_removed_on_exit_failure_included() -> None:
    assert "trap cleanup EXIT" in STAGE
    start = STAGE.index("cleanup() {")
    cleanup = STAGE[start : STAGE.index("\n}\n", start)]
    assert 'rm -rf "$WORK"' in cleanup
    assert "down --volumes" in cleanup


def test_compose_mounts_the_repository_it_is_given() -> None:
    mounts = re.findall(r"- (\S+):/models", COMPOSE)
    assert mounts
    assert all(mount.startswith("${LMHEAD_MODELS:-./models}") for mount in mounts)
