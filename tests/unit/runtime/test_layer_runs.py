"""One lens run against the float64 reference: every layer's top-k log-probs, entropy, KL to
the last layer, and the targets' log-probs and ranks, all normalized by each row's
log-sum-exp over the whole vocabulary."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.heads.reference import log_softmax, top_k
from service.runtime.layer_runs import lens_run
from service.runtime.layout import open_head
from tests.conftest import D_MODEL, VOCAB, reference_logits

LAYERS, TOKENS, K = 4, 5, 6


@pytest.mark.parametrize("head", ["tied_path", "untied_path"])
def test_a_lens_run_is_the_reference_at_every_layer(
    head: str, request: pytest.FixtureRequest
) -> None:
    path: Path = request.getfixturevalue(head)
    rng = np.random.default_rng(4)
    states = rng.standard_normal((LAYERS, TOKENS, D_MODEL), dtype=np.float32)
    states[-2] = states[-1] + np.float32(0.01) * states[0]  # a layer close to the last
    targets = rng.integers(0, VOCAB, TOKENS)
    part = lens_run(open_head(path), states, np.zeros(LAYERS, np.bool_), K, targets)
    log_p = log_softmax(reference_logits(path, states))  # (layers, tokens, vocab)
    _, ids = top_k(log_p, K)
    np.testing.assert_array_equal(part.token_ids, ids)
    want = np.take_along_axis(log_p, ids, axis=-1)
    np.testing.assert_allclose(part.logprobs, want, rtol=1e-4, atol=1e-4)
    p = np.exp(log_p)
    np.testing.assert_allclose(part.entropy, -(p * log_p).sum(-1), rtol=1e-4, atol=1e-4)
    kl = (p[-1] * (log_p[-1] - log_p)).sum(-1)
    np.testing.assert_allclose(part.kl_to_last, kl, rtol=1e-3, atol=1e-4)
    assert (part.kl_to_last[-1] == 0.0).all()
    assert part.kl_to_last[-2].max() < 0.1 * part.kl_to_last[0].min()
    assert part.target_logprobs is not None
    assert part.target_ranks is not None
    at_target = log_p[:, np.arange(TOKENS), targets]
    np.testing.assert_allclose(part.target_logprobs, at_target, rtol=1e-4, atol=1e-4)
    _, every = top_k(log_p, VOCAB)
    places = np.argmax(every == targets[None, :, None], axis=-1)
    np.testing.assert_array_equal(part.target_ranks, places)


def test_a_lens_run_without_targets_leaves_them_out(tied_path: Path) -> None:
    states = np.random.default_rng(5).standard_normal((2, 3, D_MODEL), dtype=np.float32)
    part = lens_run(open_head(tied_path), states, np.zeros(2, np.bool_), 2, None)
    assert part.target_logprobs is None
    assert part.target_ranks is None
    assert part.token_ids.shape == part.logprobs.shape == (2, 3, 2)
    assert part.entropy.shape == part.kl_to_last.shape == (2, 3)
