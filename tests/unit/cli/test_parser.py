"""``lmhead --help`` and each command's help: a one-line summary shown in both, a help text for
every argument, and every default said (never as "None")."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from service.cli import main
from service.cli.parser import build_parser
from service.settings import PlaceSettings
from service.tools.importer import EXTERNAL_DATA_ABOVE_BYTES

PLACE = PlaceSettings(repository=Path("models"), port=8000)
#: Options with nothing to default to: a choice between them, or a deprecated spelling.
NO_DEFAULT = {("retie", "--output"), ("demo", "--checkpoint"), ("import", "--version")}


def _commands() -> dict[str, argparse.ArgumentParser]:
    (subparsers,) = [
        action
        for action in build_parser(PLACE)._actions
        if isinstance(action, argparse._SubParsersAction)
    ]
    return dict(subparsers.choices)


def _summaries() -> dict[str, str]:
    (subparsers,) = [
        action
        for action in build_parser(PLACE)._actions
        if isinstance(action, argparse._SubParsersAction)
    ]
    return {action.dest: str(action.help) for action in subparsers._choices_actions}


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_every_command_has_one_summary_shown_in_both_helps(
    capsys: pytest.CaptureFixture[str],
) -> None:
    summaries = _summaries()
    assert set(summaries) == set(_commands())
    with pytest.raises(SystemExit):
        main(["--help"])
    top = _flat(capsys.readouterr().out)
    for name, summary in summaries.items():
        assert summary, name
        assert "\n" not in summary, name
        assert f"{name} {summary}" in top
        with pytest.raises(SystemExit):
            main([name, "--help"])
        own = _flat(capsys.readouterr().out)
        assert _commands()[name].description == summary
        assert summary in own, name


def _arguments() -> list[tuple[str, argparse.Action]]:
    return [
        (name, action)
        for name, command in _commands().items()
        for action in command._actions
        if not isinstance(action, argparse._HelpAction)
    ]


@pytest.mark.parametrize(
    ("command", "action"),
    _arguments(),
    ids=[f"{name} {action.dest}" for name, action in _arguments()],
)
def test_every_argument_has_help_and_every_default_is_said(
    command: str, action: argparse.Action
) -> None:
    assert action.help, (command, action.dest)
    assert action.help != argparse.SUPPRESS, (command, action.dest)
    assert "default: None" not in action.help
    flag = max(action.option_strings, key=len, default=None)
    optional = flag is not None and not action.required and action.nargs != 0
    if optional and (command, flag) not in NO_DEFAULT:
        assert "(default: " in action.help, (command, flag)
    if action.default not in (None, False):
        assert str(action.default) in action.help, (command, flag)


def test_shared_options_are_worded_once() -> None:
    helps: dict[str, set[str]] = {}
    for _, action in _arguments():
        helps.setdefault(max(action.option_strings, key=len, default=""), set()).add(
            str(action.help)
        )
    assert helps["--repository"] == {
        "the model repository (default: LMHEAD_REPOSITORY, now models)"
    }
    assert helps["--to-version"] == {"version to write (default: the next free version)"}
    assert all("(default: float32" in text for text in helps["--dtype"])
    assert helps["--block-size"] == {"values per scale (default: 128)"}


def test_version_reads_and_to_version_writes_in_every_command() -> None:
    for name in ("quantize", "trim"):
        options = {a.dest: a for a in _commands()[name]._actions}
        assert str(options["version"].help).startswith("version to read")
        assert str(options["to_version"].help).startswith("version to write")
    importer = {a.dest: a for a in _commands()["import"]._actions}
    assert "version" not in importer  # its --version fills deprecated_version
    assert "deprecated" in str(importer["deprecated_version"].help)


def test_serve_defaults_to_the_environment_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMHEAD_REPOSITORY", "/srv/heads")
    parsed = build_parser(PlaceSettings()).parse_args(["serve"])
    assert parsed.repository is None  # Settings reads LMHEAD_REPOSITORY, and checks it
    (action,) = [a for a in _commands()["serve"]._actions if a.dest == "repository"]
    assert action.help == "the model repository (default: LMHEAD_REPOSITORY, now models)"


def test_the_external_data_threshold_is_the_importers() -> None:
    (action,) = [a for a in _commands()["import"]._actions if a.dest == "external_data"]
    assert f"over {EXTERNAL_DATA_ABOVE_BYTES // 2**20} MiB" in str(action.help)
    assert re.search(r"\bMiB\)$", str(action.help))


def test_help_loads_no_onnx_and_no_safetensors() -> None:
    """Every front process of LMHEAD_WORKERS imports the command line again: the parser must
    stay light, though it names the demo checkpoints' sizes."""
    code = (
        "import sys\nfrom service.cli import main\ntry:\n    main(['--help'])\n"
        "except SystemExit:\n    pass\n"
        "print(sorted(m for m in ('onnx', 'onnxruntime', 'safetensors') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines()[-1] == "[]"
