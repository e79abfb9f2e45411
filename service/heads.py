"""Build ONNX heads from numpy arrays: tied heads store ONE weight, untied heads two.

The graph has two independent sides that share the weight when tied:

* embedding side: ``Gather(W_in, input_ids) -> embeddings`` (a flat list of ids);
* projection side: ``hidden_states (rows, d_model)`` divided by a per-row ``temperature``
  (rows, 1), ``Gemm(h, W_out, transB=1)``, then ``TopK`` (k per run, clamped to the vocab) and
  the log-sum-exp in the graph, so only (rows, k) values leave the runtime unless the
  caller asks for the full ``logits``. log-probs are ``topk_logits - logsumexp``.

Temperature is applied here and nowhere else: per row, so requests at different temperatures
share one batched run. ``Gemm(transB=1)`` reads W in its stored (vocab, d_model) layout; the
form exporters emit, ``MatMul(h, Transpose(W))``, gets the transpose constant-folded by
onnxruntime into a second copy of W, so a tied head would cost 2x W in memory.

Files carry ``IR_VERSION`` and ``OPSET``: the oldest onnxruntime lmhead supports (1.18) and the
newest onnxruntime-gpu both load them (onnx's own default IR version is newer than some
runtimes accept).

Every input is required: the runtime feeds an empty tensor to the side it does not use, which
keeps ``InferenceSession.get_inputs()`` truthful and avoids overridable-initializer warnings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper, numpy_helper

from service.repository import DATA_FILE, MODEL_FILE

#: What every file lmhead writes declares; see the module docstring.
IR_VERSION = 10
OPSET = 17
#: ``lmhead.format`` of the files written here; 1 had one temperature per run.
FORMAT = 2
#: Metadata of an untied twin made on purpose (``HeadWeights.twin``).
UNTIED_ON_PURPOSE = "lmhead.untied_on_purpose"
HIDDEN_STATES = "hidden_states"
INPUT_IDS = "input_ids"
K = "k"
TEMPERATURE = "temperature"
TOPK_LOGITS = "topk_logits"
TOPK_TOKEN_IDS = "topk_token_ids"
LOGSUMEXP = "logsumexp"
LOGITS = "logits"
EMBEDDINGS = "embeddings"
EMBEDDING_WEIGHT = "embedding.weight"
OUTPUT_WEIGHT = "lm_head.weight"
OUTPUT_BIAS = "lm_head.bias"

#: Serialized protobuf messages cannot exceed 2 GiB; keep headroom for the graph itself.
PROTOBUF_LIMIT_BYTES = 2**31 - 64 * 2**20
#: Offsets of tensors in the external data file, so each one can be memory-mapped.
EXTERNAL_ALIGNMENT = 64 * 1024


@dataclass(frozen=True)
class HeadTransforms:
    """Model-specific steps around the matmul, applied in the graph so every front end has them.

    ``input_scale`` multiplies the hidden state (T5: d_model ** -0.5), ``bias`` is added to the
    logits (Phi-2's lm_head.bias), ``logit_scale`` multiplies them (Cohere), ``softcap`` gives
    ``tanh(logits / softcap) * softcap`` (Gemma-2). Temperature divides the result.
    """

    input_scale: float = 1.0
    logit_scale: float = 1.0
    softcap: float | None = None

    @property
    def linear(self) -> bool:
        """True when temperature and scales can be folded into the hidden state."""
        return self.softcap is None

    def describe(self) -> dict[str, float]:
        shown = {"input_scale": self.input_scale, "logit_scale": self.logit_scale}
        shown = {key: value for key, value in shown.items() if value != 1.0}
        return shown | ({"softcap": self.softcap} if self.softcap is not None else {})


@dataclass(frozen=True)
class HeadWeights:
    """The matrices of a head, each (vocab_size, d_model); ``output`` is None when tied."""

    embedding: npt.NDArray[np.float32]
    output: npt.NDArray[np.float32] | None = None
    bias: npt.NDArray[np.float32] | None = None
    transforms: HeadTransforms = HeadTransforms()
    twin: bool = False
    """An untied head whose output matrix starts as a copy of the table on purpose (to be
    fine-tuned apart): the file says so, so the inspector does not call it a broken tie."""

    @classmethod
    def from_arrays(
        cls,
        embedding: npt.ArrayLike,
        output: npt.ArrayLike | None = None,
        *,
        bias: npt.ArrayLike | None = None,
        transforms: HeadTransforms = HeadTransforms(),
        twin: bool = False,
    ) -> HeadWeights:
        """Check shapes and convert to contiguous float32, the served dtype on CPU."""
        table = _as_weight(embedding, "embedding")
        head = None if output is None else _as_weight(output, "output")
        if head is not None and head.shape != table.shape:
            raise ValueError(
                f"output weight shape {head.shape} does not match embedding shape {table.shape}"
            )
        vector = None if bias is None else np.ascontiguousarray(bias, dtype=np.float32)
        if vector is not None and vector.shape != (table.shape[0],):
            raise ValueError(f"bias must have shape ({table.shape[0]},), got {vector.shape}")
        return cls(table, head, vector, transforms, twin and head is not None)

    @property
    def tied(self) -> bool:
        return self.output is None

    @property
    def nbytes(self) -> int:
        return self.embedding.nbytes + (0 if self.output is None else self.output.nbytes)


def _as_weight(array: npt.ArrayLike, name: str) -> npt.NDArray[np.float32]:
    matrix = np.asarray(array)
    if matrix.ndim != 2 or matrix.size == 0:
        raise ValueError(
            f"{name} must be a non-empty 2-D (vocab_size, d_model) array, got shape {matrix.shape}"
        )
    if not np.issubdtype(matrix.dtype, np.floating):
        raise ValueError(f"{name} must have a floating dtype, got {matrix.dtype}")
    return np.ascontiguousarray(matrix, dtype=np.float32)


def build_head(weights: HeadWeights) -> onnx.ModelProto:
    """Build an in-memory head with the weights inline (fine below the protobuf limit)."""
    initializers = [numpy_helper.from_array(weights.embedding, EMBEDDING_WEIGHT)]
    if weights.output is not None:
        initializers.append(numpy_helper.from_array(weights.output, OUTPUT_WEIGHT))
    return _head_model(initializers, weights)


def save_head(
    weights: HeadWeights,
    directory: str | Path,
    *,
    external_data: bool | None = None,
    inline_limit_bytes: int = PROTOBUF_LIMIT_BYTES,
) -> Path:
    """Write ``model.onnx`` (and ``model.onnx.data`` when external) into ``directory``.

    ``external_data=None`` chooses external storage exactly when the weights exceed
    ``inline_limit_bytes`` (by default: would not fit in one protobuf message). External data
    is written straight from the numpy buffers (no second in-memory copy) at aligned offsets,
    so onnxruntime can memory-map it.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / MODEL_FILE
    if external_data is None:
        external_data = weights.nbytes > inline_limit_bytes
    if not external_data:
        onnx.save_model(build_head(weights), path)
        (directory / DATA_FILE).unlink(missing_ok=True)
        return path
    named = [(EMBEDDING_WEIGHT, weights.embedding)]
    if weights.output is not None:
        named.append((OUTPUT_WEIGHT, weights.output))
    initializers = _write_external(named, directory / DATA_FILE)
    onnx.save_model(_head_model(initializers, weights), path)
    return path


def _write_external(
    named: list[tuple[str, npt.NDArray[np.float32]]], data_path: Path
) -> list[TensorProto]:
    tensors = []
    with data_path.open("wb") as stream:
        for name, array in named:
            offset = -stream.tell() % EXTERNAL_ALIGNMENT + stream.tell()
            stream.seek(offset)
            array.tofile(stream)
            proto = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=array.shape)
            proto.data_location = TensorProto.EXTERNAL
            for key, value in (
                ("location", data_path.name),
                ("offset", str(offset)),
                ("length", str(array.nbytes)),
            ):
                proto.external_data.add(key=key, value=value)
            tensors.append(proto)
    return tensors


def _head_model(tensors: list[TensorProto], weights: HeadWeights) -> onnx.ModelProto:
    vocab_size, d_model = weights.embedding.shape
    tied = len(tensors) == 1
    embedding_name = tensors[0].name
    output_name = tensors[0].name if tied else tensors[1].name
    constants = [
        numpy_helper.from_array(np.array([vocab_size], np.int64), "vocab_size"),
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
        numpy_helper.from_array(np.array([1], np.int64), "one"),
    ]
    if weights.bias is not None:
        constants.append(numpy_helper.from_array(weights.bias, OUTPUT_BIAS))
    transform_nodes, transform_constants = _transform_nodes(weights)
    graph = helper.make_graph(
        _embedding_nodes(embedding_name) + _projection_nodes(output_name, weights, transform_nodes),
        "lmhead_tied" if tied else "lmhead_untied",
        _inputs(d_model),
        _outputs(vocab_size, d_model),
        tensors + constants + transform_constants,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="lmhead",
        ir_version=IR_VERSION,
    )
    helper.set_model_props(
        model,
        {
            "lmhead.format": str(FORMAT),
            "lmhead.tied": str(tied).lower(),
            "lmhead.vocab_size": str(vocab_size),
            "lmhead.d_model": str(d_model),
            "lmhead.transforms": json.dumps(
                weights.transforms.describe() | ({"bias": True} if weights.bias is not None else {})
            ),
        }
        | ({UNTIED_ON_PURPOSE: "true"} if weights.twin else {}),
    )
    return model


def _embedding_nodes(weight: str) -> list[onnx.NodeProto]:
    return [helper.make_node("Gather", [weight, INPUT_IDS], [EMBEDDINGS], "embedding_gather")]


def _transform_nodes(
    weights: HeadWeights,
) -> tuple[tuple[list[onnx.NodeProto], list[onnx.NodeProto]], list[TensorProto]]:
    """Nodes before the matmul (on the hidden state) and after it (on the logits).

    Without soft-cap or bias the scales and the temperature fold into the hidden state (exact:
    the logits are linear in it, and it costs d_model instead of vocab divisions per row). A
    bias or a soft-cap moves them after the matmul, where the temperature divides the logits.
    """
    transforms = weights.transforms
    node = helper.make_node
    constants: list[TensorProto] = []
    before: list[onnx.NodeProto] = []
    after: list[onnx.NodeProto] = []

    def scalar(name: str, value: float) -> str:
        constants.append(numpy_helper.from_array(np.array([value], np.float32), name))
        return name

    on_hidden = transforms.linear and weights.bias is None
    hidden_scale = transforms.input_scale * (transforms.logit_scale if on_hidden else 1.0)
    current = HIDDEN_STATES
    if hidden_scale != 1.0:
        before.append(node("Mul", [current, scalar("input_scale", hidden_scale)], ["scaled_in"]))
        current = "scaled_in"
    if on_hidden:
        before.append(node("Div", [current, TEMPERATURE], ["scaled_hidden"], "apply_temperature"))
        return (before, after), constants
    before.append(node("Identity", [current], ["scaled_hidden"]))
    logits = "raw_logits"
    if transforms.logit_scale != 1.0:
        scale = scalar("logit_scale", transforms.logit_scale)
        after.append(node("Mul", [logits, scale], ["scaled_logits"], "logit_scale"))
        logits = "scaled_logits"
    if transforms.softcap is not None:
        cap = scalar("softcap", transforms.softcap)
        after += [
            node("Div", [logits, cap], ["capped_in"]),
            node("Tanh", ["capped_in"], ["capped_tanh"]),
            node("Mul", ["capped_tanh", cap], ["capped_logits"], "softcap"),
        ]
        logits = "capped_logits"
    after.append(node("Div", [logits, TEMPERATURE], [LOGITS], "apply_temperature"))
    return (before, after), constants


def _projection_nodes(
    weight: str,
    weights: HeadWeights,
    transforms: tuple[list[onnx.NodeProto], list[onnx.NodeProto]],
) -> list[onnx.NodeProto]:
    """Projection, in-graph top-k and log-sum-exp.

    The log-sum-exp comes from the fused LogSoftmax kernel (one pass, multi-threaded;
    ReduceLogSumExp measured ~4x slower): lse = max - log_softmax[argmax], and TopK already
    found the max and the argmax.
    """
    node = helper.make_node
    before, after = transforms
    gemm_inputs = ["scaled_hidden", weight] + ([OUTPUT_BIAS] if weights.bias is not None else [])
    gemm_output = LOGITS if not after else "raw_logits"
    return [
        *before,
        node("Gemm", gemm_inputs, [gemm_output], "output_projection", transB=1),
        *after,
        node("Min", [K, "vocab_size"], ["k_clamped"], "clamp_k"),
        node(
            "TopK",
            [LOGITS, "k_clamped"],
            [TOPK_LOGITS, TOPK_TOKEN_IDS],
            "topk",
            axis=1,
            largest=1,
            sorted=1,
        ),
        node("LogSoftmax", [LOGITS], ["log_softmax"], "log_softmax", axis=1),
        node("Slice", [TOPK_LOGITS, "zero", "one", "one"], ["row_max"], "row_max"),
        node("Slice", [TOPK_TOKEN_IDS, "zero", "one", "one"], ["row_argmax"], "row_argmax"),
        node(
            "GatherElements",
            ["log_softmax", "row_argmax"],
            ["max_log_softmax"],
            "max_log_softmax",
            axis=1,
        ),
        node("Sub", ["row_max", "max_log_softmax"], ["row_lse"], "row_lse"),
        node("Squeeze", ["row_lse", "one"], [LOGSUMEXP], "squeeze_lse"),
    ]


def _inputs(d_model: int) -> list[onnx.ValueInfoProto]:
    """Rows are 2-D; the runtime flattens a caller's leading dims and restores them (a view)."""
    value = helper.make_tensor_value_info
    return [
        value(HIDDEN_STATES, TensorProto.FLOAT, ["rows", d_model]),
        value(INPUT_IDS, TensorProto.INT64, ["ids"]),
        value(K, TensorProto.INT64, [1]),
        value(TEMPERATURE, TensorProto.FLOAT, ["rows", 1]),
    ]


def _outputs(vocab_size: int, d_model: int) -> list[onnx.ValueInfoProto]:
    value = helper.make_tensor_value_info
    return [
        value(TOPK_LOGITS, TensorProto.FLOAT, ["rows", "k"]),
        value(TOPK_TOKEN_IDS, TensorProto.INT64, ["rows", "k"]),
        value(LOGSUMEXP, TensorProto.FLOAT, ["rows"]),
        value(LOGITS, TensorProto.FLOAT, ["rows", vocab_size]),
        value(EMBEDDINGS, TensorProto.FLOAT, ["ids", d_model]),
    ]
