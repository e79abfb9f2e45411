"""The split mode's verbs across a real socket, in one process: the engine's ``EngineServer``
over a ``DataPlane``, a front's ``RemotePlane`` connected to it. A verb called with keywords
answers as the same call does in one process, alone or beside others in one frame (the
engine groups top-k calls by their arguments); a wrong argument is the caller's
``TypeError``, as it is in one process, and never reaches the engine.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from service.hosting.engine import running_engine
from service.hosting.split.channel import arena_bytes
from service.hosting.split.engine_server import EngineServer
from service.hosting.split.remote_plane import RemotePlane, connected_plane
from service.messages import Target, TopKRequest, TopKResult
from service.metrics import Metrics
from service.plane.dataplane import DataPlane
from service.settings import Settings
from tests.conftest import D_MODEL

T = TypeVar("T")
HIDDEN = np.random.default_rng(44).standard_normal((3, 2, D_MODEL)).astype(np.float32)


@asynccontextmanager
async def _split(repository: Path) -> AsyncIterator[tuple[DataPlane, RemotePlane]]:
    """The engine's plane, and a front's plane forwarding to it over a Unix socket."""
    settings = Settings(repository=repository)
    # a short directory of its own: a socket's path must fit in 108 bytes
    with tempfile.TemporaryDirectory(prefix="lmhead-") as directory:
        path = str(Path(directory) / "engine.sock")
        async with running_engine(settings, Metrics()) as engine:
            await engine.loading
            server = EngineServer(engine.plane, path, arena_bytes(settings))
            server.start()
            try:
                async with connected_plane(path, settings) as remote:
                    yield engine.plane, remote
            finally:
                await server.close(drain_s=1.0)


def _run(repository: Path, scenario: Callable[[DataPlane, RemotePlane], Awaitable[T]]) -> T:
    async def main() -> T:
        async with _split(repository) as (local, remote):
            return await scenario(local, remote)

    return asyncio.run(main())


def _request(rows: np.ndarray[Any, Any], model: str = "tied") -> TopKRequest:
    return TopKRequest(target=Target(model=model), hidden_states=rows, k=4, logprobs=True)


def _same(got: TopKResult, expected: TopKResult) -> None:
    assert got.head == expected.head
    np.testing.assert_array_equal(got.token_ids, expected.token_ids)
    np.testing.assert_allclose(got.logits, expected.logits, rtol=1e-6)
    assert got.logprobs is not None
    assert expected.logprobs is not None
    np.testing.assert_allclose(got.logprobs, expected.logprobs, rtol=1e-6)


def test_an_inference_verb_takes_keywords_across_the_split(repository: Path) -> None:
    async def scenario(local: DataPlane, remote: RemotePlane) -> None:
        expected = await local.topk(request=_request(HIDDEN[0]))
        _same(await remote.topk(request=_request(HIDDEN[0])), expected)
        _same(await remote.topk(_request(HIDDEN[0])), expected)
        # one event-loop turn: the calls travel in one frame and the engine serves them as one
        answers = await asyncio.gather(*(remote.topk(request=_request(rows)) for rows in HIDDEN))
        for rows, got in zip(HIDDEN, answers, strict=True):
            _same(got, await local.topk(request=_request(rows)))

    _run(repository, scenario)


@pytest.mark.parametrize(
    ("verb", "keywords"),
    [
        ("model", {"name": "tied"}),
        ("versions", {"name": "untied"}),
        ("head", {"target": Target(model="untied", version=1)}),
        ("load", {"name": "untied", "version": 1}),
        ("load", {"version": None, "name": "tied"}),
    ],
)
def test_control_verbs_take_keywords_across_the_split(
    repository: Path, verb: str, keywords: dict[str, Any]
) -> None:
    async def scenario(local: DataPlane, remote: RemotePlane) -> tuple[Any, Any]:
        return await getattr(remote, verb)(**keywords), await getattr(local, verb)(**keywords)

    got, expected = _run(repository, scenario)
    assert got == expected


def test_a_wrong_argument_is_the_callers_type_error_as_in_one_process(repository: Path) -> None:
    async def scenario(local: DataPlane, remote: RemotePlane) -> None:
        for plane in (local, remote):
            with pytest.raises(TypeError, match="unexpected keyword argument 'model'"):
                await plane.versions("tied", model="tied")  # type: ignore[call-arg]
            with pytest.raises(TypeError, match="multiple values for argument 'name'"):
                await plane.versions("tied", name="tied")  # type: ignore[misc]
            with pytest.raises(TypeError, match="missing .*argument: 'name'"):
                await plane.load(version=1)  # type: ignore[call-arg]
        assert await remote.versions("tied") == await local.versions("tied")  # still connected

    _run(repository, scenario)
