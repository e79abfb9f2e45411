"""The kill rate of a `make mutants` run, from mutmut's stats (mutmut-cicd-stats.json).

A mutant the tests reach is killed (a test failed, or it ran past mutmut's timeout) or it
survived; mutants no selected test reaches are counted apart. bench/results-mutants.md says
which survivors are equivalent (no behaviour to catch) and the rate without them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(stats_file: str) -> None:
    stats = json.loads(Path(stats_file).read_text(encoding="utf-8"))
    killed = stats["killed"] + stats["timeout"]
    reached = killed + stats["survived"] + stats["suspicious"]
    print(
        f"mutants: {stats['total']}; the tests reach {reached}, kill {killed} "
        f"({killed / max(reached, 1):.1%}); {stats['survived']} survived, "
        f"{stats['no_tests']} reached by no selected test"
    )


if __name__ == "__main__":
    main(sys.argv[1])
