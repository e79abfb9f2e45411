"""The ONNX graph of a head: names, inputs, outputs and nodes (``service.heads.files`` writes
files).

Two independent sides share the weight when tied:

* embedding side: ``Gather(W_in, input_ids) -> embeddings`` (a flat list of ids);
* projection side: ``hidden_states (rows, d_model)`` divided by a per-row ``temperature``
  (rows, 1), ``Gemm(h, W_out, transB=1)``, then ``TopK`` (k per run, clamped to the vocab) and
  the log-sum-exp in the graph, so only (rows, k) values leave the runtime unless the caller
  asks for the full ``logits``. log-probs are ``topk_logits - logsumexp``.

Temperature is applied here and nowhere else: per row, so requests at different temperatures
share one batched run. ``Gemm(transB=1)`` reads W in its stored (vocab, d_model) layout; the
form exporters emit, ``MatMul(h, Transpose(W))``, gets the transpose constant-folded into a
second copy of W. A half-precision head (float16, bfloat16) keeps W in that dtype: the hidden
state is cast to it for the Gemm, the logits and embeddings back to float32, so the tie stays
one initializer and every input and output stays float32. A block-quantized head
(``service.heads.quantize``) projects with ``MatMulNBits`` and, when its table is quantized too,
looks rows up with ``GatherBlockQuantized`` on the same codes, scales and zero points (the codes
through one ``Reshape``: the two operators want them 3-D and 2-D).

Files carry ``IR_VERSION`` and ``OPSET``: onnxruntime 1.18 (the oldest lmhead supports) and
the newest onnxruntime-gpu both load them (onnx's own default IR version is newer than some
runtimes accept). Every input is required: the runtime feeds an empty tensor to the side it
does not use, which keeps ``InferenceSession.get_inputs()`` truthful.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper, numpy_helper

from service.heads.norm import FinalNorm, norm_graph_parts, norm_metadata
from service.heads.quantize import ACCURACY_LEVEL, QuantSpec

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
EMBEDDING_CODES = "embedding_codes"
CODES_SHAPE = "codes_shape"
D_MODEL = "d_model"
#: Where MatMulNBits and GatherBlockQuantized live (onnxruntime's contrib operators).
MS_DOMAIN = "com.microsoft"
#: Metadata of a quantized head: bits, block size, accuracy level, whether the table is too.
QUANTIZATION = "lmhead.quantization"
OUTPUT_WEIGHT = "lm_head.weight"
OUTPUT_BIAS = "lm_head.bias"
#: The dtypes a head's matrices may be stored in, and their ONNX element types.
ELEMENT_TYPES = {
    "float32": TensorProto.FLOAT,
    "float16": TensorProto.FLOAT16,
    "bfloat16": TensorProto.BFLOAT16,
}


@dataclass(frozen=True)
class HeadTransforms:
    """Model-specific steps around the matmul, applied in the graph so every front end has them.

    ``input_scale`` multiplies the hidden state (T5: d_model ** -0.5), ``logit_scale``
    multiplies the logits (Cohere), ``softcap`` gives ``tanh(logits / softcap) * softcap``
    (Gemma-2); a bias (Phi-2's lm_head.bias) is added to the logits. Temperature divides the
    result.
    """

    input_scale: float = 1.0
    logit_scale: float = 1.0
    softcap: float | None = None

    def __post_init__(self) -> None:
        """The graph holds them as float32: each must be finite and non-zero there (1e300
        passes a float64 check and becomes Inf, and every logit NaN or Inf)."""
        named = {"input_scale": self.input_scale, "logit_scale": self.logit_scale}
        if self.softcap is not None:
            named["softcap"] = self.softcap
        for name, value in named.items():
            as_stored = np.float32(value) if abs(value) < 3.4e38 else np.float32(np.inf)
            if not np.isfinite(as_stored) or as_stored == 0 or (name == "softcap" and value < 0):
                raise ValueError(
                    f"{name} must be a finite{' positive' if name == 'softcap' else ''}, "
                    f"non-zero float32, got {value!r:.40}"
                )

    @property
    def linear(self) -> bool:
        """True when temperature and scales can be folded into the hidden state."""
        return self.softcap is None

    def describe(self) -> dict[str, float]:
        shown = {"input_scale": self.input_scale, "logit_scale": self.logit_scale}
        shown = {key: value for key, value in shown.items() if value != 1.0}
        return shown | ({"softcap": self.softcap} if self.softcap is not None else {})


@dataclass(frozen=True)
class Head:
    """What the graph needs beyond the weight tensors themselves."""

    vocab_size: int
    d_model: int
    dtype: str = "float32"
    transforms: HeadTransforms = HeadTransforms()
    bias: npt.NDArray[np.float32] | None = None
    twin: bool = False
    quantization: QuantSpec | None = None
    """Block quantization of the output matrix (of the one matrix, when tied)."""
    table_quantized: bool = False
    """The embedding table is quantized too (always when tied and quantized)."""
    norm: FinalNorm | None = None
    """The model's final norm, a side of its own (``service.heads.norm``)."""


def head_model(weights: list[TensorProto], head: Head) -> onnx.ModelProto:
    """The model for one (tied) or two (untied) weights, metadata included. A quantized
    weight is three tensors (``quantized_names``); any other is one."""
    names = {tensor.name for tensor in weights}
    tied = not any(name.startswith(OUTPUT_WEIGHT) for name in names)
    output = EMBEDDING_WEIGHT if tied else OUTPUT_WEIGHT
    constants = [
        numpy_helper.from_array(np.array([head.vocab_size], np.int64), "vocab_size"),
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
        numpy_helper.from_array(np.array([1], np.int64), "one"),
    ]
    if head.bias is not None:
        constants.append(numpy_helper.from_array(head.bias, OUTPUT_BIAS))
    (before, after), transform_constants = _transform_nodes(head)
    if head.table_quantized:
        constants.append(_codes_shape(head))
        constants.append(numpy_helper.from_array(np.array([head.d_model], np.int64), D_MODEL))
    nodes = _embedding_nodes(EMBEDDING_WEIGHT, head) + before + _projection(output, head, after)
    inputs, outputs = _inputs(head.d_model), _outputs(head.vocab_size, head.d_model)
    if head.norm is not None:
        norm_nodes, norm_tensors, norm_input, norm_output = norm_graph_parts(head.norm)
        nodes, constants = nodes + norm_nodes, constants + norm_tensors
        inputs, outputs = [*inputs, norm_input], [*outputs, norm_output]
    graph = helper.make_graph(
        nodes,
        "lmhead_tied" if tied else "lmhead_untied",
        inputs,
        outputs,
        weights + constants + transform_constants,
    )
    opsets = [helper.make_opsetid("", OPSET)]
    if head.quantization is not None:
        opsets.append(helper.make_opsetid(MS_DOMAIN, 1))
    model = helper.make_model(
        graph,
        opset_imports=opsets,
        producer_name="lmhead",
        ir_version=IR_VERSION,
    )
    shown = head.transforms.describe() | ({"bias": True} if head.bias is not None else {})
    helper.set_model_props(
        model,
        {
            "lmhead.format": str(FORMAT),
            "lmhead.tied": str(tied).lower(),
            "lmhead.vocab_size": str(head.vocab_size),
            "lmhead.d_model": str(head.d_model),
            "lmhead.dtype": head.dtype,
            "lmhead.transforms": json.dumps(shown),
        }
        | ({UNTIED_ON_PURPOSE: "true"} if head.twin else {})
        | _quantization_metadata(head)
        | norm_metadata(head.norm),
    )
    return model


def _quantization_metadata(head: Head) -> dict[str, str]:
    spec = head.quantization
    if spec is None:
        return {}
    described = {
        "bits": spec.bits,
        "block_size": spec.block_size,
        "accuracy_level": ACCURACY_LEVEL,
        "table": head.table_quantized,
    }
    return {QUANTIZATION: json.dumps(described)}


def quantized_names(weight: str) -> tuple[str, str, str]:
    """The codes, scales and zero points of a quantized weight (``service.heads.quantize``)."""
    return f"{weight}.quant", f"{weight}.scales", f"{weight}.zero_points"


def _codes_shape(head: Head) -> TensorProto:
    """(vocab, bytes per row): ``GatherBlockQuantized`` wants the codes 2-D, ``MatMulNBits``
    3-D; one ``Reshape`` lets both read the same tensor (it is never folded: the loader
    splits the embedding side off, ``service.runtime.layout``)."""
    spec = head.quantization
    assert spec is not None
    row_bytes = spec.blocks(head.d_model) * spec.block_size * spec.bits // 8
    return numpy_helper.from_array(np.array([head.vocab_size, row_bytes], np.int64), CODES_SHAPE)


def _embedding_nodes(weight: str, head: Head) -> list[onnx.NodeProto]:
    dtype = head.dtype
    if head.table_quantized:
        spec = head.quantization
        assert spec is not None
        codes, scales, zero_points = quantized_names(weight)
        padded = spec.blocks(head.d_model) * spec.block_size != head.d_model
        gathered = "embeddings_padded" if padded else EMBEDDINGS
        trim = [  # whole blocks come out: drop the padding columns
            helper.make_node("Slice", [gathered, "zero", D_MODEL, "one"], [EMBEDDINGS], "trim")
        ]
        return [
            helper.make_node("Reshape", [codes, CODES_SHAPE], [EMBEDDING_CODES], "codes_2d"),
            helper.make_node(
                "GatherBlockQuantized",
                [EMBEDDING_CODES, INPUT_IDS, scales, zero_points],
                [gathered],
                "embedding_gather",
                domain=MS_DOMAIN,
                bits=spec.bits,
                block_size=spec.block_size,
                gather_axis=0,
                quantize_axis=1,
            ),
        ] + (trim if padded else [])
    if dtype == "float32":
        return [helper.make_node("Gather", [weight, INPUT_IDS], [EMBEDDINGS], "embedding_gather")]
    return [
        helper.make_node("Gather", [weight, INPUT_IDS], ["embedding_rows"], "embedding_gather"),
        helper.make_node("Cast", ["embedding_rows"], [EMBEDDINGS], to=TensorProto.FLOAT),
    ]


def _transform_nodes(
    head: Head,
) -> tuple[tuple[list[onnx.NodeProto], list[onnx.NodeProto]], list[TensorProto]]:
    """Nodes before the matmul (on the hidden state) and after it (on the logits).

    Without soft-cap or bias the scales and the temperature fold into the hidden state (exact:
    the logits are linear in it, and it costs d_model instead of vocab divisions per row). A
    bias or a soft-cap moves them after the matmul, where the temperature divides the logits.
    """
    transforms = head.transforms
    node = helper.make_node
    constants: list[TensorProto] = []
    before: list[onnx.NodeProto] = []
    after: list[onnx.NodeProto] = []

    def scalar(name: str, value: float) -> str:
        constants.append(numpy_helper.from_array(np.array([value], np.float32), name))
        return name

    on_hidden = transforms.linear and head.bias is None
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
    if head.bias is not None:
        after.append(node("Add", [logits, OUTPUT_BIAS], ["biased_logits"], "output_bias"))
        logits = "biased_logits"
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


def _projection(weight: str, head: Head, after: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """The matmul (in W's dtype), then in-graph top-k and log-sum-exp in float32.

    The log-sum-exp comes from the fused LogSoftmax kernel (one pass, multi-threaded;
    ReduceLogSumExp measured ~4x slower): lse = max - log_softmax[argmax], and TopK already
    found the max and the argmax.
    """
    node = helper.make_node
    projected = "raw_logits" if after else LOGITS
    if head.quantization is not None:
        spec = head.quantization
        matmul = [
            node(
                "MatMulNBits",
                ["scaled_hidden", *quantized_names(weight)],
                [projected],
                "output_projection",
                domain=MS_DOMAIN,
                K=head.d_model,
                N=head.vocab_size,
                bits=spec.bits,
                block_size=spec.block_size,
                accuracy_level=ACCURACY_LEVEL,
            )
        ]
    elif head.dtype == "float32":
        matmul = [
            node("Gemm", ["scaled_hidden", weight], [projected], "output_projection", transB=1)
        ]
    else:
        half = ELEMENT_TYPES[head.dtype]
        matmul = [
            node("Cast", ["scaled_hidden"], ["hidden_half"], "hidden_to_half", to=half),
            node("Gemm", ["hidden_half", weight], ["logits_half"], "output_projection", transB=1),
            node("Cast", ["logits_half"], [projected], "logits_to_float", to=TensorProto.FLOAT),
        ]
    return [
        *matmul,
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
