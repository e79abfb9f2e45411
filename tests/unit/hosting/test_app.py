"""In-process checks of the app factory, readiness and settings (no network, no subprocess)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import numpy as np
import numpy.typing as npt
import pytest
from fastapi import FastAPI
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from service.cli import main
from service.heads.files import HeadWeights, save_head
from service.heads.reference import output_projection_tied, top_k
from service.hosting.app import create_app
from service.metrics import Metrics
from service.plane.dataplane import DataPlane
from service.repository.registry import Registry
from service.settings import Settings, unknown_environment
from tests.conftest import D_MODEL


@asynccontextmanager
async def serving(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """Run the app's lifespan in-process and wait for start-up loading to finish."""
    async with app.router.lifespan_context(app):
        await app.state.loading
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            yield client


@pytest.fixture
def repository(tmp_path: Path, table: npt.NDArray[np.float32]) -> Path:
    save_head(HeadWeights.from_arrays(table), tmp_path / "tied" / "1")
    return tmp_path


def test_ready_is_503_until_the_repository_is_loaded(repository: Path) -> None:
    settings = Settings(repository=repository)
    app = create_app(settings)

    async def scenario() -> tuple[int, int, str]:
        with ThreadPoolExecutor(1) as executor:
            registry = Registry(settings, executor, Metrics())
            app.state.plane = DataPlane(registry, settings, Metrics())
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://localhost"
            ) as client:
                before = await client.get("/health/ready")
                live = await client.get("/health/live")
                body = {"hidden_states": [[0.5] * D_MODEL]}
                early = await client.post("/v1/models/tied/topk", json=body)
                await registry.load_all()
                after = await client.get("/health/ready")
                unknown = await client.post("/v1/models/nope/topk", json=body)
            await registry.close()
        # Before start-up loading has reached a model, it is not "not found": 503, retry.
        assert (early.status_code, early.headers["retry-after"]) == (503, "1")
        assert unknown.status_code == 404
        return before.status_code, after.status_code, before.json()["error"]["code"] + live.text

    before, after, detail = asyncio.run(scenario())
    assert (before, after) == (503, 200)
    assert detail.startswith("model_not_ready")


def test_in_process_topk_matches_reference(
    repository: Path, table: npt.NDArray[np.float32]
) -> None:
    hidden = np.random.default_rng(3).standard_normal((3, D_MODEL)).astype(np.float32)

    async def scenario() -> httpx.Response:
        async with serving(create_app(Settings(repository=repository))) as client:
            assert (await client.get("/health/ready")).status_code == 200
            body = {"hidden_states": hidden.tolist()}
            return await client.post("/v1/models/tied/topk", json=body)

    response = asyncio.run(scenario())
    ids = [result["token_ids"] for result in response.json()["results"]]
    expected = top_k(output_projection_tied(hidden.astype(np.float64), table), 5)[1]
    np.testing.assert_array_equal(ids, expected)


def test_empty_repository_is_ready_and_says_it_serves_nothing(tmp_path: Path) -> None:
    async def scenario() -> tuple[object, object]:
        async with serving(create_app(Settings(repository=tmp_path))) as client:
            ready = (await client.get("/health/ready")).json()
            return ready, (await client.get("/v1/models")).json()

    ready, models = asyncio.run(scenario())
    assert ready == {"status": "ready", "models": {}, "warning": "the repository has no models"}
    assert models == {"models": []}


def test_a_missing_repository_fails_start_up_and_readiness_says_why(tmp_path: Path) -> None:
    """(``lmhead serve`` refuses it before starting; an app made in code says so here.)"""
    path = tmp_path / "missing"

    async def scenario() -> tuple[int, str]:
        async with serving(create_app(Settings(repository=path))) as client:
            answer = await client.get("/health/ready")
            return answer.status_code, answer.json()["error"]["message"]

    status, message = asyncio.run(scenario())
    assert status == 503
    assert "start-up failed" in message
    assert "is not a directory" in message


def test_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMHEAD_PORT", "9123")
    monkeypatch.setenv("LMHEAD_MEMORY_MODE", "fast")
    settings = Settings()
    assert (settings.port, settings.memory_mode) == (9123, "fast")
    assert Settings(port=1).port == 1  # explicit values (CLI flags) win over the environment


def test_settings_fail_fast_on_inconsistent_values(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"LMHEAD_DEFAULT_K \(9\) must be <= LMHEAD_MAX_K"):
        Settings(default_k=9, max_k=3)
    with pytest.raises(ValidationError, match="memory_mode"):
        Settings(memory_mode="tiny")
    with pytest.raises(ValidationError, match="max_wait_ms"):
        Settings(max_wait_ms=-1)
    with pytest.raises(ValidationError, match=r"LMHEAD_MAX_QUEUE_ROWS \(8\) must be >= LMHEAD_MAX"):
        Settings(max_queue_rows=8, max_rows=16)  # a 16-row request would get 503 forever
    with pytest.raises(ValidationError, match="keep_alive_s"):
        Settings(keep_alive_s=float("inf"))
    with pytest.raises(ValidationError, match="LMHEAD_GRPC_PORT and LMHEAD_PORT are both 8000"):
        Settings(port=8000, grpc_port=8000)  # the fronts took both on one port: gRPC unreachable
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with pytest.raises(ValidationError, match="is not a writable directory"):
        Settings(scratch_dir=a_file)  # every version's copy would fail, the service "ready"
    empty = Settings(scratch_dir="", model_name="", grpc_port="")  # compose's ${VAR:-}: unset
    assert (empty.scratch_dir, empty.model_name, empty.grpc_port) == (None, None, None)
    for refused, field in [
        ({"repository": ""}, "must name a directory"),  # it served the working directory
        ({"repository": a_file}, "is not a directory"),
        ({"drain_timeout_s": float("inf")}, "drain_timeout_s"),  # a stop never ended
        ({"drain_timeout_s": 1e30}, "drain_timeout_s"),
        ({"header_timeout_s": float("inf")}, "header_timeout_s"),  # slow clients unbounded
        ({"body_timeout_s": float("inf")}, "body_timeout_s"),
        ({"intra_op_threads": 100_000}, "intra_op_threads"),  # 3.6 GB, deaf to SIGTERM
        ({"inference_threads": 100_000}, "inference_threads"),
    ]:
        with pytest.raises(ValidationError, match=field):
            Settings(**refused)  # type: ignore[arg-type]


def test_lmhead_variables_that_name_no_setting_are_found() -> None:
    environ = {"LMHEAD_ADMINTOKEN": "x", "LMHEAD_PORT": "1", "LMHEAD_DEBUG": "1", "HOME": "/"}
    assert unknown_environment(environ) == ["LMHEAD_ADMINTOKEN"]


def test_demo_heads_are_written_into_an_empty_repository_when_asked(tmp_path: Path) -> None:
    settings = Settings(repository=tmp_path / "models", create_demo_models=True)

    async def scenario() -> object:
        async with serving(create_app(settings)) as client:
            return (await client.get("/health/ready")).json()

    assert asyncio.run(scenario()) == {
        "status": "ready",
        "models": {"demo-tied": "READY", "demo-untied": "READY"},
    }
    assert (tmp_path / "models" / "demo-tied" / "1" / "vocab.txt").is_file()


def test_an_unexpected_error_is_a_generic_500_without_its_text(repository: Path) -> None:
    """Through FastAPI and through the raw-route dispatch alike: the text stays in the log."""
    app = create_app(Settings(repository=repository))

    @app.post("/v1/models/{name}/explode")
    async def through_fastapi(name: str) -> None:
        raise RuntimeError(f"secret detail about {name}")

    @app.post("/v2/models/{name}/explode-raw")
    async def raw(request: Request) -> Response:
        raise RuntimeError("secret detail, raw")

    async def scenario() -> list[httpx.Response]:
        async with serving(app) as client:
            return [
                await client.post("/v1/models/tied/explode"),
                await client.post("/v2/models/tied/explode-raw"),
            ]

    native, v2 = asyncio.run(scenario())
    assert native.status_code == v2.status_code == 500
    assert native.json() == {
        "error": {
            "code": "internal_error",
            "message": "internal error; the server log has the details",
        }
    }
    assert v2.json() == {"error": "internal error; the server log has the details"}


def test_an_invalid_environment_leaves_version_working_and_serve_says_why(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LMHEAD_PORT", "abc")
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert main(["serve"]) == 2
    assert "invalid settings: LMHEAD_PORT" in capsys.readouterr().err


def test_a_repository_that_is_a_file_is_refused_from_the_environment_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """LMHEAD_REPOSITORY gets the check --repository gets (it ended in NotADirectoryError);
    a flag that overrides it still works."""
    a_file = tmp_path / "models"
    a_file.write_text("not a repository")
    monkeypatch.setenv("LMHEAD_REPOSITORY", str(a_file))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["demo", "--vocab-size", "64", "--d-model", "8"]) == 2
    assert f"LMHEAD_REPOSITORY: {a_file} is not a directory" in capsys.readouterr().err
    assert list(elsewhere.iterdir()) == []  # not the default ./models instead
    assert (
        main(["demo", "--vocab-size", "64", "--d-model", "8", "--repository", str(tmp_path)]) == 0
    )
    assert (tmp_path / "demo-tied" / "1" / "model.onnx").is_file()


def test_client_chosen_names_are_not_kept(repository: Path) -> None:
    """A probe held 265 MB with 4096 POSTs to 32 KB paths (the route-match cache kept each),
    and unloads of unknown names each left a lock behind."""

    async def scenario() -> tuple[int, int, int]:
        app = create_app(Settings(repository=repository, admin_token="t"))
        async with serving(app) as client:
            long_name = "a" * 20000
            body = {"hidden_states": [[0.0] * D_MODEL]}
            answer = await client.post(f"/v1/models/{long_name}/topk", json=body)
            unloads = [
                await client.post(
                    f"/v2/repository/models/ghost{i}/unload",
                    headers={"authorization": "Bearer t"},
                )
                for i in range(20)
            ]
            registry = app.state.registry
            assert {u.status_code for u in unloads} == {404}
            cached = sum(len(path) > 256 for path in app._matched)  # type: ignore[attr-defined]
            return answer.status_code, cached, len(registry._locks)

    status, cached, locks = asyncio.run(scenario())
    assert status == 400  # the name is refused, and not remembered
    assert cached == 0
    assert locks <= 3  # the repository's own models


def test_start_up_without_a_usable_temp_directory_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only root filesystem: start-up failed, and wording its reason asked for the temp
    directory again, so readiness said "models are still loading" for good."""
    import tempfile

    def no_temp_directory() -> str:
        raise FileNotFoundError(2, "No usable temporary directory found")

    monkeypatch.setattr(tempfile, "gettempdir", no_temp_directory)

    async def scenario() -> tuple[int, str]:
        async with serving(create_app(Settings(repository=tmp_path))) as client:
            answer = await client.get("/health/ready")
            return answer.status_code, answer.json()["error"]["message"]

    save_head(HeadWeights.from_arrays(np.ones((8, 4), np.float32)), tmp_path / "m" / "1")
    status, message = asyncio.run(scenario())
    assert status == 503
    assert "No usable temporary directory" in message


def test_a_version_policy_naming_no_version_on_disk_says_so(tmp_path: Path) -> None:
    """It said "no version directory with a model.onnx" with version 1 right there."""
    save_head(HeadWeights.from_arrays(np.ones((8, 4), np.float32)), tmp_path / "m" / "1")
    (tmp_path / "m" / "config.json").write_text('{"versions": [7, 8]}')

    async def scenario() -> dict[str, object]:
        async with serving(create_app(Settings(repository=tmp_path))) as client:
            return dict((await client.get("/v1/models/m")).json())

    reason = asyncio.run(scenario())["reason"]
    assert reason == "config.json versions [7, 8] match none on disk ([1])"


def test_a_failed_load_by_call_leaves_a_lazy_service_ready(tmp_path: Path) -> None:
    """Readiness counts the models start-up loaded: with none (LMHEAD_LOAD_AT_START=false),
    one failed load call took the pod out of the Service its next call comes through."""
    (tmp_path / "broken" / "1").mkdir(parents=True)
    (tmp_path / "broken" / "1" / "model.onnx").write_bytes(b"not onnx")

    async def scenario() -> tuple[int, int]:
        settings = Settings(repository=tmp_path, load_at_start=False)
        async with serving(create_app(settings)) as client:
            loaded = await client.post("/v1/repository/models/broken/load")
            return loaded.status_code, (await client.get("/health/ready")).status_code

    assert asyncio.run(scenario()) == (400, 200)


def test_a_stop_drains_at_least_ten_seconds() -> None:
    """LMHEAD_DRAIN_TIMEOUT_S=0 (release replaced versions at once) cancelled every request
    in flight on SIGTERM with a 500."""
    from service.hosting.server import _options

    settings = Settings(drain_timeout_s=0)
    assert _options(settings, Metrics())["timeout_graceful_shutdown"] == 10
    assert _options(Settings(), Metrics())["timeout_graceful_shutdown"] == 30
