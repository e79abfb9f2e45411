"""``lmhead retie``: repair an exported head whose tied weight was duplicated.

``torch.onnx.export`` with constant folding writes a tied W twice: as itself for the Gather and
as a folded W^T for the MatMul (pytorch#108342); some checkpoints carry a redundant identical
copy. The inspector finds these (``duplicate``); this rewires the projection to read the
embedding initializer and drops the copy:

* identical copy: every use of the copy reads the embedding instead (for a block-quantized
  head, the projection's codes, scales and zero points read the table's);
* transposed copy: ``MatMul(h, W^T)`` becomes ``FusedMatMul(h, W, transB=1)`` (onnxruntime's
  contrib op, any rank, no transpose at run time), ``Gemm`` flips ``transB``, and a
  ``Transpose`` of the copy is bypassed.

The repaired model is checked on random inputs against the original: every output must match
(a final norm's ``normed_states`` included: its side is left as it was).
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
from onnx import helper

from service.heads.external import stored_tensors
from service.heads.inspector import HeadInspectionError, inspect_head, resolve_model_path
from service.runtime.layout import check_runtime

CONTRIB_DOMAIN = "com.microsoft"
#: onnx keeps tensors under 1024 bytes in the model file by default.
ONNX_INLINE_BYTES = 1024


@dataclass(frozen=True)
class RetieResult:
    output: Path
    bytes_saved: int
    max_abs_difference: float


def retie(path: str | Path, output: str | Path | None = None) -> RetieResult:
    """Rewire the duplicated weight to the embedding, verify, and save (in place by default)."""
    source = resolve_model_path(path)
    if output is None or Path(output).resolve().parent == source.resolve().parent:
        _refuse_links(source)
    report = inspect_head(source)
    if report.tied:
        raise HeadInspectionError(f"{source} is tied already: nothing to repair")
    if report.duplicate is None:
        raise HeadInspectionError(
            f"{source} is an honest untied head: {report.projection_initializer} differs from "
            f"{report.embedding_initializer}; use `lmhead import --tie` to force a tie"
        )
    original = onnx.load(str(source))
    repaired = onnx.load(str(source))
    keep, drop = report.embedding_initializer, report.projection_initializer
    pairs = [(drop, keep)]
    if report.quantization:  # codes, scales and zero points, each read from the table's
        quantized = report.quantization
        pairs = list(zip(quantized["projection_tensors"], quantized["table_tensors"], strict=True))
    if report.duplicate == "identical":
        for old, new in pairs:
            _rename_input(repaired.graph, old, new)
    else:
        _rewire_transposed(repaired, drop, keep)
    dropped = {old for old, _ in pairs}
    remaining = [t for t in repaired.graph.initializer if t.name not in dropped]
    del repaired.graph.initializer[:]
    repaired.graph.initializer.extend(remaining)
    _say_tied(repaired)
    onnx.checker.check_model(repaired)
    try:  # the tied head runs as one session in the check below
        check_runtime(report, split=False)
    except ValueError as error:
        raise HeadInspectionError(f"cannot check the retied head: {error}") from None
    difference = _compare(original, repaired)
    target = Path(output) if output is not None else source
    external = report.external_data or repaired.ByteSize() > 2**31 - 2**26
    _save(repaired, target, external)
    return RetieResult(target, report.duplicate_bytes, difference)


def _refuse_links(source: Path) -> None:
    """A head rewritten where it lies (a served version, with ``--in-place``) is read as the
    loader reads a version: no file of it through a link. Read through one, a data file
    linked out of the repository would be written back beside the model as a regular file,
    and served; the loader refuses the same link (so do recent onnx releases for a data
    file, not the older ones lmhead supports, and none for the model file)."""
    graph = onnx.load(str(source), load_external_data=False).graph
    locations = {
        entry.value
        for tensor in stored_tensors(graph)
        for entry in tensor.external_data
        if entry.key == "location"
    }
    for path in [source, *(source.parent / location for location in sorted(locations))]:
        if path.is_symlink():
            raise HeadInspectionError(
                f"{path.name} is a link; a head rewritten in place is read as the service "
                "loads it, without links: write the repaired head elsewhere with --output"
            )


def _save(model: onnx.ModelProto, target: Path, external: bool) -> None:
    """Written beside ``target``, then renamed into place (the data file first): onnx appends
    external data to a file already there (the old bytes stayed, and the file grew), and a
    write that fails (no space) must leave the head as it was."""
    target.parent.mkdir(parents=True, exist_ok=True)
    data_name = f"{target.name}.data"
    with tempfile.TemporaryDirectory(prefix=".retie-", dir=target.parent) as scratch:
        written = Path(scratch) / target.name
        onnx.save_model(
            model,
            str(written),
            save_as_external_data=external,
            location=data_name,
            size_threshold=_inline_bytes(model),
        )
        if written.with_name(data_name).exists():
            os.replace(written.with_name(data_name), target.with_name(data_name))
        os.replace(written, target)


def _inline_bytes(model: onnx.ModelProto) -> int:
    """The size below which a tensor stays in the model file when the rest goes to external
    data: past every vector (the final norm's weight and bias, an output bias), which readers
    of the graph alone take from it (``service.heads.norm.read_norm``). onnx compares
    ``sys.getsizeof`` of the bytes, a few dozen past their length: the margin covers it."""
    vectors = (
        int(math.prod(tensor.dims)) * helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
        for tensor in model.graph.initializer
        if len(tensor.dims) <= 1
    )
    return max([ONNX_INLINE_BYTES, *(ONNX_INLINE_BYTES + nbytes for nbytes in vectors)])


def _say_tied(model: onnx.ModelProto) -> None:
    """The metadata of an lmhead file says what it now is (it said ``lmhead.tied: false``)."""
    for prop in model.metadata_props:
        if prop.key == "lmhead.tied":
            prop.value = "true"
    if model.graph.name == "lmhead_untied":
        model.graph.name = "lmhead_tied"


def _rename_input(graph: onnx.GraphProto, old: str, new: str) -> None:
    for node in graph.node:
        for index, name in enumerate(node.input):
            if name == old:
                node.input[index] = new


def _rewire_transposed(model: onnx.ModelProto, drop: str, keep: str) -> None:
    """Consumers of W^T read W, with the transposition moved into the operator."""
    graph = model.graph
    for node in list(graph.node):
        if drop not in node.input:
            continue
        if node.op_type == "Transpose":  # Transpose(W^T) is W itself
            _rename_input(graph, node.output[0], keep)
            graph.node.remove(node)
        elif node.op_type == "Gemm" and list(node.input).index(drop) == 1:
            _flip_trans_b(node)
            _rename_input_of(node, drop, keep)
        elif node.op_type == "MatMul" and node.input[1] == drop:
            fused = helper.make_node(
                "FusedMatMul",
                [node.input[0], keep],
                list(node.output),
                node.name,
                domain=CONTRIB_DOMAIN,
                transB=1,
            )
            graph.node.insert(list(graph.node).index(node), fused)
            graph.node.remove(node)
            if not any(o.domain == CONTRIB_DOMAIN for o in model.opset_import):
                model.opset_import.append(helper.make_opsetid(CONTRIB_DOMAIN, 1))
        else:
            raise HeadInspectionError(f"cannot rewire a {node.op_type} that reads {drop!r}")


def _flip_trans_b(node: onnx.NodeProto) -> None:
    for attribute in node.attribute:
        if attribute.name == "transB":
            attribute.i = 1 - attribute.i
            return
    node.attribute.append(helper.make_attribute("transB", 1))


def _rename_input_of(node: onnx.NodeProto, old: str, new: str) -> None:
    for index, name in enumerate(node.input):
        if name == old:
            node.input[index] = new


def _compare(original: onnx.ModelProto, repaired: onnx.ModelProto) -> float:
    """Largest absolute output difference on random inputs (raises if any output differs)."""
    first = ort.InferenceSession(original.SerializeToString(), providers=["CPUExecutionProvider"])
    second = ort.InferenceSession(repaired.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {value.name: _random_input(value, original) for value in first.get_inputs()}
    worst = 0.0
    for before, after in zip(first.run(None, feeds), second.run(None, feeds), strict=True):
        if not np.allclose(before, after, rtol=1e-5, atol=1e-5):
            raise HeadInspectionError("the repaired graph changes the outputs; nothing was saved")
        if np.issubdtype(np.asarray(before).dtype, np.floating):
            worst = max(worst, float(np.max(np.abs(before - after), initial=0.0)))
    return worst


def _random_input(value: ort.NodeArg, model: onnx.ModelProto) -> npt.NDArray[np.generic]:
    shape = [dim if isinstance(dim, int) else 2 for dim in value.shape]
    rng = np.random.default_rng(0)
    if value.name == "k":  # lmhead's own heads: a small top-k and temperature 1
        return np.array([3], np.int64)
    if value.name == "temperature":
        return np.ones(shape, np.float32)
    if "int" in value.type:  # token ids: below the smallest 2-D weight dimension
        bound = min(min(t.dims) for t in model.graph.initializer if len(t.dims) == 2)
        return rng.integers(0, bound, size=shape, dtype=np.int64)
    return rng.standard_normal(shape).astype(np.float32)
