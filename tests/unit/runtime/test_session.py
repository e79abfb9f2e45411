"""onnxruntime outputs equal the numpy reference computed from the file's own initializers."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnxruntime as ort
import pytest

from service.allocator import release_free_memory
from service.heads.files import HeadWeights, save_head
from service.heads.reference import log_softmax, logsumexp, top_k
from service.runtime.providers import (
    CPU,
    CUDA,
    MEMORY_MODES,
    provider_entries,
    select_providers,
    session_options,
)
from service.runtime.session import HeadSession
from service.settings import MemoryMode, ProviderChoice
from tests.conftest import D_MODEL, VOCAB, initializers, reference_logits

LEADING_SHAPES = [(1,), (5,), (2, 3), (2, 2, 3)]


def _open(path: Path, memory_mode: MemoryMode = "shared") -> HeadSession:
    return HeadSession(path, tied=len(initializers(path)) == 1, memory_mode=memory_mode)


@pytest.fixture(params=["tied", "untied"])
def head_path(request: pytest.FixtureRequest, tied_path: Path, untied_path: Path) -> Path:
    return tied_path if request.param == "tied" else untied_path


@pytest.mark.parametrize("memory_mode", MEMORY_MODES)
@pytest.mark.parametrize("leading", LEADING_SHAPES)
def test_projection_equals_reference(
    head_path: Path, memory_mode: MemoryMode, leading: tuple[int, ...]
) -> None:
    session = _open(head_path, memory_mode)
    hidden = np.random.default_rng(sum(leading)).standard_normal((*leading, D_MODEL))
    hidden = hidden.astype(np.float32)
    result = session.project(hidden, 7, full_logits=True)
    logits = reference_logits(head_path, hidden)
    values, ids = top_k(logits, 7)
    assert result.topk_token_ids.shape == (*leading, 7)
    np.testing.assert_array_equal(result.topk_token_ids, ids)
    np.testing.assert_allclose(result.topk_logits, values, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(result.logsumexp, logsumexp(logits), rtol=1e-5, atol=1e-4)
    expected_logprobs = np.take_along_axis(log_softmax(logits), ids, axis=-1)
    np.testing.assert_allclose(result.topk_logprobs, expected_logprobs, rtol=1e-4, atol=1e-4)
    assert result.logits is not None
    assert result.logits.shape == (*leading, VOCAB)
    np.testing.assert_allclose(result.logits, logits, rtol=1e-4, atol=1e-4)


def test_full_logits_are_only_returned_when_asked(tied_path: Path) -> None:
    result = _open(tied_path).project(np.ones((2, D_MODEL), np.float32), 3)
    assert result.logits is None


def test_temperature_scales_values_and_keeps_the_order(head_path: Path) -> None:
    session = _open(head_path)
    hidden = np.random.default_rng(9).standard_normal((4, D_MODEL)).astype(np.float32)
    plain = session.project(hidden, 10)
    hot = session.project(hidden, 10, temperature=2.5)
    np.testing.assert_array_equal(hot.topk_token_ids, plain.topk_token_ids)
    np.testing.assert_allclose(hot.topk_logits, plain.topk_logits / 2.5, rtol=1e-5, atol=1e-5)
    scaled = reference_logits(head_path, hidden) / 2.5
    expected = np.take_along_axis(log_softmax(scaled), hot.topk_token_ids, axis=-1)
    np.testing.assert_allclose(hot.topk_logprobs, expected, rtol=1e-4, atol=1e-4)


def test_k_is_clamped_to_the_vocabulary(tied_path: Path) -> None:
    result = _open(tied_path).project(np.ones((1, D_MODEL), np.float32), VOCAB + 50)
    assert result.topk_token_ids.shape == (1, VOCAB)
    assert sorted(result.topk_token_ids[0].tolist()) == list(range(VOCAB))


def test_ties_are_broken_toward_the_lower_token_id(tmp_path: Path) -> None:
    table = np.zeros((12, 4), np.float32)
    table[[2, 5, 9]] = [1.0, 0.0, 0.0, 0.0]  # three tokens with the same, highest logit
    table[[7, 11]] = [0.5, 0.0, 0.0, 0.0]
    session = HeadSession(save_head(HeadWeights.from_arrays(table), tmp_path), tied=True)
    result = session.project(np.array([[1.0, 0.0, 0.0, 0.0]], np.float32), 5)
    assert result.topk_token_ids.tolist() == [[2, 5, 9, 7, 11]]


def test_score_ranks_count_higher_logits_and_equal_ones_of_lower_ids(tmp_path: Path) -> None:
    """A target's rank: tokens scoring strictly higher, plus tied tokens with a lower id (the
    order top-k lists them in), so the rank is the target's place in the top-k list."""
    table = np.zeros((12, 4), np.float32)
    table[[2, 5, 9]] = [1.0, 0.0, 0.0, 0.0]  # three tokens with the same, highest logit
    table[[7, 11]] = [0.5, 0.0, 0.0, 0.0]  # then two; the other seven tie at 0
    session = HeadSession(save_head(HeadWeights.from_arrays(table), tmp_path), tied=True)
    targets = np.array([2, 5, 9, 7, 11, 0, 10])
    rows = np.tile(np.array([[1.0, 0.0, 0.0, 0.0]], np.float32), (len(targets), 1))
    scored = session.score(rows, targets, 5)
    assert scored.rank.tolist() == [0, 1, 2, 3, 4, 5, 11]
    listed = session.project(rows[:1], 12).topk_token_ids[0].tolist()
    assert [listed.index(t) for t in targets.tolist()] == scored.rank.tolist()


def test_embeddings_are_rows_of_the_gather_table(
    head_path: Path, table: npt.NDArray[np.float32]
) -> None:
    session = _open(head_path)
    ids = np.array([[0, 5, VOCAB - 1], [3, 3, 1]])
    embeddings = session.embed(ids)
    assert embeddings.shape == (2, 3, D_MODEL)
    np.testing.assert_array_equal(embeddings, table[ids])


def test_tied_embedding_and_projection_read_the_same_tensor(tied_path: Path) -> None:
    session = _open(tied_path)
    rows = session.embed(np.arange(VOCAB))
    hidden = np.random.default_rng(4).standard_normal((3, D_MODEL)).astype(np.float32)
    result = session.project(hidden, 1, full_logits=True)
    assert result.logits is not None
    np.testing.assert_allclose(result.logits, hidden @ rows.T, rtol=1e-4, atol=1e-4)


def test_float16_and_float64_hidden_states_are_accepted(tied_path: Path) -> None:
    session = _open(tied_path)
    hidden = np.random.default_rng(5).standard_normal((3, D_MODEL))
    expected = session.project(hidden.astype(np.float32), 4).topk_token_ids
    np.testing.assert_array_equal(session.project(hidden, 4).topk_token_ids, expected)
    half = session.project(hidden.astype(np.float16), 4)
    assert half.topk_token_ids.shape == (3, 4)


def test_bad_calls_raise_clear_errors(tied_path: Path) -> None:
    session = _open(tied_path)
    with pytest.raises(ValueError, match=rf"\(\.\.\., {D_MODEL}\), got shape \(2, 3\)"):
        session.project(np.ones((2, 3), np.float32), 1)
    with pytest.raises(ValueError, match="k must be >= 1"):
        session.project(np.ones((1, D_MODEL), np.float32), 0)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        session.project(np.ones((1, D_MODEL), np.float32), 1, temperature=0.0)
    with pytest.raises(ValueError, match=rf"\[0, {VOCAB}\), got values in \[-1, 4\]"):
        session.embed([4, -1])
    with pytest.raises(ValueError, match="must be integers"):
        session.embed([1.5])


def test_session_reports_its_shape_and_provider(head_path: Path) -> None:
    session = _open(head_path)
    assert (session.vocab_size, session.d_model) == (VOCAB, D_MODEL)
    assert session.providers == ["CPUExecutionProvider"]


@pytest.mark.parametrize(
    ("shares_weight", "memory_mode", "prepacking_disabled"),
    [(True, "shared", "1"), (False, "shared", ""), (True, "fast", ""), (False, "fast", "")],
)
def test_prepacking_is_disabled_only_where_it_would_copy_a_shared_weight(
    shares_weight: bool, memory_mode: MemoryMode, prepacking_disabled: str
) -> None:
    options = session_options(shares_weight=shares_weight, memory_mode=memory_mode)
    key = "session.disable_prepacking"
    if prepacking_disabled:
        assert options.get_session_config_entry(key) == prepacking_disabled
    else:
        with pytest.raises(RuntimeError, match="does not have configuration"):
            options.get_session_config_entry(key)


def test_unknown_memory_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="memory_mode must be one of"):
        session_options(shares_weight=True, memory_mode="tiny")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("choice", "available", "expected"),
    [
        ("cpu", [CUDA, CPU], (CPU,)),
        ("auto", [CUDA, CPU], (CUDA, CPU)),
        ("auto", [CPU], (CPU,)),
        ("cuda", [CUDA, CPU], (CUDA, CPU)),
        ("cuda", [CPU], (CPU,)),  # falls back, with a warning
    ],
)
def test_provider_selection_falls_back_to_cpu(
    choice: ProviderChoice, available: list[str], expected: tuple[str, ...]
) -> None:
    assert select_providers(choice, available) == expected


def test_a_cuda_request_runs_on_cuda_where_it_can_and_on_cpu_where_not(
    tied_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Whichever onnxruntime build is installed (the CPU one, or onnxruntime-gpu)."""
    providers = select_providers("cuda")
    session = HeadSession(tied_path, tied=True, providers=providers)
    if CUDA in ort.get_available_providers():
        assert session.providers[0] == CUDA
    else:
        assert "CUDA requested" in caplog.text
        assert session.providers == [CPU]
    assert session.project(np.ones((1, D_MODEL), np.float32), 2).topk_token_ids.shape == (1, 2)


@pytest.mark.parametrize("memory_mode", MEMORY_MODES)
def test_on_cuda_initializers_get_plain_device_allocations_in_every_mode(
    memory_mode: MemoryMode,
) -> None:
    """One copy of W on the device: no arena growth past the weights, no packed copy."""
    options = session_options(shares_weight=True, memory_mode=memory_mode, on_cuda=True)
    assert options.get_session_config_entry("session.use_device_allocator_for_initializers") == "1"
    with pytest.raises(RuntimeError, match="does not have configuration"):
        options.get_session_config_entry("session.disable_prepacking")


@pytest.mark.parametrize("tf32", [False, True])
def test_cuda_provider_options_follow_the_tf32_setting(tf32: bool) -> None:
    entries = provider_entries((CUDA, CPU), tf32)
    assert entries[1] == CPU
    name, cuda = entries[0]
    assert name == CUDA
    assert cuda["use_tf32"] == ("1" if tf32 else "0")
    assert cuda["arena_extend_strategy"] == "kSameAsRequested"


def test_a_session_that_could_not_start_cuda_says_so(
    tied_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """onnxruntime falls back to the CPU where CUDA cannot start (a driver too old for the
    wheel's CUDA): a GPU pod then served on its few CPUs, and nothing said so."""
    with warnings.catch_warnings():  # a CPU build of onnxruntime warns that it has no CUDA
        warnings.simplefilter("ignore", UserWarning)
        session = HeadSession(tied_path, tied=True, providers=(CUDA, CPU))
    if CUDA in session.providers:
        pytest.skip("CUDA started here: nothing fell back")
    assert f"{tied_path.parent.name}: CUDA was asked for but its session runs on the CPU" in (
        caplog.text
    )


def _anonymous_resident() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_the_arena_hands_back_what_a_big_run_left(tmp_path: Path) -> None:
    """onnxruntime's arena keeps the buffers of the largest run for good (malloc_trim cannot
    touch them): released, the process is back where it was, and the session still answers
    the same."""
    table = np.random.default_rng(0).standard_normal((8000, 64), dtype=np.float32)
    session = HeadSession(save_head(HeadWeights.from_arrays(table), tmp_path), tied=True)
    hidden = np.random.default_rng(1).standard_normal((2048, 64), dtype=np.float32)
    expected = session.project(hidden[:4], 5).topk_token_ids
    release_free_memory()
    before = _anonymous_resident()
    session.project(hidden, 1000, full_logits=True)  # ~130 MB of logits and log-softmax
    release_free_memory()
    held = _anonymous_resident() - before
    session.release_arena()
    release_free_memory()
    assert held > 64 * 2**20
    assert _anonymous_resident() - before < held // 4
    np.testing.assert_array_equal(session.project(hidden[:4], 5).topk_token_ids, expected)
