"""A model's final norm, kept in its head so residual states can be read through it.

The logit lens reads every layer of a model through its head: the final norm, then the
unembedding. A head that keeps its checkpoint's final norm can do both, exactly as the model
does, so callers may send residual (pre-norm) states. The norm is a small side of the graph of
its own, ``residual_states -> normed_states``, beside the embedding and the projection sides:
it never feeds the ``Gather`` (the tie is untouched) and it runs only when asked. The runtime
normalizes residual rows with it first (``HeadSession.normalize``); every later step (top-k,
allowed tokens, scoring, the lens) then reads final states, so each path has the norm without
a second implementation of it.

Two kinds cover the families lmhead imports:

* ``rms``: ``x / sqrt(mean(x^2) + eps) * w`` (Llama, Mistral, Qwen2, T5's decoder; Gemma's
  ``1 + w`` is folded into ``w`` at import);
* ``layer``: ``(x - mean(x)) / sqrt(var(x) + eps) * w + b`` (GPT-2's ``ln_f``, GPT-NeoX, OPT,
  Phi), onnx's ``LayerNormalization``.

Both compute in float32 (as transformers computes these norms, upcasting half-precision
states first); their weights are stored as float32 whatever the matrices' dtype.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper, numpy_helper

NormKind = Literal["rms", "layer"]
NORM_KINDS: tuple[NormKind, ...] = ("rms", "layer")
RESIDUAL_STATES = "residual_states"
NORMED_STATES = "normed_states"
NORM_WEIGHT = "final_norm.weight"
NORM_BIAS = "final_norm.bias"
NORM_EPSILON = "final_norm.epsilon"
#: Metadata: ``{"kind": "rms", "epsilon": 1e-05, "source": "model.norm.weight"}``.
FINAL_NORM = "lmhead.final_norm"
#: Residual rows whose largest |value| is past 2 ** NORM_SAFE_EXPONENT are scaled by a power
#: of two to below it before the norm runs (``within_norm_range``).
NORM_SAFE_EXPONENT = 40


@dataclass(frozen=True)
class FinalNorm:
    """A final norm over d_model: its kind, scale (the effective one: Gemma's ``1 + w``
    already added), bias (``layer`` only, optional) and epsilon."""

    kind: NormKind
    weight: npt.NDArray[np.floating]
    epsilon: float
    bias: npt.NDArray[np.floating] | None = None
    source: str = field(default="", compare=False)
    """Where it came from, for people (``model.norm.weight (1 + weight, Gemma)``)."""

    def __post_init__(self) -> None:
        if self.kind not in NORM_KINDS:
            raise ValueError(f"a final norm is one of {NORM_KINDS}, got {self.kind!r}")
        weight = np.ascontiguousarray(self.weight, dtype=np.float32)
        object.__setattr__(self, "weight", weight)
        if weight.ndim != 1 or weight.size == 0:
            raise ValueError(f"the final norm's weight must be 1-D (d_model,), got {weight.shape}")
        if not (np.isfinite(self.epsilon) and 0 < self.epsilon < 1):
            raise ValueError(f"the final norm's epsilon must be in (0, 1), got {self.epsilon!r}")
        if self.bias is not None:
            if self.kind == "rms":
                raise ValueError("an RMS norm has no bias")
            bias = np.ascontiguousarray(self.bias, dtype=np.float32)
            object.__setattr__(self, "bias", bias)
            if bias.shape != weight.shape:
                raise ValueError(f"final norm: bias {bias.shape}, weight {weight.shape}")
        for name, array in (("weight", weight), ("bias", self.bias)):
            if array is not None and not np.isfinite(array).all():
                raise ValueError(f"the final norm's {name} holds NaN or Inf (as float32)")

    @property
    def d_model(self) -> int:
        return int(self.weight.shape[0])

    def describe(self) -> dict[str, object]:
        shown: dict[str, object] = {"kind": self.kind, "epsilon": self.epsilon}
        if self.kind == "layer":
            shown["bias"] = self.bias is not None
        return shown | ({"source": self.source} if self.source else {})

    def apply(self, states: npt.NDArray[np.floating]) -> npt.NDArray[np.float64]:
        """The norm in float64 (the tests' reference; the service runs the graph's)."""
        x = np.asarray(states, dtype=np.float64)
        if self.kind == "rms":
            scaled = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.epsilon)
            return np.asarray(scaled * self.weight, np.float64)
        centred = x - x.mean(axis=-1, keepdims=True)
        scaled = centred / np.sqrt(np.mean(centred**2, axis=-1, keepdims=True) + self.epsilon)
        shifted = scaled * self.weight + (0.0 if self.bias is None else self.bias)
        return np.asarray(shifted, np.float64)


def within_norm_range(rows: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """``rows`` (rows, d_model), each row whose largest |value| passes 2^40 scaled by a power
    of two to just below it (exact: only exponents change); other rows as they are.

    Both norms are scale-invariant (``x / sqrt(mean(x^2) + eps)``, and the same of ``x -
    mean``) wherever ``eps`` is negligible beside ``mean(x^2)``, which at 2^39 and above it is
    by ~20 orders of magnitude. Unscaled, their float32 sum of squares overflows once |x|
    passes ~1.8e19 / sqrt(d_model): rows of magnitude 1e18 came out of an RMS norm as zeros
    and got all-zero logits (a uniform distribution), where the float64 reference ranks
    tokens as usual. A copy only when some row needs it; no (rows, d_model) temporary else.
    """
    peak = np.maximum(rows.max(axis=-1), -rows.min(axis=-1))
    big = peak > 2.0**NORM_SAFE_EXPONENT
    if not big.any():
        return rows
    _, exponents = np.frexp(peak[big])  # peak = m * 2^e, m in [0.5, 1)
    scaled = rows.copy()
    scaled[big] = np.ldexp(rows[big], (NORM_SAFE_EXPONENT - exponents)[:, None])
    return scaled


def norm_graph_parts(
    norm: FinalNorm,
) -> tuple[list[onnx.NodeProto], list[TensorProto], onnx.ValueInfoProto, onnx.ValueInfoProto]:
    """The norm side: nodes, initializers, its input and its output. Its rows are named
    apart from the projection's (``residual_rows``): a run feeds one side real rows and the
    other a filler row."""
    node = helper.make_node
    tensors = [numpy_helper.from_array(norm.weight, NORM_WEIGHT)]
    if norm.kind == "layer":
        bias = norm.bias if norm.bias is not None else np.zeros_like(norm.weight)
        tensors.append(numpy_helper.from_array(bias, NORM_BIAS))
        nodes = [
            node(
                "LayerNormalization",
                [RESIDUAL_STATES, NORM_WEIGHT, NORM_BIAS],
                [NORMED_STATES],
                "final_norm",
                axis=-1,
                epsilon=norm.epsilon,
            )
        ]
    else:
        tensors.append(numpy_helper.from_array(np.array([norm.epsilon], np.float32), NORM_EPSILON))
        nodes = [
            node("Mul", [RESIDUAL_STATES, RESIDUAL_STATES], ["norm_squares"], "norm_squares"),
            node("ReduceMean", ["norm_squares"], ["norm_mean"], "norm_mean", axes=[-1]),
            node("Add", ["norm_mean", NORM_EPSILON], ["norm_variance"], "norm_epsilon"),
            node("Sqrt", ["norm_variance"], ["norm_rms"], "norm_rms"),
            node("Div", [RESIDUAL_STATES, "norm_rms"], ["norm_scaled"], "norm_divide"),
            node("Mul", ["norm_scaled", NORM_WEIGHT], [NORMED_STATES], "final_norm"),
        ]
    value = helper.make_tensor_value_info
    d_model = norm.d_model
    inputs = value(RESIDUAL_STATES, TensorProto.FLOAT, ["residual_rows", d_model])
    outputs = value(NORMED_STATES, TensorProto.FLOAT, ["residual_rows", d_model])
    return nodes, tensors, inputs, outputs


def norm_metadata(norm: FinalNorm | None) -> dict[str, str]:
    return {} if norm is None else {FINAL_NORM: json.dumps(norm.describe())}


def read_norm(model: onnx.ModelProto) -> FinalNorm | None:
    """The final norm a head file holds (None without one); ``ValueError`` if mangled."""
    props = {prop.key: prop.value for prop in model.metadata_props}
    if FINAL_NORM not in props:
        return None
    tensors = {tensor.name: tensor for tensor in model.graph.initializer}
    try:
        described = json.loads(props[FINAL_NORM])
        weight = numpy_helper.to_array(tensors[NORM_WEIGHT])
        bias = numpy_helper.to_array(tensors[NORM_BIAS]) if NORM_BIAS in tensors else None
        return FinalNorm(
            described["kind"],
            weight,
            float(described["epsilon"]),
            bias if described.get("bias") else None,
            str(described.get("source", "")),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"metadata {FINAL_NORM} or its tensors are not valid ({error})") from None
