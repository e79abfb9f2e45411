"""Importing HF-style safetensors checkpoints: real tensor names, tying rules, fp16/bf16."""

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
from service.heads.files import HeadWeights, save_head
from service.heads.inspector import inspect_head
from service.heads.quantize import QuantSpec
from service.repository.side_files import read_labels
from service.tools.checkpoints import CheckpointError
from service.tools.importer import ImportOptions, import_checkpoint, quantize_version
from tests.conftest import initializers

VOCAB, D = 300, 16


def _checkpoint(
    directory: Path, tensors: dict[str, npt.NDArray[Any]], config: dict[str, Any] | None = None
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config or {}))
    return directory


def _table(seed: int = 0) -> npt.NDArray[np.float32]:
    return np.random.default_rng(seed).standard_normal((VOCAB, D)).astype(np.float32)


def _layer() -> npt.NDArray[np.float32]:
    return np.ones((D, D), np.float32)  # a trunk tensor the importer must ignore


@pytest.mark.parametrize(
    "embedding_name",
    ["transformer.wte.weight", "wte.weight", "model.embed_tokens.weight", "shared.weight"],
)
def test_tied_checkpoints_without_a_head_become_one_initializer(
    tmp_path: Path, embedding_name: str
) -> None:
    table = _table()
    source = _checkpoint(tmp_path / "ckpt", {embedding_name: table, "h.0.w": _layer()})
    result = import_checkpoint(source, tmp_path / "models", "gpt2")
    assert result.tied
    assert result.directory == tmp_path / "models" / "gpt2" / "1"
    report = inspect_head(result.directory)
    assert report.tied
    (stored,) = initializers(result.directory / "model.onnx").values()
    np.testing.assert_array_equal(stored, table)


def test_untied_llama_layout(tmp_path: Path) -> None:
    table, head = _table(0), _table(1)
    source = _checkpoint(
        tmp_path / "ckpt",
        {"model.embed_tokens.weight": table, "lm_head.weight": head},
        {"tie_word_embeddings": False},
    )
    result = import_checkpoint(source, tmp_path / "models", "llama")
    assert not result.tied
    embedding, output = initializers(result.directory / "model.onnx").values()
    np.testing.assert_array_equal(embedding, table)
    np.testing.assert_array_equal(output, head)


def test_pythia_layout(tmp_path: Path) -> None:
    source = _checkpoint(
        tmp_path / "ckpt",
        {"gpt_neox.embed_in.weight": _table(0), "embed_out.weight": _table(1)},
        {"tie_word_embeddings": False},
    )
    assert not import_checkpoint(source, tmp_path / "models", "pythia").tied


def test_a_redundant_head_copy_is_tied_with_a_note(tmp_path: Path) -> None:
    table = _table()
    source = _checkpoint(
        tmp_path / "ckpt",
        {"model.decoder.embed_tokens.weight": table, "lm_head.weight": table.copy()},
    )
    result = import_checkpoint(source, tmp_path / "models", "opt")
    assert result.tied
    assert any("redundant copy" in note for note in result.notes)


def test_missing_head_with_tie_false_is_an_error(tmp_path: Path) -> None:
    source = _checkpoint(
        tmp_path / "ckpt", {"model.embed_tokens.weight": _table()}, {"tie_word_embeddings": False}
    )
    with pytest.raises(CheckpointError, match="refusing to invent a random head"):
        import_checkpoint(source, tmp_path / "models", "broken")


def test_unknown_layout_lists_the_tensors_found(tmp_path: Path) -> None:
    source = _checkpoint(tmp_path / "ckpt", {"encoder.tok.weight": _table(), "x.y": _layer()})
    with pytest.raises(CheckpointError, match=r"has: encoder\.tok\.weight, x\.y"):
        import_checkpoint(source, tmp_path / "models", "odd")
    options = ImportOptions(embedding_tensor="encoder.tok.weight")
    assert import_checkpoint(source, tmp_path / "models", "odd", options).tied


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_half_precision_converts_exactly(tmp_path: Path, dtype: Any) -> None:
    stored = _table().astype(dtype)
    source = _checkpoint(tmp_path / "ckpt", {"model.embed_tokens.weight": stored})
    result = import_checkpoint(source, tmp_path / "models", "half")
    (weight,) = initializers(result.directory / "model.onnx").values()
    assert weight.dtype == np.float32
    np.testing.assert_array_equal(weight, stored.astype(np.float32))


def test_sharded_checkpoints_are_read_through_the_index(tmp_path: Path) -> None:
    source = tmp_path / "ckpt"
    source.mkdir()
    table, head = _table(0), _table(1)
    save_file({"model.embed_tokens.weight": table}, str(source / "model-00001.safetensors"))
    save_file({"lm_head.weight": head}, str(source / "model-00002.safetensors"))
    weight_map = {
        "model.embed_tokens.weight": "model-00001.safetensors",
        "lm_head.weight": "model-00002.safetensors",
    }
    (source / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    result = import_checkpoint(source, tmp_path / "models", "sharded")
    _, output = initializers(result.directory / "model.onnx").values()
    np.testing.assert_array_equal(output, head)
    # A shard's failure names the shard (it named neither the shard nor the index)
    weight_map["lm_head.weight"] = "model-00001.safetensors"
    (source / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="lm_head.weight is not in model-00001"):
        import_checkpoint(source, tmp_path / "models", "sharded")
    weight_map["lm_head.weight"] = "model-00003.safetensors"
    (source / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="lm_head.weight is in model-00003.*missing"):
        import_checkpoint(source, tmp_path / "models", "sharded")
    weight_map["lm_head.weight"] = "model-00002.safetensors"
    (source / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shard = source / "model-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="model-00002.safetensors is not a readable"):
        import_checkpoint(source, tmp_path / "models", "sharded")
    assert [p.name for p in (tmp_path / "models" / "sharded").iterdir()] == ["1"]


def test_untie_and_tie_flags(tmp_path: Path) -> None:
    table, head = _table(0), _table(1)
    tied = _checkpoint(tmp_path / "tied", {"model.embed_tokens.weight": table})
    untied = import_checkpoint(tied, tmp_path / "models", "twin", ImportOptions(untie=True))
    assert not untied.tied
    assert inspect_head(untied.directory).duplicate == "identical"  # a copy, to fine-tune apart
    separate = _checkpoint(
        tmp_path / "untied", {"model.embed_tokens.weight": table, "lm_head.weight": head}
    )
    forced = import_checkpoint(separate, tmp_path / "models", "forced", ImportOptions(tie=True))
    assert forced.tied
    assert any("top-1 agreement" in note for note in forced.notes)


def test_corrupt_header_and_mismatched_head_are_errors(tmp_path: Path) -> None:
    source = _checkpoint(tmp_path / "ckpt", {"model.embed_tokens.weight": _table()})
    (source / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        import_checkpoint(source, tmp_path / "models", "corrupt")
    mismatched = _checkpoint(
        tmp_path / "mismatch",
        {"model.embed_tokens.weight": _table(), "lm_head.weight": np.ones((VOCAB, 8), np.float32)},
    )
    with pytest.raises(
        CheckpointError, match=r"shape \(300, 8\) but the embedding has \(300, 16\)"
    ):
        import_checkpoint(mismatched, tmp_path / "models", "mismatch")


def test_labels_from_tokenizer_json_and_versions_count_up(tmp_path: Path) -> None:
    source = _checkpoint(tmp_path / "ckpt", {"wte.weight": _table()})
    vocab = {f"tok{i}": i for i in range(VOCAB)} | {"line\nbreak": 7, "carriage\rreturn": 9}
    (source / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}}))
    first = import_checkpoint(source, tmp_path / "models", "labelled")
    second = import_checkpoint(source, tmp_path / "models", "labelled")
    assert (first.directory.name, second.directory.name) == ("1", "2")
    labels = read_labels(second.directory, "vocab.txt", VOCAB)
    assert labels is not None
    assert len(labels) == VOCAB
    assert labels[3] == "tok3"
    assert labels[7] == "line\\nbreak"
    assert labels[9] == "carriage\\rreturn"
    assert labels[10] == "tok10"
    added = [  # Llama-3's specials live only here; one shares its text with another id
        {"id": VOCAB - 1, "content": "<|eot_id|>"},
        {"id": VOCAB - 3, "content": "tok4"},
    ]
    vocab = {f"tok{i}": i for i in range(VOCAB - 1)}
    (source / "tokenizer.json").write_text(
        json.dumps({"model": {"vocab": vocab}, "added_tokens": added})
    )
    special = import_checkpoint(source, tmp_path / "models", "special")
    specials = read_labels(special.directory, "vocab.txt", VOCAB)
    assert specials is not None
    assert specials[-3:] == ["tok4", f"tok{VOCAB - 2}", "<|eot_id|>"]
    assert specials[4] == "tok4"  # the vocab's own id keeps its label
    with pytest.raises(CheckpointError, match="exists already"):
        import_checkpoint(source, tmp_path / "models", "labelled", ImportOptions(to_version=1))


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("tokenizer.json", "{bad", "tokenizer.json is not valid JSON"),
        ("tokenizer.json", "[1]", "tokenizer.json must hold a JSON object"),
        ("tokenizer.json", '{"model": {"vocab": [["a", 0.0], 7]}}', "a Unigram vocab is"),
        ("vocab.json", '{"a": "3"}', "token 'a' has id '3', not an integer"),
        ("model.safetensors.index.json", "{}", "weight_map must map tensor names"),
        ("model.safetensors.index.json", '{"weight_map": {"wte.weight": "../x"}}', "weight_map"),
    ],
)
def test_a_broken_checkpoint_file_is_a_clear_error_and_writes_nothing(
    tmp_path: Path, name: str, text: str, message: str
) -> None:
    source = _checkpoint(tmp_path / "ckpt", {"wte.weight": _table()})
    (source / name).write_text(text)
    with pytest.raises(CheckpointError, match=message):
        import_checkpoint(source, tmp_path / "models", "broken")
    assert not list((tmp_path / "models").rglob("*.onnx"))  # no version a server would load


def test_a_bias_with_nan_is_refused_and_a_tie_the_weights_break_is_said(tmp_path: Path) -> None:
    table, bias = _table(), np.zeros(VOCAB, np.float32)
    bias[5] = np.nan
    source = _checkpoint(tmp_path / "nan", {"wte.weight": table, "lm_head.bias": bias})
    with pytest.raises(CheckpointError, match="bias holds NaN or Inf .* at token 5"):
        import_checkpoint(source, tmp_path / "models", "nan")
    tied = {"tie_word_embeddings": True}
    differs = _checkpoint(tmp_path / "t", {"wte.weight": table, "lm_head.weight": _table(1)}, tied)
    result = import_checkpoint(differs, tmp_path / "models", "differs")
    assert not result.tied  # as the weights are, and said so
    assert any("says tie_word_embeddings, but lm_head.weight differs" in n for n in result.notes)


def test_labels_end_at_newlines_only(tmp_path: Path) -> None:
    """A "\\r" inside a token (an operator's own vocab.txt) is part of it, and a file saved
    with CRLF line ends reads as the same labels."""
    (tmp_path / "lf.txt").write_bytes(b"a\nb\rc\nd\n")
    (tmp_path / "crlf.txt").write_bytes(b"a\r\nb\r\nd\r\n")
    assert read_labels(tmp_path, "lf.txt", 3) == ["a", "b\rc", "d"]
    assert read_labels(tmp_path, "crlf.txt", 3) == ["a", "b", "d"]


def test_cli_import(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = _checkpoint(tmp_path / "ckpt", {"model.embed_tokens.weight": _table()})
    args = ["import", str(source), "--name", "cli", "--repository", str(tmp_path / "models")]
    assert main(args) == 0
    assert "tied head, 300 x 16" in capsys.readouterr().out
    assert main([*args, "--version", "1"]) == 2
    assert "exists already" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("{bad", "is not valid JSON"),
        ("[1]", "must hold a JSON object"),
        ('{"logit_scale": "abc"}', "logit_scale must be a finite number"),
        ('{"logit_scale": 1e400}', "logit_scale must be a finite number"),  # json reads inf
        ('{"logit_scale": 1e300}', r"logit_scale must be a scale in \[1e-06, 1e\+06\]"),
        ('{"logit_scale": 1e38}', "logit_scale must be a scale in"),  # every logit overflows
        ('{"logit_scale": 0}', "logit_scale must be a scale in"),  # was read as 1.0
        ('{"logit_scale": -0.0625}', "logit_scale must be a scale in"),
        ('{"final_logit_softcapping": 1e-45}', "final_logit_softcapping must be a scale in"),
        ('{"final_logit_softcapping": 0}', "final_logit_softcapping must be a scale in"),
        ('{"final_logit_softcapping": true}', "final_logit_softcapping must be a finite"),
        ('{"tie_word_embeddings": "false"}', "tie_word_embeddings must be true or false"),
        ("[" * 100_000 + "]" * 100_000, "is not valid JSON"),  # too deep for the parser
        ('{"logit_scale": ' + "1" * 5000 + "}", "is not valid JSON"),  # past int's digits
    ],
)
def test_a_config_of_the_wrong_kind_is_a_clear_error(
    tmp_path: Path, config: str, message: str
) -> None:
    source = _checkpoint(tmp_path / "ckpt", {"model.embed_tokens.weight": _table()})
    (source / "config.json").write_text(config)
    with pytest.raises(CheckpointError, match=message):
        import_checkpoint(source, tmp_path / "models", "head")
    assert not (tmp_path / "models" / "head").exists()


def test_weights_holding_nan_are_refused(tmp_path: Path) -> None:
    table = _table()
    table[7, 3] = np.nan
    source = _checkpoint(tmp_path / "ckpt", {"model.embed_tokens.weight": table})
    with pytest.raises(CheckpointError, match="NaN or Inf .* in row 7"):  # the CLI's exit 2
        import_checkpoint(source, tmp_path / "models", "head")
    big = _table() * 1e6  # finite in float32, beyond float16's range
    source = _checkpoint(tmp_path / "big", {"model.embed_tokens.weight": big})
    with pytest.raises(ValueError, match="row 0 holds values past float16's range"):
        import_checkpoint(source, tmp_path / "models", "half", ImportOptions(dtype="float16"))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--name", "../outside"], "is no model name"),
        (["--name", "bad name!"], "is no model name"),
        (["--name", "ok", "--version", "-3"], "is below 1"),
        (["--name", "ok", "--version", "0"], "is below 1"),
        (["--name", "ok", "--block-size", "0", "--quantize", "int8"], "is below 1"),
    ],
)
def test_cli_refuses_names_and_numbers_the_service_could_not_serve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    source = _checkpoint(tmp_path / "ckpt", {"model.embed_tokens.weight": _table()})
    with pytest.raises(SystemExit) as exit_info:
        main(["import", str(source), "--repository", str(tmp_path / "models"), *extra])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "outside").exists()
    assert not (tmp_path / "models").exists()


def test_cli_errors_are_one_line_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Errors no command foresaw (a model file of garbage bytes) still print one line."""
    garbage = tmp_path / "models" / "garbage" / "1"
    garbage.mkdir(parents=True)
    (garbage / "model.onnx").write_bytes(np.random.default_rng(0).bytes(5000))
    args = ["quantize", "garbage", "--repository", str(tmp_path / "models"), "--quantize", "int8"]
    assert main(args) in (1, 2)
    err = capsys.readouterr().err
    assert err.startswith("lmhead: "), err
    assert err.count("\n") == 1, err
    assert "Traceback" not in err
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    with pytest.raises(SystemExit):
        main(["demo", "--repository", str(a_file)])
    assert "is not a directory" in capsys.readouterr().err


def test_trim_and_quantize_refuse_what_they_cannot_read_right(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Float ids in a --keep .npy are no ids (1.5 was kept as 1), and a head lmhead did not
    write (other initializer names) is named as such, not a KeyError."""
    repository = tmp_path / "models"
    save_head(HeadWeights.from_arrays(_table()), repository / "head" / "1")
    np.save(tmp_path / "keep.npy", np.array([1.5, 2.7]))
    where = ["--repository", str(repository)]
    assert main(["trim", "head", "--keep", str(tmp_path / "keep.npy"), "--name", "t", *where]) == 2
    assert "holds float64, not integer token ids" in capsys.readouterr().err
    foreign = onnx.load(str(repository / "head" / "1" / "model.onnx"))
    for tensor in foreign.graph.initializer:
        if tensor.name == "embedding.weight":
            tensor.name = "transformer.wte.weight"
    for node in foreign.graph.node:
        node.input[:] = [
            "transformer.wte.weight" if n == "embedding.weight" else n for n in node.input
        ]
    onnx.save_model(foreign, repository / "head" / "1" / "model.onnx")
    assert main(["quantize", "head", "--quantize", "int8", *where]) == 2
    assert "has no 'embedding.weight' initializer" in capsys.readouterr().err


def test_a_checkpoint_without_config_json_is_imported_with_a_warning(tmp_path: Path) -> None:
    """Tying and the head transforms come from config.json: without it a T5 or Gemma-2 head
    would silently lose its rescale or soft-cap, so the import says so."""
    source = _checkpoint(tmp_path / "ckpt", {"shared.weight": _table()})
    (source / "config.json").unlink()
    result = import_checkpoint(source, tmp_path / "models", "bare")
    assert any(note.startswith("WARNING no config.json") for note in result.notes)
    with_config = import_checkpoint(
        _checkpoint(tmp_path / "c2", {"shared.weight": _table()}), tmp_path / "models", "ok"
    )
    assert not any("WARNING" in note for note in with_config.notes)
    # The final norm's family is config.json's model_type too: without one, no norm is kept.
    for imported in (result, with_config):
        assert any(note.startswith("no final norm: ") for note in imported.notes)


def test_version_numbers_count_whatever_their_zeros(tmp_path: Path) -> None:
    """ "001" is version 1: an import may not add a second version 1 (both would be refused),
    and quantize finds its source."""
    repository = tmp_path / "models"
    save_head(HeadWeights.from_arrays(_table()), repository / "head" / "001")
    source = _checkpoint(tmp_path / "ckpt", {"wte.weight": _table()})
    with pytest.raises(CheckpointError, match="version 1 of .* exists already"):
        import_checkpoint(source, repository, "head", ImportOptions(to_version=1))
    written = quantize_version(repository, "head", None, None, QuantSpec.parse("int8"))
    assert written.name == "2"
    with pytest.raises(CheckpointError, match="choose another --to-version"):  # not --version
        quantize_version(repository, "head", 1, 2, QuantSpec.parse("int8"))
