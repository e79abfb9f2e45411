"""The docs stay true.

Every shell and Python snippet of README.md and docs/*.md runs as written: one fresh bash per
page, in a directory laid out as a checkout after the README's set-up (``.venv`` and a
``models/`` repository with the demo heads), with the README's ``source .venv/bin/activate``
first, against a live service started as ``make run`` starts it (the ``lmhead`` script). The
page's snippets run in their order, so a variable one sets (``tmp``) serves the next; ports
8000 and 8001 become the service's. A ``curl`` that gets an HTTP error fails the page, unless
its snippet is marked as showing errors.

A snippet is marked by an HTML comment on the line before its fence (invisible on GitHub):

- ``<!-- snippet: ci -->``: the two commands, ``make run`` and ``make test``, which CI runs
  itself (``.ci/run``) and which would run this test again;
- ``<!-- snippet: needs docker -->``, ``needs gpu``, ``needs ray`` (words may combine): skipped
  here; CI's docker stage and ``make ray-test`` run what they show;
- ``<!-- snippet: shows errors -->``: runs, and its requests are meant to be refused.

Generated tables (settings, benchmarks) equal their sources, every error code is documented,
and the README stays short.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench import lens_image
from bench.readme import README_ROWS, headlines
from service.api.routes.error_handlers import HTTP_CODES, HTTP_ERROR
from service.errors import ServiceError
from service.settings import settings_table
from service.tools.demo import write_demo_models
from tests.server import free_port, running_script

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = {"bash", "python"}
SKIPPED = {"docker", "gpu", "ray"}
FENCE = re.compile(r"^```(\S*)\n(.*?)^```\n", re.DOTALL | re.MULTILINE)
MARKER = re.compile(r"<!-- snippet: ([a-z ]+) -->\n$")


@dataclass(frozen=True)
class Snippet:
    page: str
    line: int
    language: str
    code: str
    marker: str

    def skipped(self) -> bool:
        words = set(self.marker.removeprefix("needs ").split())
        return self.marker == "ci" or (self.marker.startswith("needs ") and words <= SKIPPED)


def snippets(page: Path) -> list[Snippet]:
    text = page.read_text(encoding="utf-8")
    found = []
    for fence in FENCE.finditer(text):
        marked = MARKER.search(text, 0, fence.start())
        touching = marked is not None and marked.end() == fence.start()
        line = text.count("\n", 0, fence.start()) + 1
        marker = marked.group(1) if marked and touching else ""
        found.append(Snippet(page.name, line, fence.group(1), fence.group(2), marker))
    return found


def _script(page: list[Snippet], port: int, grpc_port: int) -> str:
    """The page as one bash session, each snippet announced (a failure names its line)."""
    lines = [
        "set -eo pipefail",
        "source .venv/bin/activate",  # the README's set-up
        'curl() { if [ "$SHOWS_ERRORS" = 1 ]; then command curl "$@";'
        ' else command curl --fail-with-body "$@"; fi; }',
    ]
    for snippet in page:
        if snippet.language not in RUN or snippet.skipped():
            continue
        code = snippet.code
        for old, new in {"8000": port, "8001": grpc_port}.items():
            code = re.sub(rf"\b(localhost|127\.0\.0\.1):{old}\b", f"127.0.0.1:{new}", code)
        lines.append(f"echo '### {snippet.page}:{snippet.line}' >&2")
        lines.append(f"SHOWS_ERRORS={int(snippet.marker == 'shows errors')}")
        if snippet.language == "python":
            code = f"python - <<'LMHEAD_SNIPPET'\n{code}LMHEAD_SNIPPET\n"
        lines.append(code)
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_snippet_runs_as_written(page: Path, tmp_path: Path) -> None:
    runnable = [s for s in snippets(page) if s.language in RUN and not s.skipped()]
    if not runnable:
        pytest.skip(f"{page.name} has no snippet that runs here")
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    write_demo_models(checkout / "models")
    grpc_port = free_port()
    with running_script(checkout / "models", grpc_port=str(grpc_port)) as url:
        port = int(url.rsplit(":", 1)[1])
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LMHEAD_", "VIRTUAL"))}
        env["LMHEAD_PORT"] = str(port)  # `lmhead compare` and `health` find the service
        done = subprocess.run(
            ["bash", "-c", _script(runnable, port, grpc_port)],
            cwd=checkout,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
    where = [line for line in done.stderr.splitlines() if line.startswith("### ")]
    assert done.returncode == 0, (
        f"the snippet at {where[-1][4:] if where else page.name} failed:\n"
        f"{done.stderr[-3000:]}\n{done.stdout[-2000:]}"
    )
    assert len(where) == len(runnable)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_snippet_says_its_language_and_markers_are_known(page: Path) -> None:
    """A fence without a language would be skipped unseen; a typo'd marker too."""
    for snippet in snippets(page):
        assert snippet.language, f"{page.name}:{snippet.line}: a fence without a language"
        if snippet.marker:
            words = set(snippet.marker.removeprefix("needs ").split())
            known = snippet.marker in ("ci", "shows errors") or words <= SKIPPED
            assert known, f"{page.name}:{snippet.line}: unknown marker {snippet.marker!r}"


def test_the_readme_is_short_and_usage_comes_first() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= 250
    long = [n for n, line in enumerate(lines, 1) if len(line) > 120 and not line.startswith("|")]
    assert not long, f"README lines over 120 characters: {long}"
    headings = [line for line in lines if line.startswith("## ")]
    assert headings[:2] == ["## Quick start: two commands", "## First requests"]
    for needed in ("source .venv/bin/activate", "curl -s localhost:8000/v1/models", "mktemp -d"):
        assert needed in text
    assert re.search(r"\{\"version\": 1\}.*# pin 1\n.*unpins", text)  # pin, then unpin


def test_relative_links_lead_to_files() -> None:
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            assert (page.parent / target).exists(), f"{page.name} links to {target}, missing"


def test_settings_table_matches_the_settings_class() -> None:
    assert settings_table() in (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")


def test_benchmark_tables_come_from_the_results_files() -> None:
    fix = "run `python -m bench.readme --write`"
    assert headlines() in (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8"), fix
    readme = headlines(only=README_ROWS, links="bench/")
    assert readme in (ROOT / "README.md").read_text(encoding="utf-8"), fix
    assert readme.count("\n| ") == len(README_ROWS) + 1  # every row named exists


def test_every_error_code_is_documented() -> None:
    """The service's error classes, the connection's own answers, and the web framework's
    (an unknown path, a method its path does not take: 405 was missing)."""
    errors = (ROOT / "docs" / "errors.md").read_text(encoding="utf-8")
    codes = {ServiceError.code, *(c.code for c in _subclasses(ServiceError))}
    codes |= {"malformed_request", "request_timeout", "headers_too_large", "not_implemented"}
    codes |= {"too_many_connections", *HTTP_CODES.values(), HTTP_ERROR}
    assert "method_not_allowed" in codes
    assert not {code for code in codes if f"`{code}`" not in errors}
    for status, code in HTTP_CODES.items():  # in the row of its status
        assert re.search(rf"^\| {status} \|.*`{code}`", errors, re.MULTILINE), code


def _subclasses(base: type[ServiceError]) -> list[type[ServiceError]]:
    return [c for sub in base.__subclasses__() for c in (sub, *_subclasses(sub))]


def test_the_lens_picture_says_which_command_made_it() -> None:
    """The README showed docs/lens.png under a snippet of random states, which draws noise:
    each page that shows the picture names the command that made it, whose default output
    is that very file."""
    made_by = f"python -m {lens_image.__name__}"
    for page, shown in (
        (ROOT / "README.md", "docs/lens.png"),
        (ROOT / "docs" / "lens.md", "lens.png"),
    ):
        text = page.read_text(encoding="utf-8")
        picture = text.index(f"]({shown})")
        before = text[text.rindex("```", 0, picture) : picture]  # since the last snippet
        assert made_by in before, page.name
        assert (page.parent / shown).resolve() == (ROOT / lens_image.OUTPUT).resolve()
