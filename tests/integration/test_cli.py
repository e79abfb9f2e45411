"""The ``lmhead`` command as a user runs it: demo models on first run, then inspect."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from service import __version__
from service.heads.files import HeadWeights, save_head
from service.heads.graph import EMBEDDING_WEIGHT, OUTPUT_WEIGHT
from service.tools.demo import demo_tokens
from tests.conftest import initializers
from tests.server import free_port, running_server


def _lmhead(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service", *args], capture_output=True, text=True, check=True
    )


def _inspect(path: Path) -> dict[str, object]:
    report: dict[str, object] = json.loads(_lmhead("inspect", str(path), "--json").stdout)
    return report


def test_demo_writes_a_tied_and_an_untied_head_in_the_repository_layout(tmp_path: Path) -> None:
    out = _lmhead(
        "demo", "--repository", str(tmp_path), "--vocab-size", "600", "--d-model", "32"
    ).stdout
    assert "demo-tied" in out
    tied = _inspect(tmp_path / "demo-tied" / "1")
    untied = _inspect(tmp_path / "demo-untied" / "1" / "model.onnx")
    assert (tied["tied"], untied["tied"]) == (True, False)
    assert tied["vocab_size"] == untied["vocab_size"] == 600
    assert tied["d_model"] == untied["d_model"] == 32
    assert untied["duplicate"] is None
    for name in ("demo-tied", "demo-untied"):
        labels = (tmp_path / name / "1" / "vocab.txt").read_text(encoding="utf-8").splitlines()
        assert labels == demo_tokens(600)
        assert len(set(labels)) == 600


def test_untied_demo_shares_the_table_but_not_the_output_matrix(tmp_path: Path) -> None:
    _lmhead("demo", "--repository", str(tmp_path), "--vocab-size", "300", "--d-model", "16")
    (table,) = initializers(tmp_path / "demo-tied/1/model.onnx").values()
    untied = initializers(tmp_path / "demo-untied/1/model.onnx")
    embedding, output = untied[EMBEDDING_WEIGHT], untied[OUTPUT_WEIGHT]
    np.testing.assert_array_equal(embedding, table)
    correlation = np.corrcoef(embedding.ravel(), output.ravel())[0, 1]
    assert 0.7 < correlation < 0.9


def test_demo_is_made_once_and_seeded(tmp_path: Path) -> None:
    args = ("demo", "--repository", str(tmp_path), "--vocab-size", "300", "--d-model", "16")
    _lmhead(*args)
    model = tmp_path / "demo-tied" / "1" / "model.onnx"
    first = model.read_bytes()
    assert "already" in _lmhead(*args).stdout
    _lmhead(*args, "--force")
    assert model.read_bytes() == first


def test_default_demo_is_the_documented_size(tmp_path: Path) -> None:
    _lmhead("demo", "--repository", str(tmp_path))
    text = _lmhead("inspect", str(tmp_path / "demo-tied" / "1")).stdout
    assert "tied: one initializer feeds the Gather and the projection" in text
    assert "32000 x 512 float32" in text
    assert _inspect(tmp_path / "demo-untied" / "1")["weight_bytes"] == 2 * 32000 * 512 * 4


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )


def test_the_command_alone_prints_help_and_says_its_version() -> None:
    alone = _run()
    assert alone.returncode == 0
    assert "serve" in alone.stdout
    assert "import" in alone.stdout
    version = _run("--version")
    assert version.stdout.strip() == f"lmhead {__version__}"


def test_serve_refuses_flags_that_do_not_go_together() -> None:
    for flags, words in (
        (["--replicas", "2"], "go with --ray"),
        (["--ray", "--grpc-port", "8001"], "not under --ray"),
    ):
        refused = _run("serve", *flags)
        assert refused.returncode != 0
        assert words in refused.stderr
        assert "Traceback" not in refused.stderr
    refused = _run("serve", "--ray", env={"LMHEAD_WORKERS": "2"})
    assert refused.returncode != 0
    assert "without --ray" in refused.stderr


def test_serve_help_says_where_every_other_setting_comes_from() -> None:
    text = _run("serve", "--help").stdout.replace("\n", " ")
    assert "LMHEAD_MAX_ROWS" in text
    assert "LMHEAD_ADMIN_TOKEN" in text


def test_demo_writes_where_serve_serves(tmp_path: Path) -> None:
    done = _run(
        "demo", "--vocab-size", "300", "--d-model", "16", env={"LMHEAD_REPOSITORY": str(tmp_path)}
    )
    assert done.returncode == 0
    assert (tmp_path / "demo-tied" / "1" / "model.onnx").is_file()


def test_client_commands_report_an_absent_service_without_a_traceback(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    hidden = tmp_path / "h.npy"
    np.save(hidden, np.zeros((1, 16), np.float32))
    for args in (
        ("health", "--url", url),
        ("compare", "a", "b", "--hidden", str(hidden), "--url", url),
    ):
        done = _run(*args)
        assert done.returncode == 1, args
        assert "not reachable" in done.stderr
        assert "Traceback" not in done.stderr


def test_output_piped_into_a_closed_reader_is_not_an_error(tmp_path: Path) -> None:
    """`lmhead ... | head`: the reader may be gone before the answer is written (here `true`
    exits at once, long before Python has started): no traceback, exit 0."""
    _lmhead("demo", "--repository", str(tmp_path), "--vocab-size", "300", "--d-model", "16")
    model = tmp_path / "demo-tied" / "1"
    command = f"{sys.executable} -m service inspect --json {model} | true"
    done = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True)
    assert done.returncode == 0
    assert "Traceback" not in done.stderr
    assert "BrokenPipe" not in done.stderr


def test_an_untied_twin_made_on_purpose_is_not_called_a_broken_tie(tmp_path: Path) -> None:
    table = np.random.default_rng(0).standard_normal((50, 8)).astype(np.float32)
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    save_file({"wte.weight": table}, str(checkpoint / "model.safetensors"))
    (checkpoint / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    repository = tmp_path / "models"
    _lmhead("import", str(checkpoint), "--name", "twin", "--untie", "--repository", str(repository))
    text = _lmhead("inspect", str(repository / "twin" / "1")).stdout
    assert "untied twin" in text
    assert "broken tie" not in text


def test_serve_refuses_settings_under_which_no_model_could_ever_load(tmp_path: Path) -> None:
    env = {**os.environ, "LMHEAD_LOAD_AT_START": "false", "LMHEAD_CONTROL_MODE": "none"}
    command = [sys.executable, "-m", "service", "serve", "--repository", str(tmp_path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "no model could ever load" in done.stderr


def test_health_asks_its_own_service_never_a_proxy(tmp_path: Path) -> None:
    """With HTTP_PROXY set (as a host's may be) a ready service was reported unreachable;
    with LMHEAD_PORT invalid, port 8000 was asked instead, perhaps another service's."""
    table = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)
    save_head(HeadWeights.from_arrays(table), tmp_path / "head" / "1")
    with running_server(tmp_path) as url:
        _check_health(url)


def _check_health(url: str) -> None:
    closed = free_port()
    proxied = {**os.environ, "HTTP_PROXY": f"http://127.0.0.1:{closed}", "ALL_PROXY": ""}
    health = [sys.executable, "-m", "service", "health"]
    asked = [*health, "--url", url]
    done = subprocess.run(asked, env=proxied, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    invalid = {**os.environ, "LMHEAD_PORT": "abc"}
    done = subprocess.run(health, env=invalid, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1  # not 2: Docker reserves it in a health check
    assert "invalid settings: LMHEAD_PORT" in done.stderr
