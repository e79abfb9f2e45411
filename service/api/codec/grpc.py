"""Open Inference Protocol over gRPC: ``ModelInferRequest`` <-> the data plane's messages.

A protobuf request becomes the REST codec's own header (each input with name, shape,
datatype and either typed ``data`` or a ``binary_data_size`` into the concatenated
``raw_input_contents``), so gRPC and REST share every check and every message. Answers go
out as Triton's do: every output in ``raw_output_contents`` (typed ``contents`` for all of
them when the request says ``binary_data_output: false``), the tie in ``parameters``.

The message classes come from ``tritonclient.grpc`` (generated from Triton's published
``grpc_service.proto``, a superset of KServe's ``grpc_predict_v2.proto``: same package,
service, messages and field numbers, so KServe's clients speak it too).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
from tritonclient.grpc import service_pb2 as pb

from service.api.codec import v2
from service.api.codec.v2outputs import OutputPlan, select
from service.digits import decimal
from service.errors import InvalidInput
from service.messages import HeadInfo, InferRequest, InferResult, Target

#: Typed ``contents`` field per numeric datatype (FP16 has none: it travels raw only).
CONTENTS = {
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "INT64": "int64_contents",
    "INT32": "int_contents",
}
#: Typed values go to and from numpy this many at a time: a Python list of them costs ~8x
#: their bytes (a 49 MB answer peaked at +517 MB through ``tolist``).
CONTENTS_CHUNK = 1 << 16


def target(name: str, version: str) -> Target:
    """``model_name`` and ``model_version`` ("" = the served version)."""
    number = decimal(version) if version else None
    if version and number is None:
        raise InvalidInput(f"model_version must be a non-negative integer, got {version[:32]!r}")
    return Target(name, number)


def parameters(mapping: Mapping[str, Any]) -> dict[str, Any]:
    """An ``InferParameter`` (or repository parameter) map as plain values."""
    values = {}
    for key, parameter in mapping.items():
        kind = parameter.WhichOneof("parameter_choice")
        values[key] = None if kind is None else getattr(parameter, kind)
    return values


def decode(request: Any) -> tuple[InferRequest, OutputPlan]:
    """The infer request as the data plane's message, plus the outputs to answer."""
    header, binary, to = header_of(request)
    return v2.decode_header(header, binary, False, to)


def header_of(request: Any) -> tuple[dict[str, Any], bytes, Target]:
    """The REST codec's header of an infer request, its raw contents joined, its target."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise InvalidInput(
            f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs; "
            "expected one per input, in order, or none (typed contents)"
        )
    inputs = [
        _input(tensor, raw[index] if raw else None) for index, tensor in enumerate(request.inputs)
    ]
    options = parameters(request.parameters)
    if options.get("binary_data_output") is None:  # raw answers unless told otherwise (a
        options["binary_data_output"] = True  # parameter with no value set is not given)
    header: dict[str, Any] = {"inputs": inputs, "parameters": options}
    if request.outputs:
        header["outputs"] = [
            {"name": output.name, "parameters": parameters(output.parameters)}
            for output in request.outputs
        ]
    if request.id:
        header["id"] = request.id
    return header, b"".join(raw), target(request.model_name, request.model_version)


def _input(tensor: Any, raw: bytes | None) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": tensor.name,
        "datatype": tensor.datatype,
        "shape": list(tensor.shape),
        "parameters": parameters(tensor.parameters),
    }
    if raw is not None:
        if tensor.HasField("contents"):
            raise InvalidInput(f"input {tensor.name[:64]!r}: both contents and raw contents")
        entry["parameters"]["binary_data_size"] = len(raw)
        return entry
    if tensor.datatype == "FP16":
        raise InvalidInput(
            f"input {tensor.name[:64]!r}: FP16 travels in raw_input_contents only "
            "(the protocol has no typed FP16 contents); or send FP32 contents"
        )
    field = CONTENTS.get(tensor.datatype)
    sent = [found.name for found, _ in tensor.contents.ListFields()]
    if any(name != field for name in sent):
        raise InvalidInput(
            f"input {tensor.name[:64]!r} is {tensor.datatype[:16]}: its values go in "
            f"{field or 'raw_input_contents'}, got {', '.join(sent)}"
        )
    if field is not None:
        values = getattr(tensor.contents, field)
        entry["data"] = np.fromiter(values, v2.DTYPES[tensor.datatype], count=len(values))
    return entry


def encode(result: InferResult, plan: OutputPlan) -> Any:
    """The answer: raw output contents (as Triton sends), or typed contents for every output."""
    return response(result.head, plan, (select(output, result) for output in plan.outputs))


def response(head: HeadInfo, plan: OutputPlan, arrays: Iterable[npt.NDArray[Any]]) -> Any:
    """``encode`` of the outputs' ``arrays`` (one per output of the plan, in order)."""
    answer = pb.ModelInferResponse(
        model_name=head.name, model_version=str(head.version), id=plan.request_id
    )
    answer.parameters["tied"].bool_param = head.tied
    raw = all(output.binary for output in plan.outputs)
    for output, array in zip(plan.outputs, arrays, strict=True):
        datatype = "BYTES" if array.dtype.kind in "OUS" else v2.datatype(array.dtype)
        tensor = answer.outputs.add(name=output.name, datatype=datatype, shape=array.shape)
        if raw:
            blob = v2.bytes_blob(array) if datatype == "BYTES" else np.ascontiguousarray(array)
            answer.raw_output_contents.append(bytes(blob))
        elif datatype == "BYTES":
            tensor.contents.bytes_contents.extend(str(s).encode() for s in array.reshape(-1))
        else:
            values, flat = getattr(tensor.contents, CONTENTS[datatype]), array.reshape(-1)
            for start in range(0, flat.size, CONTENTS_CHUNK):
                values.extend(flat[start : start + CONTENTS_CHUNK].tolist())
    return answer


def model_metadata(head: HeadInfo, versions: list[int]) -> Any:
    """``ModelMetadataResponse``: the REST metadata's inputs, outputs and versions."""
    described = v2.model_metadata(head, versions)
    tensors = {
        side: [pb.ModelMetadataResponse.TensorMetadata(**tensor) for tensor in described[side]]
        for side in ("inputs", "outputs")
    }
    return pb.ModelMetadataResponse(
        name=described["name"],
        versions=described["versions"],
        platform=described["platform"],
        **tensors,
    )
