"""Residual rows of any finite float32 magnitude go through the head's final norm as the float64
reference computes it: the norm is scale-invariant, so rows too large for its float32 sum of
squares are scaled first, never turned into zeros (rows of 1e18 got all-zero logits)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from service.heads.files import HeadWeights, save_head
from service.heads.norm import FinalNorm, within_norm_range
from service.heads.reference import top_k
from service.runtime.session import HeadSession
from tests.conftest import D_MODEL

SCALES = [1e-30, 1.0, 1e12, 1e18, 1e30, 1e37]


def _norm(kind: str) -> FinalNorm:
    rng = np.random.default_rng(3)
    bias = rng.standard_normal(D_MODEL) if kind == "layer" else None
    return FinalNorm(kind, 1 + 0.1 * rng.standard_normal(D_MODEL), 1e-5, bias)  # type: ignore[arg-type]


@pytest.fixture(params=["rms", "layer"])
def normed_head(
    request: pytest.FixtureRequest, tmp_path: Path, table: npt.NDArray[np.float32]
) -> tuple[HeadSession, FinalNorm, npt.NDArray[np.float32]]:
    norm = _norm(request.param)
    path = save_head(HeadWeights.from_arrays(table, norm=norm), tmp_path)
    return HeadSession(path, tied=True), norm, table


@pytest.mark.parametrize("scale", SCALES)
def test_the_norm_matches_the_float64_reference_at_any_magnitude(
    normed_head: tuple[HeadSession, FinalNorm, npt.NDArray[np.float32]], scale: float
) -> None:
    session, norm, table = normed_head
    drawn = np.random.default_rng(4).standard_normal((6, D_MODEL)) * scale
    rows = drawn.astype(np.float32)
    assert np.isfinite(rows).all()
    want = norm.apply(rows)
    got = session.normalize(rows)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    logits = want @ table.astype(np.float64).T
    _, ids = top_k(logits, 3)
    projected = session.project(got, 3)
    np.testing.assert_array_equal(projected.topk_token_ids, ids)
    assert (projected.topk_logits[:, 0] > projected.topk_logits[:, -1]).all()  # never uniform


def test_rows_in_range_are_the_very_rows_given() -> None:
    rows = np.random.default_rng(5).standard_normal((3, D_MODEL)).astype(np.float32) * 1e6
    assert within_norm_range(rows) is rows


def test_only_the_rows_past_the_range_are_scaled_by_a_power_of_two() -> None:
    rows = np.random.default_rng(6).standard_normal((3, D_MODEL)).astype(np.float32)
    rows[1] *= np.float32(1e25)
    scaled = within_norm_range(rows)
    np.testing.assert_array_equal(scaled[[0, 2]], rows[[0, 2]])
    ratio = rows[1] / scaled[1]
    assert np.all(ratio == ratio[0])
    assert np.log2(ratio[0]) == np.round(np.log2(ratio[0]))  # exact: a power of two
    assert np.abs(scaled[1]).max() <= 2.0**40
