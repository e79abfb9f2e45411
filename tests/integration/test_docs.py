"""The README stays true: its settings table and benchmark headlines are generated from the
code and the results files, and its Python snippets run as written (against a real server
where they need one)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.readme import headlines
from service.settings import settings_table
from service.tools.demo import DemoSpec, write_demo_models
from tests.server import free_port, running_server

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
SNIPPETS = re.findall(r"```python\n(.*?)```", README, re.DOTALL)


def test_configuration_table_matches_the_settings_class() -> None:
    assert settings_table() in README


def test_benchmark_headlines_come_from_the_results_files() -> None:
    assert headlines() in README, "run `python -m bench.readme --write`"


def test_the_readme_stays_short() -> None:
    assert README.count("\n") < 400


def _run(code: str, cwd: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_heads_snippet_runs_as_written(tmp_path: Path) -> None:
    (snippet,) = [code for code in SNIPPETS if "save_head" in code]
    printed = _run(snippet, tmp_path)
    assert printed.strip() == "(2, 7, 5) (1, 3, 64)"
    assert (tmp_path / "models" / "my-tied" / "1" / "model.onnx").is_file()


@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if "localhost:8000" in s])
def test_client_snippets_run_against_a_server(tmp_path: Path, snippet: str) -> None:
    """The demo heads' shape (d_model 512), a smaller vocabulary to keep the test quick."""
    write_demo_models(tmp_path, DemoSpec(vocab_size=2000, d_model=512))
    with running_server(tmp_path) as url:
        printed = _run(snippet.replace("localhost:8000", url.removeprefix("http://")), tmp_path)
    assert "[[" in printed  # the arrays the snippet prints


@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if "localhost:8001" in s])
def test_grpc_snippets_run_against_a_server(tmp_path: Path, snippet: str) -> None:
    write_demo_models(tmp_path, DemoSpec(vocab_size=2000, d_model=512))
    port = free_port()
    with running_server(tmp_path, grpc_port=str(port)):
        printed = _run(snippet.replace("localhost:8001", f"127.0.0.1:{port}"), tmp_path)
    assert "[[" in printed
    assert printed.strip().endswith("True")  # demo-tied says it is tied
