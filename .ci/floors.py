"""Print pip constraints pinning every runtime dependency of lmhead (and those of the ``cpu``
and ``grpc`` extras) at the lowest version pyproject.toml allows: ``make test-floors``
installs them, so the floors it declares are the versions its tests ran with, not hopes."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

REQUIREMENT = re.compile(r"^([A-Za-z0-9_.-]+)(\[[^]]*\])?>=([0-9][0-9A-Za-z.]*)")


def floors(pyproject: Path) -> list[str]:
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    pins = []
    extras = project["optional-dependencies"]
    for requirement in [*project["dependencies"], *extras["cpu"], *extras["grpc"]]:
        match = REQUIREMENT.match(requirement.replace(" ", ""))
        if match is None:
            sys.exit(f"no lower bound to pin in {requirement!r}")
        pins.append(f"{match.group(1)}=={match.group(3)}")
    return pins


if __name__ == "__main__":
    print("\n".join(floors(Path(__file__).resolve().parent.parent / "pyproject.toml")))
