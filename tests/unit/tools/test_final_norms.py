"""``lmhead import`` keeps each family's final norm, and the head reads residual states as the
model does: every family's checkpoint (``tests.families``), imported, opened as the service opens
it, normalizes and projects to transformers' logits (computed apart, in float64).

Tolerances (float32 graph against the float64 reference, logits of magnitude up to ~5):
``|logit - reference| <= 2e-5 + 1e-5 * |reference|``; top-k: the ids returned are a true top-k
(their reference logits equal the reference's k largest, within the same tolerance, so a
near-tie may order either way). Embeddings equal the stored table exactly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt
import onnx
import pytest
from safetensors.numpy import save_file

from service.cli import main
from service.heads.graph import EMBEDDINGS, LOGITS
from service.heads.inspector import inspect_head
from service.heads.norm import NORM_BIAS, NORM_WEIGHT, NORMED_STATES, RESIDUAL_STATES
from service.runtime.layout import Placement, open_head
from service.runtime.session import HeadSession
from service.settings import MemoryMode
from service.tools.checkpoints import CheckpointError
from service.tools.importer import ImportOptions, ImportResult, import_checkpoint
from tests import families
from tests.families import D_MODEL, FAMILIES, FAMILY, VOCAB

RTOL, ATOL = 1e-5, 2e-5
K = 5


def _import(tmp_path: Path, family: str, **options: Any) -> ImportResult:
    source = families.write_checkpoint(family, tmp_path / "checkpoints" / family)
    return import_checkpoint(source, tmp_path / "models", family, ImportOptions(**options))


def _open(result: ImportResult, memory_mode: MemoryMode = "shared") -> HeadSession:
    return open_head(result.directory / "model.onnx", Placement(memory_mode=memory_mode))


def assert_logits(session: HeadSession, family: str, residual: npt.NDArray[np.float32]) -> None:
    """Full logits and top-k of ``residual`` read through the head, against the reference."""
    expected = families.reference_logits(family, residual)
    answer = session.project(session.normalize(residual), K, full_logits=True)
    assert answer.logits is not None
    np.testing.assert_allclose(answer.logits, expected, rtol=RTOL, atol=ATOL)
    best = -np.sort(-expected, axis=1)[:, :K]
    chosen = np.take_along_axis(expected, answer.topk_token_ids, axis=1)
    np.testing.assert_allclose(chosen, best, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(answer.topk_logits, chosen, rtol=RTOL, atol=ATOL)


def _ancestors(graph: onnx.GraphProto, name: str) -> set[str]:
    """Every value ``name`` is computed from: tensors, inputs and intermediate values."""
    producers = {output: node for node in graph.node for output in node.output}
    seen: set[str] = set()
    todo = [name]
    while todo:
        value = todo.pop()
        if value in seen:
            continue
        seen.add(value)
        if value in producers:
            todo.extend(producers[value].input)
    return seen


@pytest.mark.parametrize("memory_mode", ["shared", "fast"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_reads_residual_states_as_transformers_does(
    tmp_path: Path, family: str, memory_mode: MemoryMode
) -> None:
    result = _import(tmp_path, family)
    spec = FAMILY[family]
    kind = "layer" if spec.kind == "layer" else "rms"
    assert result.final_norm is not None
    assert result.final_norm.startswith(f"{kind}, eps {spec.epsilon:g}")
    assert f"{spec.norm}.weight" in result.final_norm
    assert not any("no final norm" in note for note in result.notes)
    session = _open(result, memory_mode)
    assert session.has_norm
    assert_logits(session, family, families.residual_states(16))
    ids = np.arange(VOCAB)
    np.testing.assert_array_equal(session.embed(ids), families.embedding_table(family))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_norm_never_feeds_the_gather_or_the_projection(tmp_path: Path, family: str) -> None:
    result = _import(tmp_path, family)
    graph = onnx.load(str(result.directory / "model.onnx")).graph
    norm_side = {NORM_WEIGHT, NORM_BIAS, RESIDUAL_STATES}
    assert not _ancestors(graph, EMBEDDINGS) & norm_side
    assert not _ancestors(graph, LOGITS) & norm_side
    matrices = {tensor.name for tensor in graph.initializer if len(tensor.dims) == 2}
    normed_from = _ancestors(graph, NORMED_STATES)
    assert RESIDUAL_STATES in normed_from
    assert NORM_WEIGHT in normed_from
    assert not normed_from & matrices
    norm = inspect_head(result.directory).final_norm
    assert norm is not None
    assert norm["kind"] == ("layer" if FAMILY[family].kind == "layer" else "rms")
    assert norm["epsilon"] == FAMILY[family].epsilon


def test_import_and_inspect_say_what_was_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = families.write_checkpoint("llama", tmp_path / "llama")
    repository = tmp_path / "models"
    assert main(["import", str(source), "--name", "llama", "--repository", str(repository)]) == 0
    out = capsys.readouterr().out
    assert "  final norm: rms, eps 1e-05 (model.norm.weight)\n" in out
    assert main(["inspect", str(repository / "llama" / "1")]) == 0
    assert "final norm       rms, eps 1e-05 (model.norm.weight)" in capsys.readouterr().out
    assert main(["inspect", str(repository / "llama" / "1"), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["final_norm"]
    assert shown == {
        "kind": "rms",
        "epsilon": 1e-05,
        "source": "model.norm.weight",
        "tensors": [NORM_WEIGHT],
    }


def test_no_norm_leaves_it_out_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = families.write_checkpoint("gpt2", tmp_path / "gpt2")
    argv = ["import", str(source), "--name", "gpt2", "--repository", str(tmp_path / "models")]
    assert main([*argv, "--no-norm"]) == 0
    out = capsys.readouterr().out
    assert "  final norm:" not in out
    assert "note: --no-norm: no final norm: residual states (the logit lens) will be refused" in out
    session = open_head(tmp_path / "models" / "gpt2" / "1" / "model.onnx")
    assert not session.has_norm
    with pytest.raises(ValueError, match="holds no final norm"):
        session.normalize(families.residual_states(2))
    assert main(["inspect", str(tmp_path / "models" / "gpt2" / "1")]) == 0
    assert "final norm       none (residual states are refused)" in capsys.readouterr().out


def _checkpoint(directory: Path, tensors: dict[str, npt.NDArray[Any]], **config: Any) -> Path:
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "model.safetensors"))
    if config:
        (directory / "config.json").write_text(json.dumps(config))
    return directory


def _vector(seed: int, width: int = D_MODEL) -> npt.NDArray[np.float32]:
    return 1 + 0.3 * np.random.default_rng(seed).standard_normal(width).astype(np.float32)


def _table() -> npt.NDArray[np.float32]:
    return families.embedding_table("gpt2")


@pytest.mark.parametrize(
    ("tensors", "config", "why"),
    [
        (  # OPT-350m: post-LN blocks, no final norm (and its table is narrower)
            {"model.decoder.embed_tokens.weight": _table()},
            {"model_type": "opt", "do_layer_norm_before": False, "word_embed_proj_dim": 64},
            "an OPT that normalizes after each block (OPT-350m)",
        ),
        (  # a family whose model.norm is no RMS norm: not guessed
            {"model.embed_tokens.weight": _table(), "model.norm.weight": _vector(1)},
            {"model_type": "cohere"},
            "config.json says model_type 'cohere'; lmhead knows the final norms of gemma, ",
        ),
        (
            {"transformer.wte.weight": _table(), "transformer.ln_f.weight": _vector(1)},
            {},
            "no config.json; lmhead knows the final norms of",
        ),
        (
            {"model.embed_tokens.weight": _table()},
            {"model_type": "llama"},
            "no model.norm.weight or norm.weight in the checkpoint",
        ),
        (  # GPT-2's LayerNorm has a bias: a weight alone is not that norm
            {"transformer.wte.weight": _table(), "transformer.ln_f.weight": _vector(1)},
            {"model_type": "gpt2"},
            "transformer.ln_f.weight has no transformer.ln_f.bias beside it",
        ),
        (  # OPT with project_out: the norm is over hidden_size, the head's states narrower
            {
                "model.decoder.embed_tokens.weight": _table(),
                "model.decoder.final_layer_norm.weight": _vector(1, 96),
                "model.decoder.final_layer_norm.bias": _vector(2, 96),
            },
            {"model_type": "opt", "hidden_size": 96, "word_embed_proj_dim": 64},
            "has shape (96,) and (96,), the head's states are 64 wide",
        ),
    ],
    ids=["opt-350m", "unknown-family", "no-config", "missing", "no-bias", "other-width"],
)
def test_without_a_norm_to_keep_the_head_has_none_and_the_note_says_why(
    tmp_path: Path, tensors: dict[str, Any], config: dict[str, Any], why: str
) -> None:
    source = _checkpoint(tmp_path / "ckpt", tensors, **config)
    result = import_checkpoint(source, tmp_path / "models", "m")
    assert result.final_norm is None
    (note,) = [note for note in result.notes if note.startswith("no final norm")]
    assert note.startswith("no final norm: residual states (the logit lens) will be refused (")
    assert why in note
    assert inspect_head(result.directory).final_norm is None


@pytest.mark.parametrize(
    ("names", "model_type"),
    [
        (("embed_tokens.weight", "norm.weight"), "llama"),  # a bare LlamaModel
        (("wte.weight", "ln_f.weight", "ln_f.bias"), "gpt2"),  # a bare GPT2Model
        (("embed_in.weight", "final_layer_norm.weight", "final_layer_norm.bias"), "gpt_neox"),
        (("decoder.embed_tokens.weight", "decoder.final_layer_norm.weight"), "opt"),
    ],
)
def test_names_without_the_model_prefix_are_found(
    tmp_path: Path, names: tuple[str, ...], model_type: str
) -> None:
    embedding, weight, *bias = names
    if model_type == "opt":
        bias = ["decoder.final_layer_norm.bias"]
    tensors = {embedding: _table(), weight: _vector(1)} | {name: _vector(2) for name in bias}
    source = _checkpoint(tmp_path / "ckpt", tensors, model_type=model_type)
    result = import_checkpoint(source, tmp_path / "models", "bare")
    assert result.final_norm is not None
    assert f"({weight}" in result.final_norm


def test_an_opt_without_affine_weights_has_a_plain_layer_norm(tmp_path: Path) -> None:
    source = _checkpoint(
        tmp_path / "ckpt",
        {"model.decoder.embed_tokens.weight": _table()},
        model_type="opt",
        layer_norm_elementwise_affine=False,
    )
    result = import_checkpoint(source, tmp_path / "models", "opt")
    assert result.final_norm == "layer, eps 1e-05, bias (OPT's, without affine weights)"
    session = open_head(result.directory / "model.onnx")
    residual = families.residual_states(4)
    centred = residual - residual.mean(-1, keepdims=True)
    expected = centred / np.sqrt((centred**2).mean(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(session.normalize(residual), expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_norm_stays_float32_whatever_the_matrices_dtype(tmp_path: Path, dtype: str) -> None:
    full = _import(tmp_path / "full", "llama")
    half = _import(tmp_path / "half", "llama", dtype=dtype)
    model = onnx.load(str(half.directory / "model.onnx"))
    (weight,) = [tensor for tensor in model.graph.initializer if tensor.name == NORM_WEIGHT]
    assert weight.data_type == onnx.TensorProto.FLOAT
    residual = families.residual_states(8)
    np.testing.assert_array_equal(_open(half).normalize(residual), _open(full).normalize(residual))


def test_a_norm_holding_nan_is_refused_unless_left_out(tmp_path: Path) -> None:
    weight = _vector(1).astype(ml_dtypes.bfloat16)
    weight[3] = np.nan
    source = _checkpoint(
        tmp_path / "ckpt",
        {"model.embed_tokens.weight": _table(), "model.norm.weight": weight},
        model_type="gemma",
    )
    with pytest.raises(CheckpointError, match=r"model.norm.weight .*NaN.*--no-norm"):
        import_checkpoint(source, tmp_path / "models", "gemma")
    assert not (tmp_path / "models" / "gemma").exists()
    result = import_checkpoint(source, tmp_path / "models", "gemma", ImportOptions(no_norm=True))
    assert result.final_norm is None


@pytest.mark.parametrize("epsilon", [0, -1e-5, 1.5, "1e-5", True])
def test_an_epsilon_the_norm_cannot_use_is_refused(tmp_path: Path, epsilon: Any) -> None:
    source = _checkpoint(
        tmp_path / "ckpt",
        {"model.embed_tokens.weight": _table(), "model.norm.weight": _vector(1)},
        model_type="llama",
        rms_norm_eps=epsilon,
    )
    with pytest.raises(CheckpointError, match=r"config.json: rms_norm_eps must be a number"):
        import_checkpoint(source, tmp_path / "models", "llama")


def test_an_absent_epsilon_is_the_familys_default(tmp_path: Path) -> None:
    source = _checkpoint(
        tmp_path / "ckpt",
        {"model.embed_tokens.weight": _table(), "model.norm.weight": _vector(1)},
        model_type="qwen2",
    )
    result = import_checkpoint(source, tmp_path / "models", "qwen2")
    assert result.final_norm == "rms, eps 1e-06 (model.norm.weight)"
