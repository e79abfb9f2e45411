"""The data plane in-process (no HTTP): each inference rule, checked against the numpy reference.

Every front end goes through ``DataPlane``; these tests pin the rules it alone owns: lookup
and lease, rows / k / temperature / logits-bytes limits on every path, shadow sampling at the
request's temperature, call metrics, and the control API's guards.
"""

from __future__ import annotations

import asyncio
import fcntl
import gc
import json
import shutil
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import onnx
import pytest
from onnx import numpy_helper
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from service.errors import (
    Forbidden,
    InvalidInput,
    LogitsOverflow,
    ModelLoadFailed,
    ModelNotFound,
    PayloadTooLarge,
    ServiceError,
    Unauthorized,
    VersionNotFound,
)
from service.heads.files import HeadWeights, save_head
from service.heads.graph import OUTPUT_BIAS
from service.heads.reference import log_softmax, top_k
from service.messages import (
    CompareRequest,
    EmbedRequest,
    InferRequest,
    LogitsRequest,
    ModelStatus,
    ScoreRequest,
    Target,
    TopKRequest,
    VocabularyOptions,
)
from service.metrics import Metrics
from service.plane import grouping
from service.plane.comparison import kl_rows
from service.plane.dataplane import DataPlane
from service.repository.disk import LABELS_FILE
from service.repository.labels import TokenStrings
from service.repository.registry import Registry
from service.repository.staging import LOCK_FILE
from service.settings import Settings
from tests.conftest import D_MODEL, VOCAB, reference_logits

T = TypeVar("T")
TIED, UNTIED = Target("tied"), Target("untied")
LOGIT_ROWS = 8  # the logits byte limit below admits this many rows of one head


def _hidden(rows: int, seed: int = 0) -> npt.NDArray[np.float32]:
    return np.random.default_rng(seed).standard_normal((rows, D_MODEL)).astype(np.float32)


@pytest.fixture
def repository(
    tmp_path: Path, table: npt.NDArray[np.float32], output_weight: npt.NDArray[np.float32]
) -> Path:
    save_head(HeadWeights.from_arrays(table), tmp_path / "tied" / "1")
    save_head(HeadWeights.from_arrays(table, output_weight), tmp_path / "untied" / "1")
    save_head(HeadWeights.from_arrays(table), tmp_path / "twin" / "1")
    shadow = {"shadow": {"model": "twin", "fraction": 1.0}, "default_k": 4}
    (tmp_path / "tied" / "config.json").write_text(json.dumps(shadow))
    return tmp_path


def _settings(repository: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "repository": repository,
        "max_rows": 64,
        "max_k": 50,
        "max_logits_bytes": LOGIT_ROWS * VOCAB * 4,
    }
    return Settings(**(values | overrides))


@asynccontextmanager
async def _plane(settings: Settings) -> AsyncIterator[tuple[DataPlane, Metrics]]:
    metrics = Metrics()
    with ThreadPoolExecutor(1) as executor:
        registry = Registry(settings, executor, metrics)
        plane = DataPlane(registry, settings, metrics)
        await registry.load_all()
        try:
            yield plane, metrics
        finally:
            await plane.close()
            await registry.close()


def _run(settings: Settings, scenario: Callable[[DataPlane, Metrics], Awaitable[T]]) -> T:
    async def main() -> T:
        async with _plane(settings) as (plane, metrics):
            return await scenario(plane, metrics)

    return asyncio.run(main())


async def _each_alone(call: Callable[[Any], Awaitable[Any]], requests: list[Any]) -> list[Any]:
    """Each request sent by itself, one after another: its result or its service error."""
    outcomes: list[Any] = []
    for request in requests:
        try:
            outcomes.append(await call(request))
        except ServiceError as error:
            outcomes.append(error)
    return outcomes


def _sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("target", [TIED, UNTIED])
def test_topk_equals_the_reference_at_any_temperature(repository: Path, target: Target) -> None:
    hidden = _hidden(6).reshape(2, 3, D_MODEL)
    request = TopKRequest(target, hidden, k=7, temperature=0.6, logprobs=True)
    result = _run(_settings(repository), lambda plane, _: plane.topk(request))
    logits = reference_logits(repository / target.model / "1", hidden) / 0.6
    values, ids = top_k(logits, 7)
    np.testing.assert_array_equal(result.token_ids, ids)
    np.testing.assert_allclose(result.logits, values, rtol=1e-4, atol=1e-4)
    assert result.logprobs is not None
    expected = np.take_along_axis(log_softmax(logits), ids, axis=-1)
    np.testing.assert_allclose(result.logprobs, expected, rtol=1e-4, atol=1e-4)
    assert (result.head.name, result.head.version, result.head.tied) == (
        target.model,
        1,
        target == TIED,
    )


def test_k_defaults_to_the_model_and_is_bounded(repository: Path) -> None:
    async def scenario(plane: DataPlane, _: Metrics) -> list[int]:
        widths = [(await plane.topk(TopKRequest(TIED, _hidden(1)))).token_ids.shape[-1]]
        widths.append((await plane.topk(TopKRequest(UNTIED, _hidden(1)))).token_ids.shape[-1])
        for k in (0, 51):
            with pytest.raises(InvalidInput, match=r"k must be between 1 and 50 \(LMHEAD_MAX_K\)"):
                await plane.topk(TopKRequest(TIED, _hidden(1), k=k))
        with pytest.raises(InvalidInput, match="LMHEAD_MAX_K"):
            await plane.infer(InferRequest(TIED, _hidden(1), k=51))
        return widths

    assert _run(_settings(repository, default_k=6), scenario) == [4, 6]  # config, then setting


@pytest.mark.parametrize("temperature", [0.0, -1.0, 1e-45, 1e39, float("nan"), float("inf")])
def test_unsafe_temperatures_are_refused_on_every_path(
    repository: Path, temperature: float
) -> None:
    async def scenario(plane: DataPlane, _: Metrics) -> None:
        requests: list[Awaitable[Any]] = [
            plane.topk(TopKRequest(TIED, _hidden(1), temperature=temperature)),
            plane.logits(LogitsRequest(TIED, _hidden(1), temperature=temperature)),
            plane.infer(InferRequest(TIED, _hidden(1), temperature=temperature)),
        ]
        for request in requests:
            with pytest.raises(InvalidInput, match="temperature must be a number in"):
                await request

    _run(_settings(repository), scenario)


def test_rows_are_bounded_for_hidden_states_and_ids(repository: Path) -> None:
    async def scenario(plane: DataPlane, _: Metrics) -> None:
        with pytest.raises(PayloadTooLarge, match="65 rows; the limit is 64"):
            await plane.topk(TopKRequest(TIED, _hidden(65)))
        with pytest.raises(PayloadTooLarge, match="65 ids; the limit is 64"):
            await plane.embed(EmbedRequest(TIED, np.zeros(65, np.int64)))
        with pytest.raises(InvalidInput, match=r"input_ids must be in \[0, 997\)"):
            await plane.embed(EmbedRequest(TIED, np.array([VOCAB])))

    _run(_settings(repository), scenario)


def test_every_path_that_makes_full_logits_obeys_the_byte_limit(repository: Path) -> None:
    """/logits, V2 logits and compare (two heads) all count rows x vocab bytes; score runs in
    chunks within the limit, so it takes the rows the others refuse."""
    fits, too_many = _hidden(LOGIT_ROWS), _hidden(LOGIT_ROWS + 1)
    targets = np.zeros(LOGIT_ROWS + 1, np.int64)
    half = LOGIT_ROWS // 2

    async def scenario(plane: DataPlane, _: Metrics) -> None:
        assert (await plane.logits(LogitsRequest(TIED, fits))).logits.shape == (LOGIT_ROWS, VOCAB)
        refused: list[Awaitable[Any]] = [
            plane.logits(LogitsRequest(TIED, too_many)),
            plane.infer(InferRequest(TIED, too_many, full_logits=True)),
            plane.compare(CompareRequest(("tied", "untied"), _hidden(half + 1))),
        ]
        for request in refused:
            with pytest.raises(PayloadTooLarge, match="LMHEAD_MAX_LOGITS_BYTES"):
                await request
        compared = await plane.compare(CompareRequest(("tied", "untied"), _hidden(half)))
        assert compared.agreement["rows"] == half
        scored = await plane.score(ScoreRequest(TIED, too_many, targets))
        assert scored.rank.shape == (LOGIT_ROWS + 1,)
        top = await plane.infer(InferRequest(TIED, too_many))  # top-k only: no full logits
        assert top.topk is not None
        assert top.logits is None

    _run(_settings(repository), scenario)


def test_shadow_replays_at_the_request_temperature(repository: Path) -> None:
    """tied is shadowed by twin (the same weights): agreement must be total, KL zero."""
    hidden = _hidden(5, seed=4)

    async def scenario(plane: DataPlane, metrics: Metrics) -> None:
        for row in hidden:
            await plane.topk(TopKRequest(TIED, row[None, :], temperature=0.25))
        await plane.shadow_settled()
        registry = metrics.registry
        pair = {"primary": "tied", "shadow": "twin"}
        assert _sample(registry, "lmhead_shadow_requests_total", outcome="ran", **pair) == 5
        assert _sample(registry, "lmhead_shadow_top1_rows_total", agree="true", **pair) == 5
        assert _sample(registry, "lmhead_shadow_kl_sum", **pair) == pytest.approx(0, abs=1e-6)

    _run(_settings(repository), scenario)


def test_shadow_skips_requests_whose_logits_would_pass_the_limit(repository: Path) -> None:
    async def scenario(plane: DataPlane, metrics: Metrics) -> None:
        await plane.topk(TopKRequest(TIED, _hidden(LOGIT_ROWS)))  # primary + shadow: 2x
        await plane.topk(TopKRequest(TIED, _hidden(LOGIT_ROWS // 2)))
        await plane.shadow_settled()
        pair = {"primary": "tied", "shadow": "twin"}
        registry = metrics.registry
        assert _sample(registry, "lmhead_shadow_requests_total", outcome="too_large", **pair) == 1
        assert _sample(registry, "lmhead_shadow_requests_total", outcome="ran", **pair) == 1

    _run(_settings(repository), scenario)


def test_shadow_logits_equal_a_reference_kl(repository: Path, output_weight: Any) -> None:
    """A shadow with other weights: KL(primary || shadow) at the request temperature."""
    (repository / "tied" / "config.json").write_text(
        json.dumps({"shadow": {"model": "untied", "fraction": 1.0}})
    )
    hidden = _hidden(3, seed=9)

    async def scenario(plane: DataPlane, metrics: Metrics) -> float:
        await plane.topk(TopKRequest(TIED, hidden, temperature=2.0))
        await plane.shadow_settled()
        labels = {"primary": "tied", "shadow": "untied"}
        return _sample(metrics.registry, "lmhead_shadow_kl_sum", **labels)

    kl_sum = _run(_settings(repository), scenario)
    ours = reference_logits(repository / "tied" / "1", hidden) / 2.0
    theirs = reference_logits(repository / "untied" / "1", hidden) / 2.0
    assert kl_sum == pytest.approx(float(kl_rows(ours, theirs).sum()), rel=1e-3)


def test_lookup_errors_and_version_pinning(repository: Path, output_weight: Any) -> None:
    save_head(HeadWeights.from_arrays(output_weight), repository / "tied" / "2")
    (repository / "tied" / "config.json").write_text(json.dumps({"versions": "all"}))

    async def scenario(plane: DataPlane, metrics: Metrics) -> list[int]:
        versions = [
            (await plane.topk(TopKRequest(target, _hidden(1)))).head.version
            for target in (TIED, Target("tied", 1), Target("tied", 2))
        ]
        with pytest.raises(ModelNotFound):
            await plane.topk(TopKRequest(Target("nope"), _hidden(1)))
        with pytest.raises(VersionNotFound):
            await plane.topk(TopKRequest(Target("tied", 7), _hidden(1)))
        registry = metrics.registry
        labels = {"verb": "topk", "version": "1", "model": "tied", "outcome": "ok"}
        assert _sample(registry, "lmhead_requests_total", **labels) == 1
        unknown = {"verb": "topk", "version": "", "model": "", "outcome": "model_not_found"}
        assert _sample(registry, "lmhead_requests_total", **unknown) == 1
        missing = {"verb": "topk", "version": "", "model": "tied", "outcome": "version_not_found"}
        assert _sample(registry, "lmhead_requests_total", **missing) == 1
        with pytest.raises(ModelNotFound):  # the second model is the one missing
            await plane.compare(CompareRequest(("tied", "nope"), _hidden(1)))
        compared = {"verb": "compare", "version": "", "model": "", "outcome": "model_not_found"}
        assert _sample(registry, "lmhead_requests_total", **compared) == 1
        return versions

    assert _run(_settings(repository), scenario) == [2, 1, 2]


def test_a_version_whose_files_change_is_loaded_again_never_served_stale(
    repository: Path, output_weight: npt.NDArray[np.float32]
) -> None:
    """Same version number, new files: the next load serves the new weights, with a note."""
    hidden = _hidden(2, seed=5)

    async def scenario(plane: DataPlane, _: Metrics) -> tuple[Any, Any, ModelStatus]:
        before = (await plane.topk(TopKRequest(TIED, hidden))).token_ids
        staged = save_head(HeadWeights.from_arrays(output_weight), repository / "staged")
        shutil.copy(staged, repository / "tied" / "1" / "model.onnx")  # edited in place
        unchanged = (await plane.topk(TopKRequest(TIED, hidden))).token_ids
        np.testing.assert_array_equal(unchanged, before)  # the served copy is the process's
        described = await plane.load("tied")
        after = (await plane.topk(TopKRequest(TIED, hidden))).token_ids
        return before, after, described

    before, after, described = _run(_settings(repository), scenario)
    expected = top_k(reference_logits(repository / "tied" / "1", hidden), 4)[1]
    np.testing.assert_array_equal(after, expected)
    assert not np.array_equal(before, after)
    assert "version 1's files changed on disk: loaded again" in described.notes


def test_a_version_loaded_again_under_its_number_stays_in_the_loaded_gauge(
    repository: Path, table: npt.NDArray[np.float32], output_weight: npt.NDArray[np.float32]
) -> None:
    """The replaced copy leaves memory after its successor is in: it must not take the
    successor's ``lmhead_model_loaded`` series (model, version and tie are the same)."""

    async def main() -> list[float]:
        metrics = Metrics()
        with ThreadPoolExecutor(1) as executor:
            registry = Registry(_settings(repository), executor, metrics)
            await registry.load_all()
            labels = {"model": "tied", "version": "1", "tied": "true"}
            staged = save_head(HeadWeights.from_arrays(output_weight), repository / "staged")
            shutil.copy(staged, repository / "tied" / "1" / "model.onnx")
            await registry.load("tied")
            await registry.retired()
            loaded = _sample(metrics.registry, "lmhead_model_loaded", **labels)
            untied = save_head(HeadWeights.from_arrays(table, output_weight), repository / "u")
            shutil.copy(untied, repository / "tied" / "1" / "model.onnx")  # now untied
            await registry.load("tied")
            await registry.retired()
            retied = metrics.registry.get_sample_value("lmhead_model_loaded", labels)
            loaded += _sample(metrics.registry, "lmhead_model_loaded", **labels | {"tied": "false"})
            runs = {"model": "tied", "version": "1"}
            counted = metrics.registry.get_sample_value("lmhead_batch_rows_count", runs)
            await registry.unload("tied")
            await registry.retired()
            unloaded = metrics.registry.get_sample_value("lmhead_model_loaded", labels)
            left = metrics.registry.get_sample_value("lmhead_batch_rows_count", runs)
            await registry.close()
            return [loaded, retied is None, counted is not None, unloaded is None, left is None]

    # loaded again untied: the tied series goes, the run metrics (by version) stay; then all
    # go once unloaded (else each version published stays listed)
    assert asyncio.run(main()) == [2.0, True, True, True, True]


def test_runs_outside_the_batcher_are_in_the_run_metrics(repository: Path) -> None:
    """Score, embed and candidate runs skip the batcher; each is one run of one request."""
    hidden = _hidden(3, seed=21)
    allowed = VocabularyOptions(allowed_token_ids=np.array([1, 2]))

    async def scenario(plane: DataPlane, metrics: Metrics) -> list[float]:
        labels = {"model": "untied", "version": "1"}

        def count(name: str) -> float:
            return _sample(metrics.registry, name, **labels)

        counts = []
        for call in (
            lambda: plane.score(ScoreRequest(UNTIED, hidden, np.array([1, 2, 3]))),
            lambda: plane.embed(EmbedRequest(UNTIED, np.array([[4, 5]]))),
            lambda: plane.topk(TopKRequest(UNTIED, hidden, k=2, vocabulary=allowed)),
        ):
            before = count("lmhead_inference_duration_seconds_count")
            rows = count("lmhead_batch_rows_sum")
            await call()
            counts += [
                count("lmhead_inference_duration_seconds_count") - before,
                count("lmhead_batch_rows_sum") - rows,
            ]
        return counts

    assert _run(_settings(repository), scenario) == [1, 3, 1, 2, 1, 3]


def test_loads_meeting_an_unreadable_entry_fail_with_its_reason(repository: Path) -> None:
    """A link whose target cannot be looked at (ENAMETOOLONG here; EACCES for a user who may
    not search its directory): the load fails with a reason, never a 500 or LOADING for good."""
    (repository / "fresh").mkdir()
    (repository / "fresh" / "1").symlink_to("x" * 300)
    (repository / "tied" / "2").symlink_to("x" * 300)

    async def scenario(plane: DataPlane, _: Metrics) -> list[Any]:
        with pytest.raises(ModelLoadFailed, match="version '1' cannot be read") as failed:
            await plane.load("fresh")
        (repository / "stray").symlink_to("x" * 300)  # the model directory itself
        for pin in (None, 1):
            with pytest.raises(ModelLoadFailed, match="'stray' cannot be read"):
                await plane.load("stray", pin)
        with pytest.raises(ModelLoadFailed, match="version '2' cannot be read") as kept:
            await plane.load("tied")  # the policy's choice (2) failed: 1 serves on
        return [failed.value, (await plane.model("fresh")).state, kept.value]

    failed, state, kept = _run(_settings(repository), scenario)
    assert "File name too long" in failed.message
    assert state == "FAILED"
    assert "the previous version keeps serving" in kept.message


def test_a_served_version_broken_in_place_serves_on_under_every_policy(
    repository: Path, output_weight: npt.NDArray[np.float32]
) -> None:
    """``versions: all``: version 2 overwritten with garbage; its loaded copy serves on (no
    roll-back to 1 for unversioned calls) and the load says it failed."""
    save_head(HeadWeights.from_arrays(output_weight), repository / "untied" / "2")
    (repository / "untied" / "config.json").write_text(json.dumps({"versions": "all"}))

    async def scenario(plane: DataPlane, _: Metrics) -> list[Any]:
        before = await plane.topk(TopKRequest(UNTIED, _hidden(1)))
        (repository / "untied" / "2" / "model.onnx").write_bytes(b"not onnx")
        with pytest.raises(ModelLoadFailed, match="version 2: .*not a readable ONNX model"):
            await plane.load("untied")
        after = await plane.topk(TopKRequest(UNTIED, _hidden(1)))
        pinned = await plane.topk(TopKRequest(Target("untied", 2), _hidden(1)))
        return [before.head.version, after.head.version, pinned.head.version]

    assert _run(_settings(repository), scenario) == [2, 2, 2]


def test_start_up_removes_the_version_copies_nobody_loads_from(
    repository: Path, tmp_path: Path
) -> None:
    """A process killed mid-load leaves its private copy (a whole head): the next start
    removes it. A copy whose lock is held is loading (another server's, or another
    container's): it stays, as does one not locked yet."""
    scratch = tmp_path / "scratch"
    left, live, fresh = (scratch / f"lmhead-version-{tag}" for tag in ("left", "live", "fresh"))
    for copy in (left, live, fresh):
        copy.mkdir(parents=True)
        (copy / "model.onnx").write_bytes(b"x" * 1000)
    for copy in (left, live):
        (copy / LOCK_FILE).touch()

    async def scenario(plane: DataPlane, _: Metrics) -> None:
        assert (await plane.model("tied")).state == "READY"

    with (live / LOCK_FILE).open("rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        _run(_settings(repository, scratch_dir=scratch), scenario)
    assert sorted(path.name for path in scratch.iterdir()) == [fresh.name, live.name]


def test_a_head_whose_bias_masks_tokens_with_minus_inf_is_refused_at_load(
    repository: Path, table: npt.NDArray[np.float32]
) -> None:
    """-inf logits would answer as JSON null and read as overflow: refused with the reason
    at load, as the importer refuses such a bias (a padded vocabulary: ``lmhead trim``)."""
    bias = np.zeros(VOCAB, np.float32)
    path = save_head(HeadWeights.from_arrays(table, bias=bias), repository / "masked" / "1")
    model = onnx.load(str(path))
    (tensor,) = [t for t in model.graph.initializer if t.name == OUTPUT_BIAS]
    bias[-3:] = -np.inf
    tensor.CopyFrom(numpy_helper.from_array(bias, OUTPUT_BIAS))
    onnx.save(model, str(path))

    async def scenario(plane: DataPlane, _: Metrics) -> ModelStatus:
        return await plane.model("masked")

    described = _run(_settings(repository), scenario)
    assert described.state == "FAILED"
    assert "output bias masks tokens with -inf" in described.reason


def test_a_call_its_client_cancelled_is_recorded_as_cancelled(repository: Path) -> None:
    """A client gone (a gRPC deadline, a cancel): not an internal error of the service."""

    async def scenario(plane: DataPlane, metrics: Metrics) -> float:
        call = asyncio.get_running_loop().create_task(plane.topk(TopKRequest(TIED, _hidden(2))))
        await asyncio.sleep(0)  # one turn: the call is in, waiting for its run
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        labels = {"model": "tied", "version": "1", "verb": "topk"}
        assert (
            _sample(metrics.registry, "lmhead_requests_total", outcome="internal_error", **labels)
            == 0
        )
        return _sample(metrics.registry, "lmhead_requests_total", outcome="cancelled", **labels)

    assert _run(_settings(repository), scenario) == 1


def test_a_released_versions_call_counts_go_and_come_back_with_it(repository: Path) -> None:
    """Each version published added series to lmhead_requests_total for good; a version
    loaded again counts into new, visible ones."""

    async def scenario(plane: DataPlane, metrics: Metrics) -> list[float | None]:
        labels = {"model": "untied", "version": "1", "verb": "topk", "outcome": "ok"}
        seen = []
        for _ in range(2):
            await plane.topk(TopKRequest(UNTIED, _hidden(1)))
            seen.append(metrics.registry.get_sample_value("lmhead_requests_total", labels))
            await plane.unload("untied")  # returns once released
            seen.append(metrics.registry.get_sample_value("lmhead_requests_total", labels))
            await plane.load("untied")
        return seen

    assert _run(_settings(repository), scenario) == [1.0, None, 1.0, None]


def test_control_api_guards(repository: Path) -> None:
    async def guarded(plane: DataPlane, _: Metrics) -> None:
        plane.authorize("s3cret")
        for presented in (None, "", "wrong"):
            with pytest.raises(Unauthorized):
                plane.authorize(presented)

    _run(_settings(repository, admin_token=SecretStr("s3cret")), guarded)

    async def read_only(plane: DataPlane, _: Metrics) -> None:
        with pytest.raises(Forbidden, match="read-only"):
            await plane.load("tied")
        with pytest.raises(Forbidden, match="read-only"):
            await plane.unload("tied")
        assert (await plane.topk(TopKRequest(TIED, _hidden(1)))).head.version == 1

    _run(_settings(repository, read_only=True), read_only)


@pytest.mark.parametrize("target", [TIED, UNTIED])
def test_topk_calls_served_as_one_keep_their_own_answers_errors_and_metrics(
    repository: Path, target: Target
) -> None:
    """``topk_group`` (the engine's path for the calls a front sends together) answers each
    call as ``topk`` would alone: its rows' numbers, its own error, one metric per call."""
    nan = _hidden(1, seed=9)
    nan[0, 3] = np.nan
    hiddens: list[npt.NDArray[Any]] = [
        _hidden(1, seed=1),
        nan,
        _hidden(6, seed=2).reshape(2, 3, D_MODEL),
        _hidden(1, seed=3)[:, :-1],  # wrong d_model
        _hidden(65, seed=4),  # over max_rows
        _hidden(4, seed=5),
    ]
    requests = [TopKRequest(target, h, k=5, temperature=0.7, logprobs=True) for h in hiddens]

    async def scenario(plane: DataPlane, metrics: Metrics) -> list[Any]:
        grouped = await plane.topk_group(requests)
        await plane.shadow_settled()
        labels = {"model": target.model, "version": "1", "verb": "topk"}
        registry = metrics.registry
        assert _sample(registry, "lmhead_requests_total", outcome="ok", **labels) == 3
        assert _sample(registry, "lmhead_requests_total", outcome="invalid_input", **labels) == 2
        assert (
            _sample(registry, "lmhead_requests_total", outcome="payload_too_large", **labels) == 1
        )
        count = _sample(
            registry, "lmhead_request_duration_seconds_count", model=target.model, verb="topk"
        )
        assert count == 6
        alone = await _each_alone(plane.topk, requests)
        return list(zip(grouped, alone, strict=True))

    pairs = _run(_settings(repository), scenario)
    for hidden, (grouped, alone) in zip(hiddens, pairs, strict=True):
        if isinstance(alone, ServiceError):
            assert type(grouped) is type(alone)
            assert grouped.message == alone.message
            continue
        logits = reference_logits(repository / target.model / "1", hidden) / 0.7
        values, ids = top_k(logits, 5)
        np.testing.assert_array_equal(grouped.token_ids, ids)
        np.testing.assert_allclose(grouped.logits, values, rtol=1e-4, atol=1e-4)
        expected = np.take_along_axis(log_softmax(logits), ids, axis=-1)
        np.testing.assert_allclose(grouped.logprobs, expected, rtol=1e-4, atol=1e-4)
        assert grouped.logsumexp.shape == hidden.shape[:-1]
        np.testing.assert_array_equal(grouped.token_ids, alone.token_ids)
    assert [type(grouped).__name__ for grouped, _ in pairs] == [
        "TopKResult",
        "InvalidInput",
        "TopKResult",
        "InvalidInput",
        "PayloadTooLarge",
        "TopKResult",
    ]


def _overflowing(table: npt.NDArray[np.float32], sign: float = 1.0) -> npt.NDArray[np.float32]:
    """Three finite rows; row 1 points along token 0's row of W, so token 0's logit is
    1.2x float32's largest (sign 1) or its negative (sign -1), and no other logit passes it."""
    hidden = _hidden(3, seed=11)
    row = table[0].astype(np.float64)
    hidden[1] = (sign * 1.2 * float(np.finfo(np.float32).max) * row / (row @ row)).astype(
        np.float32
    )
    return hidden


def test_hidden_states_whose_logits_overflow_are_refused_on_every_path(
    repository: Path, table: npt.NDArray[np.float32]
) -> None:
    """Finite rows that make Inf logits get a 422 naming the row, never an answer of NaN or
    null; in a group of calls, only the call that sent them."""
    hidden = _overflowing(table)
    ok = _hidden(2, seed=12)
    small = _hidden(1, seed=13) * np.float32(1e35)  # finite logits, Inf at temperature 1e-4
    allowed = VocabularyOptions(allowed_token_ids=np.array([0, 5, 9]))

    async def scenario(plane: DataPlane, _: Metrics) -> list[Any]:
        calls: list[Callable[[], Awaitable[Any]]] = [
            lambda: plane.topk(TopKRequest(TIED, hidden, k=3)),
            lambda: plane.topk(TopKRequest(TIED, hidden, k=3, vocabulary=allowed)),
            lambda: plane.logits(LogitsRequest(TIED, hidden)),
            lambda: plane.score(ScoreRequest(TIED, hidden, np.array([1, 2, 3]))),
            lambda: plane.compare(CompareRequest(("tied", "twin"), hidden)),
            lambda: plane.topk(TopKRequest(UNTIED, small, temperature=1e-4)),
        ]
        refused = await _each_alone(lambda call: call(), calls)
        grouped = await plane.topk_group(
            [TopKRequest(TIED, h, k=3) for h in (ok, hidden, ok[::-1])]
        )
        return [refused, grouped]

    refused, grouped = _run(_settings(repository), scenario)
    assert [type(error).__name__ for error in refused] == ["LogitsOverflow"] * 6
    assert all("row 1 makes logits overflow" in error.message for error in refused[:-1])
    assert "row 0" in refused[-1].message
    assert "at temperature 0.0001" in refused[-1].message
    assert isinstance(grouped[1], LogitsOverflow)
    for result, rows in ((grouped[0], ok), (grouped[2], ok[::-1])):
        values, ids = top_k(reference_logits(repository / "tied" / "1", rows), 3)
        np.testing.assert_array_equal(result.token_ids, ids)
        np.testing.assert_allclose(result.logits, values, rtol=1e-4, atol=1e-4)


def test_only_answers_that_would_hold_inf_are_refused(
    repository: Path, table: npt.NDArray[np.float32]
) -> None:
    """Logits past float32 on the negative side only: the top-k (all finite) is answered,
    the full logits and the score of that token are not."""
    hidden = _overflowing(table, sign=-1.0)

    async def scenario(plane: DataPlane, _: Metrics) -> list[Any]:
        return await _each_alone(
            lambda call: call(),
            [
                lambda: plane.topk(TopKRequest(TIED, hidden, k=3, logprobs=True)),
                lambda: plane.logits(LogitsRequest(TIED, hidden)),
                lambda: plane.score(ScoreRequest(TIED, hidden, np.array([1, 0, 3]))),
            ],
        )

    topk, logits, score = _run(_settings(repository), scenario)
    assert np.isfinite(topk.logits).all()
    assert np.isfinite(topk.logprobs).all()
    assert isinstance(logits, LogitsOverflow)
    assert isinstance(score, LogitsOverflow)


def test_topk_calls_served_as_one_share_a_lookup_or_argument_error(repository: Path) -> None:
    async def scenario(plane: DataPlane, _: Metrics) -> list[list[Any]]:
        unknown = [TopKRequest(Target("nope"), _hidden(1)) for _ in range(3)]
        bad_k = [TopKRequest(TIED, _hidden(1, seed=i), k=0) for i in range(3)]
        return [await plane.topk_group(unknown), await plane.topk_group(bad_k)]

    unknown, bad_k = _run(_settings(repository), scenario)
    assert all(isinstance(outcome, ModelNotFound) for outcome in unknown)
    assert all(isinstance(outcome, InvalidInput) for outcome in bad_k)
    assert "k must be between 1 and 50" in bad_k[0].message


def test_topk_calls_too_many_rows_for_one_batch_are_queued_one_by_one(repository: Path) -> None:
    """A group of more than half a batch is not run as one entry (alone, if over a batch):
    each call is batched as it would be, and still gets its own rows' answer."""
    hiddens = [_hidden(2, seed=s) for s in range(3)]  # 6 rows; a batch takes 4, a group 2

    async def scenario(plane: DataPlane, metrics: Metrics) -> list[Any]:
        outcomes = await plane.topk_group([TopKRequest(UNTIED, h, k=3) for h in hiddens])
        labels = {"model": "untied", "version": "1"}
        runs = _sample(metrics.registry, "lmhead_batch_rows_count", **labels)
        up_to_4 = _sample(metrics.registry, "lmhead_batch_rows_bucket", le="4.0", **labels)
        assert runs >= 2
        assert up_to_4 == runs  # no run of more than one batch
        ok = {"model": "untied", "version": "1", "verb": "topk", "outcome": "ok"}
        assert _sample(metrics.registry, "lmhead_requests_total", **ok) == 3
        return list(outcomes)

    outcomes = _run(
        _settings(repository, max_batch_rows=4, max_logits_bytes=64 * VOCAB * 4), scenario
    )
    for hidden, outcome in zip(hiddens, outcomes, strict=True):
        logits = reference_logits(repository / "untied" / "1", hidden)
        np.testing.assert_array_equal(outcome.token_ids, top_k(logits, 3)[1])


def test_tokens_come_from_the_labels_file_and_are_none_past_it(repository: Path) -> None:
    """A labels file may stop short of the vocabulary (padded heads): those ids get None."""
    labels = [f"t{i}" for i in range(VOCAB - 100)]
    (repository / "untied" / "1" / LABELS_FILE).write_text("\n".join(labels) + "\n")
    hidden = _hidden(3, seed=6)

    async def scenario(plane: DataPlane, _: Metrics) -> Any:
        return await plane.topk(TopKRequest(UNTIED, hidden, k=VOCAB, tokens=True))

    result = _run(_settings(repository, max_k=VOCAB), scenario)
    assert result.tokens is not None
    for ids, tokens in zip(result.token_ids.tolist(), result.tokens, strict=True):
        assert tokens == [labels[i] if i < len(labels) else None for i in ids]
    assert any(token is None for token in result.tokens[0])


def test_an_unloaded_version_lets_its_label_table_go(repository: Path) -> None:
    """Answers hold their head's label table until read; once the version is unloaded and
    its answers are gone, nothing holds it (the split then drops it in the fronts too)."""
    (repository / "untied" / "1" / LABELS_FILE).write_text("\n".join(map(str, range(VOCAB))))

    async def scenario(plane: DataPlane, _: Metrics) -> weakref.ref[Any]:
        result = await plane.topk(TopKRequest(UNTIED, _hidden(2), k=3, tokens=True))
        assert isinstance(result.tokens, TokenStrings)
        assert result.tokens == [[str(i) for i in row] for row in result.token_ids.tolist()]
        table = weakref.ref(result.tokens.table)
        del result
        await plane.unload("untied")
        gc.collect()
        return table

    assert _run(_settings(repository), scenario)() is None


def test_topk_calls_are_not_served_as_one_with_batching_off(repository: Path) -> None:
    """``LMHEAD_BATCHING=false``: every call runs alone, grouped by a front or not."""

    async def scenario(plane: DataPlane, metrics: Metrics) -> None:
        calls = [TopKRequest(UNTIED, _hidden(1, seed=s), k=3) for s in range(3)]
        outcomes = await plane.topk_group(calls)
        assert all(not isinstance(outcome, Exception) for outcome in outcomes)
        labels = {"model": "untied", "version": "1"}
        assert _sample(metrics.registry, "lmhead_batch_rows_count", **labels) == 3
        assert _sample(metrics.registry, "lmhead_batch_rows_sum", **labels) == 3

    _run(_settings(repository, batching=False), scenario)


def test_topk_calls_served_as_one_are_each_sampled_for_the_shadow(repository: Path) -> None:
    """tied is shadowed by twin at fraction 1: each call of a group is a replay of its own."""

    async def scenario(plane: DataPlane, metrics: Metrics) -> None:
        calls = [TopKRequest(TIED, _hidden(1 + s, seed=s), temperature=0.5) for s in range(3)]
        await plane.topk_group(calls)
        await plane.shadow_settled()
        registry, pair = metrics.registry, {"primary": "tied", "shadow": "twin"}
        assert _sample(registry, "lmhead_shadow_requests_total", outcome="ran", **pair) == 3
        assert _sample(registry, "lmhead_shadow_top1_rows_total", agree="true", **pair) == 6
        assert _sample(registry, "lmhead_shadow_kl_sum", **pair) == pytest.approx(0, abs=1e-6)

    _run(_settings(repository), scenario)


def test_a_call_failing_on_a_bug_fails_alone() -> None:
    async def topk(request: TopKRequest) -> Any:
        if request.k == 2:
            raise RuntimeError("a bug")
        if request.k == 3:
            raise InvalidInput("bad")
        return request.k

    async def main() -> list[Any]:
        calls: list[Awaitable[Any]] = [
            topk(TopKRequest(TIED, _hidden(1), k=k)) for k in (1, 2, 3, 4)
        ]
        return await grouping.one_by_one(calls)

    outcomes = asyncio.run(main())
    assert outcomes[0] == 1
    assert outcomes[3] == 4
    assert type(outcomes[1]) is ServiceError
    assert outcomes[1].code == "internal_error"
    assert "a bug" not in outcomes[1].message
    assert isinstance(outcomes[2], InvalidInput)


def test_v2_infer_calls_served_as_one_answer_as_infer_alone(repository: Path) -> None:
    """Top-k-only V2 infer calls group like topk calls; each answer equals ``infer`` alone,
    and the calls are counted under the verb infer, with their own errors."""
    bad = _hidden(1, seed=7)[:, :-1]
    hiddens = [_hidden(1, seed=1), bad, _hidden(4, seed=2).reshape(2, 2, D_MODEL)]
    requests = [InferRequest(UNTIED, h, k=4, temperature=0.8, tokens=False) for h in hiddens]

    async def scenario(plane: DataPlane, metrics: Metrics) -> list[Any]:
        grouped = await plane.infer_group(requests)
        labels = {"model": "untied", "version": "1", "verb": "infer"}
        for outcome, calls in (("ok", 2), ("invalid_input", 1)):
            assert (
                _sample(metrics.registry, "lmhead_requests_total", outcome=outcome, **labels)
                == calls
            )
        alone = await _each_alone(plane.infer, requests)
        return list(zip(grouped, alone, strict=True))

    for grouped, alone in _run(_settings(repository), scenario):
        if isinstance(alone, ServiceError):
            assert (type(grouped), grouped.message) == (type(alone), alone.message)
            continue
        assert grouped.topk is not None
        assert alone.topk is not None
        np.testing.assert_array_equal(grouped.topk.token_ids, alone.topk.token_ids)
        np.testing.assert_allclose(grouped.topk.logprobs, alone.topk.logprobs, rtol=1e-5, atol=1e-5)
        assert (grouped.logits, grouped.embeddings) == (None, None)


def test_which_calls_may_be_served_as_one() -> None:
    hidden = _hidden(1)

    def key(method: str, request: object) -> object:
        return grouping.group_key(method, (request,))

    three = key("topk", TopKRequest(TIED, hidden, k=3))
    assert three == key("topk", TopKRequest(TIED, hidden * 2, k=3))
    assert three != key("topk", TopKRequest(TIED, hidden, k=4))
    assert three != key("topk", TopKRequest(Target("tied", 1), hidden, k=3))
    assert key("infer", InferRequest(TIED, hidden)) is not None
    assert key("infer", InferRequest(TIED, hidden)) != key("topk", TopKRequest(TIED, hidden))
    for alone in (
        InferRequest(TIED, hidden, input_ids=np.array([1])),
        InferRequest(TIED, hidden, full_logits=True),
        InferRequest(TIED, None, input_ids=np.array([1])),
    ):
        assert key("infer", alone) is None
    assert key("logits", LogitsRequest(TIED, hidden)) is None


def test_a_request_larger_than_a_batch_runs_in_batch_sized_runs(repository: Path) -> None:
    """Runs of ``max_batch_rows`` rows, not of the logits byte limit's larger count: between
    them, other requests' runs (other models' too) come in, so none waits for a whole big
    request; the answer is the same as one run's."""
    settings = _settings(
        repository, max_rows=1000, max_batch_rows=16, max_logits_bytes=2 * 64 * VOCAB * 4
    )  # the byte limit alone would run 64 rows at a time
    hidden = np.random.default_rng(9).standard_normal((100, D_MODEL), dtype=np.float32)

    async def scenario(plane: DataPlane, metrics: Metrics) -> tuple[float, float, Any]:
        result = await plane.topk(TopKRequest(TIED, hidden, k=3))
        labels = {"model": "tied", "version": "1"}
        runs = _sample(metrics.registry, "lmhead_batch_rows_count", **labels)
        larger = runs - _sample(metrics.registry, "lmhead_batch_rows_bucket", **labels, le="16.0")
        return runs, larger, result.token_ids

    runs, larger, ids = _run(settings, scenario)
    assert (runs, larger) == (7, 0)  # 100 rows: six runs of 16 and one of 4
    expected = top_k(reference_logits(repository / "tied" / "1", hidden), 3)[1]
    np.testing.assert_array_equal(ids, expected)
