"""Every kind of file lmhead writes loads in the oldest onnxruntime it supports, with the same
answers, and declares the IR version and opset the newest onnxruntime-gpu accepts too.

``make test`` builds ``.venv-oldest`` (onnxruntime at pyproject's lower bound) and passes its
interpreter as ``LMHEAD_OLDEST_PYTHON``; onnx's own default IR version (14 with onnx 1.23) is
refused by onnxruntime-gpu 1.31, which is how this was found.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnx
import pytest
from safetensors.numpy import save_file

from service.heads import MODEL_FILE
from service.heads.files import HeadWeights, read_head, save_head
from service.heads.graph import IR_VERSION, OPSET, HeadTransforms
from service.heads.inspector import inspect_head
from service.heads.lse_graph import CHUNK_ROWS
from service.heads.quantize import QuantSpec
from service.runtime.layout import chunked_copy, required_runtime
from service.runtime.session import HeadSession
from service.tools.importer import ImportOptions, import_checkpoint
from service.tools.retie import retie
from tests.conftest import D_MODEL

ROOT = Path(__file__).resolve().parents[2]
#: What each onnxruntime accepts at most (release notes); the newest GPU wheel is 1.31.
ACCEPTED = {"1.18": (10, 21), "1.31": (13, 26)}
#: Rows of each run: the loop of a CPU session's copy takes several turns (``CHUNK_ROWS``).
ROWS = 3 * CHUNK_ROWS - 1
RUN = """
import json, sys
import numpy as np, onnxruntime as ort
out = {}
for path in json.loads(sys.argv[1]):
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {"hidden_states": rng.standard_normal((ROWS, D_MODEL)).astype(np.float32),
             "input_ids": np.array([0, 7], np.int64), "k": np.array([4], np.int64),
             "temperature": np.full((ROWS, 1), 0.8, np.float32)}
    names = ["topk_token_ids", "topk_logits", "logsumexp"]
    both = [False, True] if "lse_in_chunks" in [i.name for i in session.get_inputs()] else [None]
    lse = []
    for chunks in both:  # a CPU session's copy: the written nodes, then the loop
        if chunks is not None:
            feeds["lse_in_chunks"] = np.array([chunks])
        ids, values, row_lse = session.run(names, feeds)
        lse.append(row_lse.tolist())
    out[path] = [ort.__version__, ids.tolist(), values.tolist(), lse]
print(json.dumps(out))
""".replace("D_MODEL", str(D_MODEL)).replace("ROWS", str(ROWS))


def _written(
    root: Path, table: npt.NDArray[np.float32], other: npt.NDArray[np.float32]
) -> list[Path]:
    """One file of each kind lmhead writes and serves on a CPU."""
    paths = [
        save_head(HeadWeights.from_arrays(table), root / "tied"),
        save_head(HeadWeights.from_arrays(table, other), root / "untied", external_data=True),
        save_head(
            HeadWeights.from_arrays(
                table, bias=other[:, 0], transforms=HeadTransforms(0.5, 2.0, 30.0)
            ),
            root / "transforms",
        ),
    ]
    half = save_head(HeadWeights.from_arrays(table, other, dtype="bfloat16"), root / "bf16")
    paths.append(save_head(read_head(half), root / "bf16-widened", widen=True))
    # A 4-bit projection beside a float table: MatMulNBits 4-bit is in 1.18 (8-bit is not,
    # nor GatherBlockQuantized on uint8: see test_newer_operators_are_refused_clearly).
    paths.append(
        save_head(
            HeadWeights.from_arrays(table, other), root / "int4", quantization=QuantSpec(4, 32)
        )
    )
    twin = save_head(HeadWeights.from_arrays(table, table.copy()), root / "twin")
    paths.append(retie(twin, root / "retied" / MODEL_FILE).output)
    checkpoint = root / "checkpoint"
    checkpoint.mkdir()
    save_file({"model.embed_tokens.weight": table}, str(checkpoint / "model.safetensors"))
    (checkpoint / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    imported = import_checkpoint(checkpoint, root / "repo", "imported", ImportOptions())
    # What a CPU session loads: the log-sum-exp in row chunks (a Loop), inline and external.
    chunked = [chunked_copy(paths[i], root / f"chunked-{i}") for i in (0, 1)]
    return [*paths, imported.directory / MODEL_FILE, *chunked]


@pytest.fixture(scope="module")
def written(
    tmp_path_factory: pytest.TempPathFactory,
    table: npt.NDArray[np.float32],
    output_weight: npt.NDArray[np.float32],
) -> list[Path]:
    return _written(tmp_path_factory.mktemp("written"), table, output_weight)


def test_files_declare_what_every_supported_runtime_accepts(written: list[Path]) -> None:
    oldest_ir, oldest_opset = ACCEPTED["1.18"]
    for path in written:
        model = onnx.load(str(path), load_external_data=False)
        default = [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")]
        assert model.ir_version <= oldest_ir, path
        assert default[0] <= oldest_opset, path
    assert ACCEPTED["1.18"] >= (IR_VERSION, OPSET)


def test_pyproject_and_make_name_the_same_oldest_runtime() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    oldest = re.search(r"ORT_OLDEST \?= (\S+)", makefile)
    assert oldest is not None
    assert f'"onnxruntime>={oldest.group(1).rsplit(".", 1)[0]}"' in pyproject
    assert f'"onnxruntime-gpu>={oldest.group(1).rsplit(".", 1)[0]}"' in pyproject


def test_the_oldest_runtime_loads_them_with_the_same_answers(written: list[Path]) -> None:
    python = _oldest_python()
    done = subprocess.run(
        [python, "-c", RUN, json.dumps([str(p) for p in written])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    answers = json.loads(done.stdout)
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((ROWS, D_MODEL)).astype(np.float32)
    for path in written:
        version, ids, values, lse = answers[str(path)]
        assert version.startswith("1.18")
        here = HeadSession(path, tied=False).project(hidden, 4, temperature=0.8, full_logits=True)
        # The chunked copies are the in-memory form of a CPU session (a Loop and an If the
        # inspector refuses in a served file): never quantized.
        if path.parent.name.startswith("chunked-") or inspect_head(path).quantization is None:
            np.testing.assert_array_equal(ids, here.topk_token_ids)
            np.testing.assert_allclose(values, here.topk_logits, rtol=1e-5, atol=1e-5)
            for each in lse:
                np.testing.assert_allclose(each, here.logsumexp, rtol=1e-5, atol=1e-5)
            continue
        # Quantized kernels round int8 activations differently across releases: the logits
        # agree to ~1% of their scale, so near-equal entries may swap places.
        assert here.logits is not None
        tolerance = 0.02 * float(np.abs(here.logits).max())
        np.testing.assert_allclose(values, here.topk_logits, atol=tolerance)
        ours_for_theirs = np.take_along_axis(here.logits, np.array(ids), axis=1)
        np.testing.assert_allclose(values, ours_for_theirs, atol=tolerance)


def test_newer_operators_are_refused_clearly(
    tmp_path: Path, table: npt.NDArray[np.float32], output_weight: npt.NDArray[np.float32]
) -> None:
    """An 8-bit head needs onnxruntime 1.22: 1.18 refuses it, as ``required_runtime`` says."""
    python = _oldest_python()
    weights = HeadWeights.from_arrays(table, output_weight)
    path = save_head(weights, tmp_path, quantization=QuantSpec(8, 32))
    assert required_runtime(inspect_head(path), split=False) == (1, 22)
    done = subprocess.run(
        [python, "-c", RUN, json.dumps([str(path)])], capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0
    assert "Only 4b quantization is supported" in done.stderr


def _oldest_python() -> str:
    """The interpreter of ``.venv-oldest``, or skip saying why there is none."""
    python = os.environ.get("LMHEAD_OLDEST_PYTHON")
    if python is None:
        pytest.skip("run through `make test`, which builds .venv-oldest")
    if not python:
        pytest.skip(
            "no Python 3.8-3.12 on this machine for onnxruntime 1.18's wheels (`make test` "
            "looks for PYTHON, python3.12 and python3.11; OLDEST_PYTHON=... names another)"
        )
    return python
