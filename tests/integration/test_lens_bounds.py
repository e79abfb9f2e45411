"""The logit lens within the service's bounds (issue 43, findings 1 and 2): an answer no budget
holds is refused before any run, a run that would pass LMHEAD_MAX_LOGITS_BYTES is refused, and
the memory a lens run took goes back once the service is idle, however small its body."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from service.heads.files import HeadWeights, save_head
from service.heads.norm import FinalNorm
from tests.server import peak_resident, poll, running_server, server_process

# Resident sets of a server, grown and given back (tests/conftest.py: the measure group).
pytestmark = pytest.mark.xdist_group("measure")

D_MODEL = 8
WIDE = 524_288  # the probe's vocabulary: one lens position of 512 layers is 1 GiB of logits


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lens-bounds")
    rng = np.random.default_rng(11)
    norm = FinalNorm("rms", np.ones(D_MODEL, np.float32), 1e-5)
    for name, vocab in (("small", 32_000), ("wide", WIDE)):
        table = rng.standard_normal((vocab, D_MODEL), dtype=np.float32)
        save_head(HeadWeights.from_arrays(table, norm=norm), root / name / "1")
    return root


@pytest.fixture(scope="module")
def url(repository: Path) -> Iterator[str]:
    with running_server(repository) as served:
        yield served


def _npy(*shape: int) -> bytes:
    states = np.random.default_rng(1).standard_normal(shape).astype(np.float16)
    stream = io.BytesIO()
    np.save(stream, states)
    return stream.getvalue()


def _lens(url: str, model: str, body: bytes, k: int) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/models/{model}/lens",
        params={"k": str(k)},
        content=body,
        headers={"content-type": "application/x-npy"},
        timeout=60,
    )


def test_a_lens_answer_no_budget_holds_is_refused_before_any_run(url: str) -> None:
    """The probe's 512 layers x 2048 tokens at k=1000 asked for a billion entries: admitted,
    it grew by 1.4 GB in 30 s and rising."""
    server = server_process(url)
    before = server.memory_info().rss
    refused = _lens(url, "small", _npy(512, 2048, D_MODEL), 1000)
    assert refused.status_code == 413
    message = refused.json()["error"]["message"]
    assert "LMHEAD_MAX_INFLIGHT_BYTES" in message
    assert "lens" in message
    assert server.memory_info().rss - before < 256 * 2**20  # the body, never the answer
    assert httpx.get(f"{url}/health/live").status_code == 200


def test_a_small_budget_refuses_a_small_body_asking_a_large_answer(repository: Path) -> None:
    """With a 64 MiB in-flight budget a 131 KB body took +535 MB (three at once, +1,160);
    this 262 KB body asks 16 million entries."""
    settings = {"max_logits_bytes": str(16 * 2**20), "max_inflight_bytes": str(64 * 2**20)}
    with running_server(repository, **settings) as small:
        refused = _lens(small, "small", _npy(64, 256, D_MODEL), 1000)  # runs of 8 MB
        assert refused.status_code == 413
        assert "LMHEAD_MAX_INFLIGHT_BYTES=67108864" in refused.json()["error"]["message"]
        fits = _lens(small, "small", _npy(8, 16, D_MODEL), 5)
        assert fits.status_code == 200, fits.text[:300]


def test_a_lens_run_past_the_logits_limit_is_refused(url: str) -> None:
    """(512, 1, 8) states on a 524,288-token head: one position's run holds every layer's
    logits, 1 GiB; /logits refuses as many rows by the same setting."""
    refused = _lens(url, "wide", _npy(512, 1, D_MODEL), 1)
    assert refused.status_code == 413
    assert "LMHEAD_MAX_LOGITS_BYTES" in refused.json()["error"]["message"]


def test_the_memory_of_a_lens_run_goes_back_once_idle(url: str) -> None:
    """A 16 KB body whose run held 120 x 524,288 logits (252 MB): the process kept them idle
    (the idle release waited for 64 MiB charged, and a lens charged nothing for its runs)."""
    server = server_process(url)
    assert _lens(url, "wide", _npy(2, 1, D_MODEL), 1).status_code == 200  # warm
    warm = server.memory_info().rss
    Path(f"/proc/{server.pid}/clear_refs").write_text("5")  # the peak from here on
    answer = _lens(url, "wide", _npy(120, 1, D_MODEL), 1)
    assert answer.status_code == 200, answer.text[:300]
    assert peak_resident(server) > warm + 200 * 2**20  # the run's logits were resident
    poll(
        lambda: True if server.memory_info().rss <= warm + 64 * 2**20 else None,
        "the idle service's memory to go back",
        timeout_s=20,
    )
