"""Open Inference Protocol over gRPC (``LMHEAD_GRPC_PORT``) with the real ``tritonclient.grpc``
and raw protobuf stubs: numbers against the numpy reference, typed and raw contents, the
repository RPCs driving a swap under gRPC load, auth, limits and bad requests."""

from __future__ import annotations

import re
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import numpy.typing as npt
import pytest
import tritonclient.grpc as triton
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from service.heads.files import HeadWeights, save_head
from service.heads.reference import log_softmax, logsumexp, top_k
from service.tools.demo import demo_tokens
from tests.conftest import D_MODEL, VOCAB, reference_logits
from tests.server import free_port, poll, running_server, server_process

HIDDEN = np.random.default_rng(22).standard_normal((3, D_MODEL)).astype(np.float32)
TOKEN = "s3cret-admin-token"


@pytest.fixture(scope="module")
def served(repository: Path) -> Iterator[tuple[str, str]]:
    """The server's HTTP URL and gRPC address."""
    port = free_port()
    settings = {"grpc_port": str(port), "admin_token": TOKEN, "max_body_bytes": str(2**20)}
    with running_server(repository, **settings) as url:
        yield url, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def address(served: tuple[str, str]) -> str:
    return served[1]


@pytest.fixture
def client(address: str) -> Iterator[triton.InferenceServerClient]:
    connection = triton.InferenceServerClient(address)
    yield connection
    connection.close()


@pytest.fixture
def stub(address: str) -> Iterator[Any]:
    with grpc.insecure_channel(address) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


ADMIN = {"authorization": f"Bearer {TOKEN}"}


def _hidden_input(array: npt.NDArray[Any], datatype: str = "FP32") -> triton.InferInput:
    tensor = triton.InferInput("hidden_states", list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def test_health_and_metadata(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("tied")
    with pytest.raises(InferenceServerException, match="not found"):
        client.is_model_ready("missing")
    metadata = client.get_model_metadata("untied", as_json=True)
    assert metadata["platform"] == "onnx_onnxv1"
    assert metadata["versions"] == ["1"]
    inputs = {i["name"]: (i["datatype"], i["shape"]) for i in metadata["inputs"]}
    assert inputs == {
        "hidden_states": ("FP32", [str(-1), str(D_MODEL)]),
        "input_ids": ("INT64", [str(-1)]),
    }
    outputs = {o["name"]: o["shape"] for o in metadata["outputs"]}
    assert outputs["logits"] == [str(-1), str(VOCAB)]
    server = client.get_server_metadata(as_json=True)
    assert server["name"] == "lmhead"
    assert {"binary_tensor_data", "classification", "model_repository"} <= set(server["extensions"])


def test_every_rpc_is_counted(served: tuple[str, str], client: Any) -> None:
    url = served[0]

    def counts() -> dict[str, float]:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        found = re.findall(
            r'^lmhead_grpc_requests_total{code="OK",method="(\w+)"} (\S+)$', text, re.M
        )
        return {method: float(value) for method, value in found}

    before = counts()
    for _ in range(2):
        client.is_server_live()
        client.is_server_ready()
        client.get_server_metadata()
        client.is_model_ready("tied")
    after = counts()
    for method in ("ServerLive", "ServerReady", "ServerMetadata", "ModelReady"):
        assert after[method] - before.get(method, 0.0) == 2, method


@pytest.mark.parametrize("model", ["tied", "untied"])
def test_infer_raw_contents_equal_the_reference(
    client: triton.InferenceServerClient, repository: Path, model: str
) -> None:
    names = ["topk_token_ids", "topk_logits", "topk_logprobs", "logsumexp"]
    outputs = [triton.InferRequestedOutput(name) for name in names]
    result = client.infer(model, [_hidden_input(HIDDEN)], outputs=outputs, parameters={"k": 4})
    logits = reference_logits(repository / model / "1", HIDDEN)
    values, ids = top_k(logits, 4)
    np.testing.assert_array_equal(result.as_numpy("topk_token_ids"), ids)
    np.testing.assert_allclose(result.as_numpy("topk_logits"), values, rtol=1e-4, atol=1e-4)
    expected_lp = np.take_along_axis(log_softmax(logits), ids, axis=-1)
    np.testing.assert_allclose(result.as_numpy("topk_logprobs"), expected_lp, atol=1e-4)
    np.testing.assert_allclose(result.as_numpy("logsumexp"), logsumexp(logits), atol=1e-4)
    answer = result.get_response()
    assert (answer.model_name, answer.model_version) == (model, "1")
    assert answer.parameters["tied"].bool_param == (model == "tied")


@pytest.mark.parametrize("model", ["tied", "untied"])
def test_typed_contents_both_ways(stub: Any, repository: Path, model: str) -> None:
    tensor = pb.ModelInferRequest.InferInputTensor(
        name="hidden_states", datatype="FP32", shape=list(HIDDEN.shape)
    )
    tensor.contents.fp32_contents.extend(HIDDEN.reshape(-1).tolist())
    request = pb.ModelInferRequest(model_name=model, inputs=[tensor], id="req-7")
    request.parameters["k"].int64_param = 3
    request.parameters["binary_data_output"].bool_param = False
    answer = stub.ModelInfer(request)
    assert not answer.raw_output_contents
    assert answer.id == "req-7"
    by_name = {output.name: output for output in answer.outputs}
    ids = np.array(by_name["topk_token_ids"].contents.int64_contents).reshape(3, 3)
    values = np.array(by_name["topk_logits"].contents.fp32_contents).reshape(3, 3)
    expected_values, expected_ids = top_k(reference_logits(repository / model / "1", HIDDEN), 3)
    np.testing.assert_array_equal(ids, expected_ids)
    np.testing.assert_allclose(values, expected_values, rtol=1e-4, atol=1e-4)


def test_full_logits_fp16_input_and_version(
    client: triton.InferenceServerClient, repository: Path
) -> None:
    half = HIDDEN.astype(np.float16)
    result = client.infer(
        "untied",
        [_hidden_input(half, "FP16")],
        model_version="1",
        outputs=[triton.InferRequestedOutput("logits")],
    )
    expected = reference_logits(repository / "untied" / "1", half.astype(np.float32))
    np.testing.assert_allclose(result.as_numpy("logits"), expected, rtol=1e-3, atol=1e-3)


def test_classification(client: triton.InferenceServerClient, repository: Path) -> None:
    requested = triton.InferRequestedOutput("logits", class_count=3)
    strings = client.infer("tied", [_hidden_input(HIDDEN)], outputs=[requested]).as_numpy("logits")
    values, ids = top_k(reference_logits(repository / "tied" / "1", HIDDEN), 3)
    labels = demo_tokens(VOCAB)
    for row in range(3):
        for col in range(3):
            value, index, label = strings[row, col].decode().split(":")
            assert (int(index), label) == (ids[row, col], labels[ids[row, col]])
            assert abs(float(value) - values[row, col]) < 1e-4


@pytest.mark.parametrize("datatype", ["INT64", "INT32"])
def test_embeddings_from_input_ids(
    client: triton.InferenceServerClient, table: npt.NDArray[np.float32], datatype: str
) -> None:
    ids = np.array([3, 0, VOCAB - 1], dtype=np.int64 if datatype == "INT64" else np.int32)
    tensor = triton.InferInput("input_ids", [3], datatype)
    tensor.set_data_from_numpy(ids)
    result = client.infer("tied", [tensor])
    np.testing.assert_array_equal(result.as_numpy("embeddings"), table[ids])


def _load_under_traffic(
    address: str, stop: threading.Event, answers: list[tuple[str, str]]
) -> None:
    """One client's loop: ("ok", version) per answer, ("failed", message) per failed call."""
    with triton.InferenceServerClient(address) as connection:
        while not stop.is_set():
            try:
                result = connection.infer("untied", [_hidden_input(HIDDEN)])
                answers.append(("ok", result.get_response().model_version))
            except InferenceServerException as error:
                answers.append(("failed", str(error)))


def test_repository_rpcs_swap_under_grpc_load_with_no_failed_request(
    address: str,
    client: triton.InferenceServerClient,
    repository: Path,
    table: npt.NDArray[np.float32],
) -> None:
    index = {model.name: model.state for model in client.get_model_repository_index(ADMIN).models}
    assert index == {"tied": "READY", "untied": "READY"}
    save_head(HeadWeights.from_arrays(table * -1.0), repository / "untied" / "2")
    answers: list[tuple[str, str]] = []
    stop = threading.Event()
    threads = [
        threading.Thread(target=_load_under_traffic, args=(address, stop, answers))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    try:
        client.load_model("untied", headers=ADMIN)  # returns once version 2 is published
        served = len(answers)
        poll(lambda: len(answers) >= served + 20 or None, "20 answers after the swap")
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
    assert [a for a in answers if a[0] == "failed"] == []
    assert {version for _, version in answers} == {"1", "2"}
    client.unload_model("untied", headers=ADMIN)
    with pytest.raises(InferenceServerException, match="UNAVAILABLE|not"):
        client.infer("untied", [_hidden_input(HIDDEN)])
    shutil.rmtree(repository / "untied" / "2")
    client.load_model("untied", headers=ADMIN)  # back to version 1 for the other tests
    assert client.is_model_ready("untied", model_version="1")


def test_repository_rpcs_need_the_admin_token(client: triton.InferenceServerClient) -> None:
    for headers in (None, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}):
        with pytest.raises(InferenceServerException) as raised:
            client.unload_model("tied", headers=headers)
        assert raised.value.status() == "StatusCode.UNAUTHENTICATED"
        assert "Bearer <admin token>" in raised.value.message()
    assert client.is_model_ready("tied")


def test_a_load_with_triton_overrides_is_refused(client: triton.InferenceServerClient) -> None:
    """Triton's load may push a config or files; lmhead loads from its repository only, and
    says so rather than reload from disk and report success."""
    with pytest.raises(InferenceServerException) as raised:
        client.load_model("tied", headers=ADMIN, config='{"backend": "onnxruntime"}')
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "load takes only the parameter version" in raised.value.message()
    assert client.is_model_ready("tied")


def test_a_load_pinning_version_true_is_refused(stub: Any) -> None:
    """A bool is no version (it pinned "version True", which a new engine then dropped)."""
    request = pb.RepositoryModelLoadRequest(model_name="tied")
    request.parameters["version"].bool_param = True
    with pytest.raises(grpc.RpcError) as raised:
        stub.RepositoryModelLoad(request, metadata=tuple(ADMIN.items()))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "non-negative int64_param" in (raised.value.details() or "")


def _request(**fields: Any) -> Any:
    """A valid 2-row raw request, with ``fields`` replacing parts of it."""
    hidden = fields.pop("hidden", HIDDEN[:2])
    tensor = pb.ModelInferRequest.InferInputTensor(
        name=fields.pop("name", "hidden_states"),
        datatype=fields.pop("datatype", "FP32"),
        shape=fields.pop("shape", list(hidden.shape)),
    )
    raw = fields.pop("raw", [hidden.tobytes()])
    request = pb.ModelInferRequest(
        model_name=fields.pop("model", "tied"),
        model_version=fields.pop("version", ""),
        inputs=[tensor],
        raw_input_contents=raw,
    )
    for key, value in fields.pop("parameters", {}).items():
        setattr(request.parameters[key], value[0], value[1])
    for name in fields.pop("outputs", []):
        request.outputs.add(name=name)
    assert not fields
    return request


BAD_REQUESTS = [
    ("unknown model", _request(model="nope"), "NOT_FOUND", "nope"),
    ("unknown version", _request(version="9"), "NOT_FOUND", "version"),
    ("version not a number", _request(version="v1"), "INVALID_ARGUMENT", "model_version"),
    ("wrong d_model", _request(hidden=HIDDEN[:2, :5].copy()), "INVALID_ARGUMENT", "d_model"),
    ("shape and bytes disagree", _request(shape=[3, D_MODEL]), "INVALID_ARGUMENT", "bytes"),
    ("unknown input", _request(name="hidden"), "INVALID_ARGUMENT", "unknown input"),
    ("integer hidden states", _request(datatype="INT32"), "INVALID_ARGUMENT", "FP32 or FP16"),
    ("raw count", _request(raw=[b"", b""]), "INVALID_ARGUMENT", "one per input"),
    ("k too large", _request(parameters={"k": ("int64_param", 10**6)}), "INVALID_ARGUMENT", "k"),
    ("k a string", _request(parameters={"k": ("string_param", "5")}), "INVALID_ARGUMENT", "k"),
    (
        "temperature zero",
        _request(parameters={"temperature": ("double_param", 0.0)}),
        "INVALID_ARGUMENT",
        "temperature",
    ),
    ("unknown output", _request(outputs=["probs"]), "INVALID_ARGUMENT", "unknown output"),
    (
        "an output named twice",  # each copy was answered and none charged: past every limit
        _request(outputs=["logits", "logits"]),
        "INVALID_ARGUMENT",
        "requested twice",
    ),
    (
        "NaN",
        _request(hidden=np.full((2, D_MODEL), np.nan, np.float32)),
        "INVALID_ARGUMENT",
        "NaN",
    ),
    (
        "too many rows",
        _request(hidden=np.zeros((4097, D_MODEL), np.float32)),
        "RESOURCE_EXHAUSTED",
        "4097 rows",
    ),
    (
        "over the message limit",
        _request(hidden=np.zeros((8192, D_MODEL), np.float32)),  # 1.5 MiB > 1 MiB
        "RESOURCE_EXHAUSTED",
        "",
    ),
]


def test_sampled_outputs_keep_every_row_whatever_k(stub: Any) -> None:
    """One draw per row: an output's k cuts top-k columns, never the rows of the draws."""
    request = _request(hidden=HIDDEN, outputs=["topk_token_ids", "sampled_token_ids"])
    request.parameters["k"].int64_param = 2
    request.parameters["sample"].string_param = '{"seed": 3}'
    answer = stub.ModelInfer(request)
    shapes = {output.name: list(output.shape) for output in answer.outputs}
    assert shapes == {"topk_token_ids": [len(HIDDEN), 2], "sampled_token_ids": [len(HIDDEN)]}


def test_undecodable_requests_are_invalid_argument_and_counted(
    served: tuple[str, str], address: str
) -> None:
    """Bytes that are no ModelInferRequest (a name that is not UTF-8): grpcio answered
    UNKNOWN with the parser's class name, logged a traceback, and counted nothing."""
    url = served[0]
    pattern = r'^lmhead_grpc_requests_total{code="INVALID_ARGUMENT",method="ModelInfer"} (\S+)$'

    def counted() -> float:
        found = re.search(pattern, httpx.get(f"{url}/metrics", timeout=10).text, re.M)
        return float(found.group(1)) if found else 0.0

    before = counted()
    with grpc.insecure_channel(address) as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        for garbage in (b"\x0a\x02\xff\xfe", b"\xff" * 40):
            with pytest.raises(grpc.RpcError) as raised:
                infer(garbage)
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not a valid ModelInferRequest" in (raised.value.details() or "")
    assert counted() - before == 2


def test_typed_values_in_another_field_than_their_datatype_say_so(stub: Any) -> None:
    tensor = pb.ModelInferRequest.InferInputTensor(
        name="hidden_states", datatype="FP32", shape=list(HIDDEN.shape)
    )
    tensor.contents.fp64_contents.extend(HIDDEN.reshape(-1).tolist())
    with pytest.raises(grpc.RpcError) as raised:
        stub.ModelInfer(pb.ModelInferRequest(model_name="tied", inputs=[tensor]))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "go in fp32_contents, got fp64_contents" in (raised.value.details() or "")


@pytest.mark.parametrize(
    ("case", "request_", "code", "words"), BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS]
)
def test_bad_requests_get_clear_status_codes_and_the_next_one_is_served(
    stub: Any, repository: Path, case: str, request_: Any, code: str, words: str
) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        stub.ModelInfer(request_)
    assert raised.value.code().name == code, raised.value.details()
    details = raised.value.details() or ""
    assert words.lower() in details.lower(), details
    assert len(details) < 400  # names the field; never echoes the data
    answer = stub.ModelInfer(_request())  # the next request is served
    ids = np.frombuffer(answer.raw_output_contents[0], dtype=np.int64).reshape(2, -1)
    np.testing.assert_array_equal(
        ids, top_k(reference_logits(repository / "tied" / "1", HIDDEN[:2]), ids.shape[1])[1]
    )


def test_read_only_refuses_load_and_unload(repository: Path) -> None:
    port = free_port()
    with (
        running_server(repository, grpc_port=str(port), read_only="true"),
        triton.InferenceServerClient(f"127.0.0.1:{port}") as connection,
    ):
        with pytest.raises(InferenceServerException) as raised:
            connection.unload_model("tied")
        assert raised.value.status() == "StatusCode.PERMISSION_DENIED"
        assert "LMHEAD_READ_ONLY" in raised.value.message()
        assert connection.is_model_ready("tied")


def test_shutdown_under_grpc_load_ends_cleanly(repository: Path) -> None:
    """SIGTERM under gRPC load ends cleanly: every call is answered, refused UNAVAILABLE, or
    (grpc core's answer to a call that reached the server after its shutdown began and was never
    handed to a handler: grpc/grpc#41785) CANCELLED with core's own bare message; never INTERNAL,
    never a hang, and the process exits after its graceful shutdown. (Which calls were in flight
    at the signal is not observable from here, so this does not prove the drain itself; the grace
    is ``LMHEAD_DRAIN_TIMEOUT_S`` in the lifespan.)"""
    port = free_port()
    codes: list[str] = []
    details: set[str] = set()
    stop = threading.Event()

    def client() -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            request = _request(hidden=np.ones((4096, D_MODEL), np.float32))
            while not stop.is_set():
                try:
                    # Past the server's grace (LMHEAD_DRAIN_TIMEOUT_S, 30 s), which answers a
                    # zombie call CANCELLED: at 30 s the client's own deadline raced it.
                    stub.ModelInfer(request, timeout=90)
                    codes.append("OK")
                except grpc.RpcError as error:
                    codes.append(error.code().name)
                    details.add(f"{error.code().name}: {error.details()}")
                    if error.code() == grpc.StatusCode.UNAVAILABLE:
                        return

    with running_server(repository, grpc_port=str(port)) as url:
        threads = [threading.Thread(target=client) for _ in range(4)]
        for thread in threads:
            thread.start()
        poll(lambda: len(codes) >= 8 or None, "8 answers before the shutdown")
        server = server_process(url)
        server.terminate()
        # uvicorn re-raises the signal once its graceful shutdown is done
        assert server.wait(timeout=90) in (0, -signal.SIGTERM)
        stop.set()
        for thread in threads:
            thread.join(timeout=90)
    assert set(codes) <= {"OK", "UNAVAILABLE", "CANCELLED"}, sorted(details)
    # CANCELLED only as core's own zombie call, never from a handler
    assert {d for d in details if d.startswith("CANCELLED")} <= {"CANCELLED: CANCELLED"}, details
    assert codes.count("OK") >= 8


def _in_flight(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    (line,) = [line for line in text.splitlines() if line.startswith("lmhead_requests_in_flight ")]
    return float(line.split()[-1])


def test_shutdown_drains_a_grpc_call_in_flight(tmp_path: Path) -> None:
    """A call that is running when SIGTERM arrives is answered in full: a big head makes it
    last ~1 s, ``lmhead_requests_in_flight`` shows it has been admitted. (Without the grace
    in the lifespan, ``stop`` cancels it: the client sees UNAVAILABLE.)"""
    rng = np.random.default_rng(4)
    table = rng.standard_normal((50000, 256), dtype=np.float32)
    save_head(HeadWeights.from_arrays(table), tmp_path / "big" / "1")
    hidden = rng.standard_normal((2048, 256), dtype=np.float32)
    port = free_port()
    outcome: list[Any] = []

    def call() -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            try:
                outcome.append(stub.ModelInfer(_request(model="big", hidden=hidden), timeout=60))
            except grpc.RpcError as error:
                outcome.append(error.code().name)

    with running_server(tmp_path, grpc_port=str(port)) as url:
        caller = threading.Thread(target=call)
        caller.start()
        poll(lambda: _in_flight(url) >= 1 or None, "the call admitted")
        server = server_process(url)
        server.terminate()
        caller.join(timeout=60)
        assert server.wait(timeout=60) in (0, -signal.SIGTERM)
    (answer,) = outcome
    assert not isinstance(answer, str), answer
    ids = np.frombuffer(answer.raw_output_contents[0], dtype=np.int64).reshape(2048, -1)
    expected = top_k(reference_logits(tmp_path / "big" / "1", hidden[:8]), ids.shape[1])[1]
    np.testing.assert_array_equal(ids[:8], expected)


def test_rpcs_lmhead_does_not_serve_say_so(stub: Any) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        stub.ModelStatistics(pb.ModelStatisticsRequest(name="tied"))
    assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "does not implement ModelStatistics" in (raised.value.details() or "")


def test_a_parameter_with_no_value_set_is_not_given(stub: Any) -> None:
    """A gRPC parameter is a oneof: one sent with no value set is null, and null is "not
    given" (as over REST), never "must be a number" or typed answers instead of raw ones."""

    def infer(*unset: str) -> Any:
        tensor = pb.ModelInferRequest.InferInputTensor(
            name="hidden_states", datatype="FP32", shape=list(HIDDEN.shape)
        )
        tensor.contents.fp32_contents.extend(HIDDEN.reshape(-1).tolist())
        request = pb.ModelInferRequest(model_name="tied", inputs=[tensor])
        for name in unset:
            request.parameters[name].SetInParent()  # the entry, its oneof left unset
        return stub.ModelInfer(request)

    unset = ("k", "temperature", "logprobs", "binary_data_output", "states", "sample")
    assert infer(*unset) == infer()
    assert infer("binary_data_output").raw_output_contents  # raw, as when left out
