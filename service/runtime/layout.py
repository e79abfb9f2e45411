"""How a head file is laid out in memory for the provider that runs it (the loader's choice).

* On CUDA the file runs as written; a half-precision head runs natively.
* On a CPU a half-precision head is widened to float32 (there is no float16 or bfloat16 Gemm:
  onnxruntime would keep a float32 copy beside the half one, 1.58x float32 W resident, or has
  no kernel at all), row chunk by row chunk, into a scratch directory.
* On a CPU a tied head in ``shared`` memory mode is *split*: the session holds the projection
  only, so onnxruntime packs W for its Gemm and frees the original (the packed copy is the one
  copy in memory), and embedding rows are read from the same weight file with ``pread``
  (``service.runtime.rows``: page cache, not the process's memory). Keeping one tensor inside
  onnxruntime for both sides instead means running the Gemm unpacked, which re-packs W on
  every call: measured 1.2-1.8x slower than ``fast`` (50257 x 768). Split, it runs at
  ``fast`` speed with ~1.1x W resident.
* On a CPU every head's graph can also take its log-sum-exp a few rows at a time
  (``service.heads.lse_graph``): a scoring run then holds one rows x vocab tensor, not two. The
  files on disk are not changed; the session loads a copy of the graph from scratch.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from service.heads.files import read_head, save_head
from service.heads.graph import OUTPUT_BIAS
from service.heads.inspector import HeadReport, inspect_head
from service.heads.lse_graph import add_chunked_logsumexp
from service.heads.projection_only import without_embedding
from service.heads.quantize import QuantSpec
from service.runtime.providers import CUDA
from service.runtime.rows import FileRows, QuantizedRows, RowSource
from service.runtime.runner import INLINE_MACS
from service.runtime.session import RUNTIME_VERSION, HeadSession
from service.runtime.vocabulary import CandidateLogits
from service.settings import MemoryMode

PROJECTION_FILE = "projection.onnx"
#: Initializers up to this size stay in a derived graph file; larger ones move beside it.
INLINE_KEEP_BYTES = 2**20


@dataclass(frozen=True)
class Placement:
    """Where and how heads run (from the settings)."""

    memory_mode: MemoryMode = "shared"
    intra_op_threads: int = 0
    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    tf32: bool = False


def open_head(
    path: str | Path,
    placement: Placement = Placement(),
    *,
    report: HeadReport | None = None,
    scratch: Path | None = None,
) -> HeadSession:
    """A session for the head at ``path``, laid out as the module docstring says.

    ``scratch`` receives any file made on the way (widened or split copies; a temporary
    directory by default); it may be removed once this returns: what onnxruntime and the
    memory map hold stays readable. ``report`` saves a second inspection when the caller
    has one.
    """
    path = Path(path)
    report = report or inspect_head(path)
    if scratch is None:
        with tempfile.TemporaryDirectory(prefix="lmhead-open-") as directory:
            return open_head(path, placement, report=report, scratch=Path(directory))
    served = servable_path(path, report.dtype, placement.providers, scratch / "float32")
    placement = _threads_for(report, placement)
    split = _splits(report, placement)
    check_runtime(report, split)
    on_cpu = CUDA not in placement.providers
    if split:
        session = _split(served, report, placement, scratch / "split", chunked=on_cpu)
    else:
        if on_cpu:  # candidate rows below then link its weight files rather than copy them
            served = chunked_copy(served, scratch / "chunked")
        session = HeadSession(
            served,
            tied=report.tied,
            memory_mode=placement.memory_mode,
            intra_op_threads=placement.intra_op_threads,
            providers=placement.providers,
            tf32=placement.tf32,
        )
    session.candidates = candidate_logits(session, served, report, scratch / "rows")
    return session


def _threads_for(report: HeadReport, placement: Placement) -> Placement:
    """One intra-op thread for a head whose rows run on the event loop (``INLINE_MACS``) when
    the settings leave the count to onnxruntime: its second thread, woken for most runs of
    such a head (0.9 wakes per one-row run), cost more than it split (+6 us of CPU a run in
    process, twice that in the service, a context switch each)."""
    tiny = report.vocab_size * report.d_model <= INLINE_MACS
    if placement.intra_op_threads or CUDA in placement.providers or not tiny:
        return placement
    return dataclasses.replace(placement, intra_op_threads=1)


def candidate_logits(
    session: HeadSession, served: Path, report: HeadReport, into: Path
) -> CandidateLogits | None:
    """Logits of chosen tokens from their rows of the projection matrix: a tied head's rows
    come from its one table (the split file's ``pread``, or the session's own Gather), an
    untied head's from its output matrix's bytes in the served file (inline ones moved to
    ``into``, on disk, not in memory). None when the matrix is not stored one row per token
    (a foreign ``MatMul`` layout): candidates then come from full logits. None for a
    quantized head too: its projection quantizes the hidden state as well (``MatMulNBits``,
    accuracy level 4: int8 activations), so logits from its dequantized rows differ from the
    graph's by up to ~0.1, enough to reorder near ties (a zero ``logit_bias`` changed a top-1);
    its candidates are the graph's own full logits."""
    if report.quantization is not None:
        return None
    transforms = report.transforms
    rows: RowSource | None = session.rows if report.tied else None
    if rows is None and report.tied and report.quantization is None:
        rows = SessionRows(session)
    tensors: dict[str, onnx.TensorProto] = {}
    if rows is None or transforms.get("bias"):  # read the graph (inline bytes too) only then
        model = onnx.load(str(served), load_external_data=False)
        tensors = {tensor.name: tensor for tensor in model.graph.initializer}
    if rows is None:
        rows = _output_rows(tensors, report, served.parent, into)
    if rows is None:
        return None
    bias = None
    if transforms.get("bias"):
        if OUTPUT_BIAS not in tensors:
            return None
        bias = numpy_helper.to_array(tensors[OUTPUT_BIAS], str(served.parent)).astype(np.float32)
    return CandidateLogits(
        rows,
        float(transforms.get("input_scale", 1.0)),
        float(transforms.get("logit_scale", 1.0)),
        None if transforms.get("softcap") is None else float(transforms["softcap"]),
        bias,
    )


class SessionRows:
    """Rows of a tied head's one table through the session's own Gather."""

    def __init__(self, session: HeadSession) -> None:
        self._session = session

    def rows(self, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.float32]:
        return self._session.embed(ids)

    def drop(self) -> None:
        """Nothing is mapped here: the session holds the table."""


def _output_rows(
    tensors: dict[str, onnx.TensorProto], report: HeadReport, directory: Path, into: Path
) -> RowSource | None:
    quantization = report.quantization
    names = quantization["projection_tensors"] if quantization else [report.projection_initializer]
    if any(name not in tensors for name in names):
        return None
    parts = [tensors[name] for name in names]
    if parts[0].dims[0] != report.vocab_size:
        return None
    if quantization is None and list(parts[0].dims) != [report.vocab_size, report.d_model]:
        return None
    return _row_source(parts, report, directory, into)


def _row_source(
    tensors: list[onnx.TensorProto], report: HeadReport, directory: Path, into: Path
) -> RowSource:
    """Rows of one matrix (or its codes, scales and zero points) read with ``pread`` from
    files in ``into``: inline tensors are moved there (the protos then refer to them),
    external ones linked from ``directory``. The head's own directory is never written to."""
    _place_in(into, tensors, directory)
    files = tuple(FileRows.of(tensor, into) for tensor in tensors)
    quantization = report.quantization
    if quantization is None:
        return files[0]
    spec = QuantSpec(quantization["bits"], quantization["block_size"])
    return QuantizedRows(files, spec, report.d_model)


def required_runtime(report: HeadReport, split: bool) -> tuple[int, int]:
    """The oldest onnxruntime that runs this head as laid out: 8-bit ``MatMulNBits`` came in
    1.22, ``GatherBlockQuantized`` on uint8 codes with ``bits`` in 1.23, and it looks 4-bit
    rows up right from 1.27 (1.23-1.26 answered wrong rows at some widths: 58% of the values
    at d_model 96, block 32; all measured); 4-bit projections and float heads run on 1.18,
    lmhead's oldest."""
    quantization = report.quantization
    if quantization is None:
        return (1, 18)
    if quantization["table"] and not split:
        return (1, 27) if quantization["bits"] == 4 else (1, 23)
    return (1, 22) if quantization["bits"] == 8 else (1, 18)


def runtime_for(report: HeadReport, placement: Placement) -> tuple[int, int]:
    """The oldest onnxruntime that runs this head as ``open_head`` lays it out there."""
    return required_runtime(report, _splits(report, placement))


def check_runtime(report: HeadReport, split: bool) -> None:
    needed = required_runtime(report, split)
    if needed > RUNTIME_VERSION:
        raise ValueError(
            f"this {report.dtype} head needs onnxruntime >= {needed[0]}.{needed[1]} laid out "
            f"{'split' if split else 'in one session'}; this is onnxruntime {ort.__version__}"
        )


def _splits(report: HeadReport, placement: Placement) -> bool:
    """Tied heads split in ``shared`` mode on a CPU; quantized tied heads everywhere (CUDA's
    ``GatherBlockQuantized`` takes no float32 scales)."""
    if not report.tied:
        return False
    if report.quantization is not None:
        return placement.memory_mode == "shared" or CUDA in placement.providers
    return placement.memory_mode == "shared" and CUDA not in placement.providers


def servable_path(path: Path, dtype: str, providers: tuple[str, ...], into: Path) -> Path:
    """The file to run: as it is on CUDA, in float32 or quantized; widened on a CPU."""
    if dtype not in ("float16", "bfloat16") or CUDA in providers:
        return path
    return save_head(read_head(path), into, widen=True)


def _split(
    path: Path, report: HeadReport, placement: Placement, into: Path, *, chunked: bool
) -> HeadSession:
    """A projection-only session plus the table's rows read from the weight file(s), both
    made in ``into``: the head's own directory is never written to. ``chunked``: the
    log-sum-exp in row chunks beside the written one (``service.heads.lse_graph``; CPU)."""
    model = onnx.load(str(path), load_external_data=False)
    initializers = {tensor.name: tensor for tensor in model.graph.initializer}
    quantization = report.quantization
    names = quantization["table_tensors"] if quantization else [report.embedding_initializer]
    tensors = [initializers[name] for name in names]
    rows = _row_source(tensors, report, path.parent, into)  # the projection refers to them
    projection = without_embedding(model)
    if chunked:
        add_chunked_logsumexp(projection)
    onnx.save(projection, str(into / PROJECTION_FILE))
    return HeadSession(
        into / PROJECTION_FILE,
        tied=False,  # the session's weight feeds the projection alone: packed, original freed
        memory_mode=placement.memory_mode,
        intra_op_threads=placement.intra_op_threads,
        providers=placement.providers,
        tf32=placement.tf32,
        rows=rows,
    )


def chunked_copy(path: Path, into: Path) -> Path:
    """The head at ``path`` with its log-sum-exp in row chunks beside the written one
    (``service.heads.lse_graph``), in ``into``: weights stored in the file move to files there (as
    ``_row_source`` moves a table), external ones are linked. ``path`` itself when its graph
    has another form."""
    model = onnx.load(str(path), load_external_data=False)
    if not add_chunked_logsumexp(model):
        return path
    _place_in(into, list(model.graph.initializer), path.parent, inline_up_to=INLINE_KEEP_BYTES)
    onnx.save(model, str(into / path.name))
    return into / path.name


def _place_in(
    into: Path, tensors: list[onnx.TensorProto], directory: Path, *, inline_up_to: int = 0
) -> None:
    """Make ``tensors`` refer to files in ``into``: inline ones larger than ``inline_up_to``
    bytes move there (the proto held them once), external ones are linked from ``directory``."""
    into.mkdir(parents=True, exist_ok=True)
    for tensor in tensors:
        location = _external_location(tensor)
        if location is None:
            if tensor.ByteSize() > inline_up_to:
                _move_to_file(tensor, into / f"{tensor.name}.data")
        elif not (into / location).exists():
            _link_or_copy(directory / location, into / location)


def _external_location(tensor: onnx.TensorProto) -> str | None:
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return None
    info: dict[str, str] = {entry.key: entry.value for entry in tensor.external_data}
    return info["location"]


def _move_to_file(tensor: onnx.TensorProto, data_path: Path) -> None:
    """Write an inline tensor's bytes to ``data_path`` (offset 0: memory-mappable) and make
    the tensor refer to them, without a second copy of the bytes in memory."""
    if tensor.HasField("raw_data"):
        data_path.write_bytes(tensor.raw_data)
        length = len(tensor.raw_data)
    else:  # values in typed fields (rare; written by hand)
        values = numpy_helper.to_array(tensor)
        values.tofile(data_path)
        length = values.nbytes
    for field in ("raw_data", "float_data", "int32_data"):
        tensor.ClearField(field)
    del tensor.external_data[:]
    for key, value in (("location", data_path.name), ("offset", "0"), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    tensor.data_location = onnx.TensorProto.EXTERNAL


def _link_or_copy(source: Path, target: Path) -> None:
    """A hard link (onnxruntime refuses external data behind a symlink that leaves the
    model's directory); a copy across file systems."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)
