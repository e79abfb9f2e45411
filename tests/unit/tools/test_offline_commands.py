"""The offline commands (import, quantize, trim, retie, inspect) against careless operators and
lying files: a clear refusal, and nothing half-made left where the service would serve it."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnx
import pytest
from onnx import numpy_helper
from safetensors.numpy import save_file

from service.cli import main
from service.heads.files import HeadWeights, save_head
from service.heads.graph import EMBEDDING_WEIGHT
from service.heads.inspector import HeadInspectionError, inspect_head
from service.heads.quantize import QuantSpec
from service.repository.disk import LABELS_FILE, VOCAB_MAP_FILE
from service.repository.side_files import read_space
from service.repository.staging import STAGING_PREFIX, hold
from service.tools.checkpoints import CheckpointError, tokenizer_tokens
from service.tools.importer import (
    ImportOptions,
    import_checkpoint,
    quantize_version,
    write_version,
)
from service.tools.trim import trim_version

VOCAB, D = 1000, 16


def _table(seed: int = 0) -> npt.NDArray[np.float32]:
    return np.random.default_rng(seed).standard_normal((VOCAB, D)).astype(np.float32)


def _checkpoint(directory: Path, **config: object) -> Path:
    directory.mkdir(parents=True)
    save_file({"model.embed_tokens.weight": _table()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _head(repository: Path, labels: bool = True) -> Path:
    version = save_head(HeadWeights.from_arrays(_table()), repository / "head" / "1").parent
    if labels:
        (version / LABELS_FILE).write_text("".join(f"t{i}\n" for i in range(VOCAB)))
    return version


def test_a_quantized_copy_of_a_trimmed_head_answers_in_original_ids(tmp_path: Path) -> None:
    """quantize copied the labels but not vocab_map.json: the new version served column
    numbers (0-31) as token ids."""
    _head(tmp_path)
    kept = np.r_[500:516, 900:916]
    trimmed = trim_version(tmp_path, "head", None, kept, "t")
    quantized = quantize_version(tmp_path, "t", None, None, QuantSpec.parse("int8", 16))
    assert (quantized / VOCAB_MAP_FILE).read_bytes() == (trimmed / VOCAB_MAP_FILE).read_bytes()
    space = read_space(quantized, len(kept))
    np.testing.assert_array_equal(space.original(np.arange(len(kept))), kept)
    assert (quantized / LABELS_FILE).read_text().split() == [f"t{i}" for i in kept]


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        (lambda v: (v / LABELS_FILE).write_bytes(b"\xff\xfe\n"), "is not UTF-8 text"),
        (lambda v: (v / LABELS_FILE).write_text("x\n" * (VOCAB + 1)), "has 1001 labels"),
        (lambda v: (v / VOCAB_MAP_FILE).write_text("{"), "is not a token map"),
    ],
)
def test_quantize_refuses_companions_the_service_would_refuse(
    tmp_path: Path, spoil: object, message: str
) -> None:
    """They were copied as they were: the new version published, then failed to load."""
    spoil(_head(tmp_path))  # type: ignore[operator]
    with pytest.raises(CheckpointError, match=message):
        quantize_version(tmp_path, "head", None, None, QuantSpec.parse("int8"))
    assert sorted(p.name for p in (tmp_path / "head").iterdir()) == ["1"]


def test_quantize_and_trim_refuse_weights_that_are_not_finite_floats(tmp_path: Path) -> None:
    """NaN weights quantized (exit 0) into a version that failed to load; float64 weights
    gave ``StopIteration:`` and nothing else."""
    table = _table()
    table[7, 3] = np.nan
    save_head(HeadWeights(table), tmp_path / "nan" / "1")  # no checks: as a foreign tool might
    with pytest.raises(CheckpointError, match="NaN or Inf .* row 7"):
        quantize_version(tmp_path, "nan", None, None, QuantSpec.parse("int8"))
    with pytest.raises(CheckpointError, match="NaN or Inf .* row 7"):
        trim_version(tmp_path, "nan", None, np.arange(10), "t")
    wide = save_head(HeadWeights.from_arrays(_table()), tmp_path / "wide" / "1")
    model = onnx.load(str(wide))
    (weight,) = [t for t in model.graph.initializer if t.name == "embedding.weight"]
    weight.CopyFrom(numpy_helper.from_array(_table().astype(np.float64), weight.name))
    onnx.save_model(model, str(wide))
    with pytest.raises(CheckpointError, match="weights are float64, expected one of float32"):
        quantize_version(tmp_path, "wide", None, None, QuantSpec.parse("int8"))
    assert not (tmp_path / "t").exists()


def test_keep_ranges_are_checked_against_the_head_before_any_id_is_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--keep 0-16777215`` on a 1000-token head took 1.2 GB before it was refused."""
    _head(tmp_path)
    where = ["--repository", str(tmp_path), "--name", "t"]
    for keep, said in [
        ("0-16777215", "16777215 is past the head's ids, [0, 1000)"),
        ("9-3", "'9-3' is neither an id nor a range"),
    ]:
        assert main(["trim", "head", "--keep", keep, *where]) == 2
        assert said in capsys.readouterr().err
    np.save(tmp_path / "objects.npy", np.array([1, "a"], dtype=object))
    (tmp_path / "corrupt.npy").write_bytes(b"\x93NUMPY garbage")
    for keep in ("objects.npy", "corrupt.npy"):
        assert main(["trim", "head", "--keep", str(tmp_path / keep), *where]) == 2
        assert "is no .npy of ids" in capsys.readouterr().err
    assert main(["trim", "head", "--keep", "0-9,5-14,14", *where]) == 0
    assert inspect_head(tmp_path / "t" / "1").vocab_size == 15


def test_retie_in_place_rewrites_the_data_file_instead_of_growing_it(tmp_path: Path) -> None:
    """onnx appended the repaired weights to the old data file: +256 KB, old bytes kept."""
    table = _table()
    path = save_head(
        HeadWeights.from_arrays(table, table.copy()), tmp_path / "v", external_data=True
    )
    assert main(["retie", str(path.parent), "--in-place"]) == 0
    assert inspect_head(path).tied
    assert (path.parent / "model.onnx.data").stat().st_size < table.nbytes + 2**16
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.onnx", "model.onnx.data"]


def test_a_failed_import_leaves_no_model_directory_and_no_staging(tmp_path: Path) -> None:
    """A failure after the model's directory was made left it empty, and the service listed
    a FAILED model; a killed import left ``.writing-*`` directories for good."""
    source = _checkpoint(tmp_path / "ckpt")

    def explode(staging: Path) -> None:
        raise OSError(28, "No space left on device", str(staging / "model.onnx"))

    with pytest.raises(OSError, match="No space left"):
        write_version(tmp_path / "models" / "other", None, explode)
    assert not (tmp_path / "models" / "other").exists()
    stale = tmp_path / "models" / "kept" / f"{STAGING_PREFIX}killed"
    held = tmp_path / "models" / "kept" / f"{STAGING_PREFIX}busy"
    stale.mkdir(parents=True)
    hold(stale).close()  # its writer died: the lock can be taken
    held.mkdir()
    with hold(held):  # a writer at work
        import_checkpoint(source, tmp_path / "models", "kept")
        assert sorted(p.name for p in (tmp_path / "models" / "kept").iterdir()) == [
            held.name,
            "1",
        ]


def test_the_last_version_number_is_refused_rather_than_published_unseen(
    tmp_path: Path,
) -> None:
    """After version 999999999999999999 the next import wrote a 19-digit directory the
    service does not read as a version."""
    source = _checkpoint(tmp_path / "ckpt")
    top = 10**18 - 1
    import_checkpoint(source, tmp_path / "models", "g", ImportOptions(to_version=top))
    with pytest.raises(CheckpointError, match="past the largest one served"):
        import_checkpoint(source, tmp_path / "models", "g")
    assert sorted(p.name for p in (tmp_path / "models" / "g").iterdir()) == [str(top)]


def test_loose_safetensors_files_that_cannot_be_one_checkpoint_are_refused(
    tmp_path: Path,
) -> None:
    """A FIFO named model.safetensors hung the import; a tensor in two files was taken from
    the last one silently."""
    source = _checkpoint(tmp_path / "ckpt")
    save_file({"model.embed_tokens.weight": _table(1)}, str(source / "other.safetensors"))
    with pytest.raises(CheckpointError, match="is in both model.safetensors and other"):
        import_checkpoint(source, tmp_path / "models", "m")
    (source / "other.safetensors").unlink()
    os.mkfifo(source / "pipe.safetensors")
    with pytest.raises(CheckpointError, match="pipe.safetensors is not a regular file"):
        import_checkpoint(source, tmp_path / "models", "m")


def test_tokenizer_mismatches_are_told_and_lone_surrogates_kept_as_escapes(
    tmp_path: Path,
) -> None:
    notes: list[str] = []
    (tmp_path / "tokenizer.json").write_text(
        json.dumps({"model": {"vocab": {"a": 0, "\ud800": 1, "far": 5000, "neg": -1}}})
    )
    labels = tokenizer_tokens(tmp_path, 4, notes)
    assert labels == ["a", "\\ud800", "", ""]
    assert notes == [
        "tokenizer.json: 2 token ids outside the head's 4 rows: dropped",
        "tokenizer.json: 2 of 4 rows have no token string",
    ]
    (tmp_path / "tokenizer.json").write_text('{"model": {"vocab": 5}}')
    assert tokenizer_tokens(tmp_path, 4, notes) is None
    assert notes[-1] == "tokenizer.json has no model.vocab: no token strings"


def test_import_notes_a_config_vocab_size_the_tensors_disagree_with(tmp_path: Path) -> None:
    source = _checkpoint(tmp_path / "ckpt", vocab_size=50257, model_type=["t5"])
    result = import_checkpoint(source, tmp_path / "models", "m")
    assert "config.json says vocab_size 50257; the embedding has 1000 rows" in result.notes


def _external_head(tmp_path: Path) -> Path:
    return save_head(HeadWeights.from_arrays(_table()), tmp_path / "v", external_data=True)


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        (lambda p: os.truncate(p.with_name("model.onnx.data"), 1000), "has 1000 bytes, too few"),
        (lambda p: _set_external(p, "offset", str(10**17)), "too few for 64000 at offset"),
        (lambda p: _set_external(p, "offset", str(2**64)), "whole numbers of at most 18 digits"),
        (lambda p: _set_external(p, "length", "128000"), "the length 64000"),
        (lambda p: _relink(p, "/etc/hostname"), "too few"),
        (lambda p: _relink(p, "/dev/zero"), "is not a regular file"),
    ],
)
def test_inspect_refuses_external_data_the_service_would_refuse(
    tmp_path: Path, spoil: object, message: str
) -> None:
    """inspect reported these heads healthy (exit 0); the service marks them FAILED."""
    path = _external_head(tmp_path)
    spoil(path)  # type: ignore[operator]
    with pytest.raises(HeadInspectionError, match=message):
        inspect_head(path)


def _spoil_dims(path: Path, dims: list[int]) -> None:
    """The table's dims rewritten in the graph, its bytes left as they were."""
    model = onnx.load(str(path))
    (table,) = [t for t in model.graph.initializer if t.name == EMBEDDING_WEIGHT]
    del table.dims[:]
    table.dims.extend(dims)
    onnx.save(model, str(path))


@pytest.mark.parametrize(
    ("dims", "message"),
    [
        ([-1000, -64], r"has negative dims \[-1000, -64\]"),
        ([2**31, 2**31], r"holds 64000 bytes, but its dims \[2147483648, 2147483648\]"),
    ],
)
def test_dims_the_service_refuses_are_refused_by_every_offline_command(
    tmp_path: Path, dims: list[int], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """inspect reported such a table as 18 EB (exit 0); quantize and trim answered with
    numpy's message. Each names the tensor and its dims now, and exits non-zero."""
    repository = tmp_path / "models"
    path = _head(repository) / "model.onnx"
    _spoil_dims(path, dims)
    with pytest.raises(HeadInspectionError, match=message):
        inspect_head(path)
    keep = tmp_path / "keep.txt"
    keep.write_text("1\n2\n")
    where = ["--repository", str(repository)]
    assert main(["inspect", str(path)]) != 0
    assert main(["quantize", "head", "--quantize", "int8", *where]) != 0
    assert main(["trim", "head", "--keep", str(keep), "--name", "small", *where]) != 0
    said = capsys.readouterr().err
    assert len(re.findall(message, said)) == 3, said


def _set_external(path: Path, key: str, value: str) -> None:
    model = onnx.load(str(path), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == key:
                entry.value = value
    onnx.save_model(model, str(path))


def _relink(path: Path, target: str) -> None:
    data = path.with_name("model.onnx.data")
    data.unlink()
    data.symlink_to(target)


def test_command_failures_are_one_line_with_the_right_status(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model path that is a file gave ``FileExistsError``; garbage for a head, a
    ``DecodeError`` (exit 1, and the type's name for a message)."""
    source = _checkpoint(tmp_path / "ckpt")
    models = tmp_path / "models"
    models.mkdir()
    (models / "file").write_text("")
    assert main(["import", str(source), "--repository", str(models), "--name", "file"]) == 2
    err = capsys.readouterr().err
    assert "is a file, not a model directory" in err
    assert err.count("\n") == 1
    assert "Traceback" not in err
    garbage = models / "junk" / "1"
    garbage.mkdir(parents=True)
    (garbage / "model.onnx").write_bytes(b"\x08garbage")
    assert main(["quantize", "junk", "--quantize", "int8", "--repository", str(models)]) == 2
    assert "is not a readable ONNX model" in capsys.readouterr().err


def test_demo_heads_appear_whole_or_not_at_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk left half a model.onnx that counted as present: later starts never wrote
    the demo again, and `lmhead demo` called it unreadable."""
    from service.heads import files as heads
    from service.tools.demo import DemoSpec, write_demo_models

    real = heads.save_head

    def half_then_full_disk(weights: HeadWeights, directory: Path, **options: object) -> Path:
        path = real(weights, directory)
        os.truncate(path, path.stat().st_size // 2)
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(heads, "save_head", half_then_full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_demo_models(tmp_path, DemoSpec(64, 8))
    assert list(tmp_path.iterdir()) == []  # an empty model directory is a model to the service
    monkeypatch.setattr(heads, "save_head", real)
    assert write_demo_models(tmp_path, DemoSpec(64, 8))[0] == tmp_path / "demo-tied" / "1"
    assert inspect_head(tmp_path / "demo-tied" / "1").vocab_size == 64


def test_a_busy_port_names_the_setting_that_chose_it() -> None:
    from service.hosting.listeners import check_free, listening_sockets

    (held,) = listening_sockets("127.0.0.1", 0)
    port = held.getsockname()[1]
    with (
        held,
        pytest.raises(
            SystemExit, match=f"127.0.0.1:{port}: .* \\(choose another with LMHEAD_GRPC_PORT\\)"
        ),
    ):
        check_free("127.0.0.1", port, "LMHEAD_GRPC_PORT")
