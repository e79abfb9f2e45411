"""Shared fixtures: small seeded heads written to disk, and markers taken from the folder."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from service.heads import MODEL_FILE
from service.heads.files import HeadWeights, save_head
from service.heads.graph import OUTPUT_WEIGHT
from service.heads.inspector import inspect_head
from service.heads.reference import output_projection_tied, output_projection_untied
from service.runtime.layout import Placement, runtime_for
from service.runtime.session import RUNTIME_VERSION
from service.tools.demo import demo_tokens

VOCAB = 997
D_MODEL = 48

# tests/docker needs a running container (.ci/docker starts one and sets the URL); tests/ray
# a multi-node Ray cluster and the ray extra (`make ray-test` sets LMHEAD_RAY_TESTS).
collect_ignore = [] if os.environ.get("LMHEAD_DOCKER_URL") else ["docker"]
collect_ignore += [] if os.environ.get("LMHEAD_RAY_TESTS") else ["ray"]


#: Fixtures of these scopes live once per test process: tests sharing one (a module's server,
#: its repository and what earlier tests did to them) must run in one process, in order.
SHARED_SCOPES = {"class", "module", "package"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """tests/unit/... -> unit, tests/integration -> integration: markers by top folder.

    For ``make test``'s ``pytest -n N --dist loadgroup`` (pytest-xdist), each test is sent on
    its own to whichever worker is free, except: the tests of a module that use one of its
    module-scoped fixtures go together, as ``xdist_group(<module>)`` (one server per module,
    its tests in their order); and a test marked ``xdist_group("measure")`` runs with the other
    such tests, one after another on one worker: they measure a server's memory or how it
    batches concurrent requests, and two of them at once would load the machine for each
    other. xdist starts the largest groups first."""
    tests = Path(__file__).parent
    for item in items:
        folder = Path(str(item.fspath)).relative_to(tests).parts[0]
        if folder in {"unit", "integration", "docker", "ray"}:
            item.add_marker(getattr(pytest.mark, folder))
        if item.get_closest_marker("xdist_group") is None and _shares_fixtures(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under ``--dist loadgroup`` a worker passes a test's group on in its node id
    (``...::test@measure``): fail the grouped tests, rather than run each group split up,
    where it cannot (pytest 9.2 keeps node ids of its own: pytest-xdist#1386)."""
    grouped = getattr(item.config.option, "loadgroup", False)  # set in xdist's workers
    if grouped and item.get_closest_marker("xdist_group") is not None and "@" not in item.nodeid:
        pytest.fail(
            f"pytest-xdist could not keep this test in its xdist_group (pytest "
            f"{pytest.__version__}, pytest-xdist#1386): run it without --dist loadgroup",
            pytrace=False,
        )


def _shares_fixtures(item: pytest.Item) -> bool:
    """Whether ``item`` uses a fixture that outlives it within its module."""
    if not isinstance(item, pytest.Function):
        return False
    definitions = item._fixtureinfo.name2fixturedefs.values()
    return any(chain[-1].scope in SHARED_SCOPES for chain in definitions)


@pytest.fixture(scope="session")
def table() -> npt.NDArray[np.float32]:
    return np.random.default_rng(1).standard_normal((VOCAB, D_MODEL), dtype=np.float32)


@pytest.fixture(scope="session")
def output_weight() -> npt.NDArray[np.float32]:
    return np.random.default_rng(2).standard_normal((VOCAB, D_MODEL), dtype=np.float32)


@pytest.fixture(scope="session")
def tied_path(tmp_path_factory: pytest.TempPathFactory, table: npt.NDArray[np.float32]) -> Path:
    return save_head(HeadWeights.from_arrays(table), tmp_path_factory.mktemp("tied"))


@pytest.fixture(scope="session")
def untied_path(
    tmp_path_factory: pytest.TempPathFactory,
    table: npt.NDArray[np.float32],
    output_weight: npt.NDArray[np.float32],
) -> Path:
    weights = HeadWeights.from_arrays(table, output_weight)
    return save_head(weights, tmp_path_factory.mktemp("untied"))


def initializers(path: Path) -> dict[str, npt.NDArray[np.float32]]:
    """The 2-D weights of a saved head, read back from the file with onnx."""
    model = onnx.load(str(path))
    return {
        tensor.name: numpy_helper.to_array(tensor)
        for tensor in model.graph.initializer
        if len(tensor.dims) == 2
    }


def reference_logits(path: Path, hidden: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """The numpy reference: float64 logits from the matrices stored in the file itself.

    ``path`` is a ``model.onnx`` or a version directory; a tied file projects through its one
    matrix, an untied one through ``lm_head.weight``.
    """
    model = path / MODEL_FILE if path.is_dir() else path
    weights = initializers(model)
    rows = np.asarray(hidden, dtype=np.float64)
    if len(weights) == 1:
        (table,) = weights.values()
        return np.asarray(output_projection_tied(rows, table.astype(np.float64)), np.float64)
    head = weights[OUTPUT_WEIGHT].astype(np.float64)
    return np.asarray(output_projection_untied(rows, head), np.float64)


def write_tied_and_untied(
    root: Path, table: npt.NDArray[np.float32], output_weight: npt.NDArray[np.float32]
) -> None:
    """``tied/1`` (with token labels) and ``untied/1`` under ``root``: the servers' base set."""
    save_head(HeadWeights.from_arrays(table), root / "tied" / "1")
    (root / "tied" / "1" / "vocab.txt").write_text("\n".join(demo_tokens(VOCAB)) + "\n")
    save_head(HeadWeights.from_arrays(table, output_weight), root / "untied" / "1")


@pytest.fixture(scope="module")
def repository(
    tmp_path_factory: pytest.TempPathFactory,
    table: npt.NDArray[np.float32],
    output_weight: npt.NDArray[np.float32],
) -> Path:
    """``tied/1`` and ``untied/1``, fresh for each test module (module scope: one module's
    loads, unloads and new versions never reach another); modules that need more define
    their own ``repository``."""
    root = tmp_path_factory.mktemp("models")
    write_tied_and_untied(root, table, output_weight)
    return root


def skip_unless_runnable(path: Path, placement: Placement | None = None) -> None:
    """Skip where this onnxruntime cannot run the head as ``placement`` lays it out (the
    service refuses it there, saying which version it needs): ``make test-floors`` runs the
    suite on onnxruntime 1.18, lmhead's oldest, which has no 8-bit kernels."""
    needed = runtime_for(inspect_head(path), placement or Placement())
    if needed > RUNTIME_VERSION:
        pytest.skip(f"needs onnxruntime >= {needed[0]}.{needed[1]}; this is {ort.__version__}")
