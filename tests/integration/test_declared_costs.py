"""Every verb's cost is declared before it runs (``service.plane.costs``), and it is a real
bound: a sweep of request shapes (rows, layers x tokens, k, vocabulary, label lengths) served by
a real process, each request's measured peak resident set against its declared cost and the
documented worst case; requests whose cost no setting allows are refused before any run."""

from __future__ import annotations

import asyncio
import io
import math
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import numpy as np
import orjson
import pytest

from service.budget import BODY_EXPANSION, JSON_ARRAY_BYTES, JSON_NUMBER_BYTES
from service.budget import worst_case_extra_bytes as worst_case
from service.client.answers import NPZ
from service.client.verify_call import verify_call
from service.heads.files import HeadWeights, save_head
from service.heads.norm import FinalNorm
from service.metrics import Metrics
from service.plane import costs
from service.plane.options import CheckedInfer, CheckedTopK
from service.plane.verify_checks import CheckedVerify
from service.repository.disk import LABELS_FILE
from service.repository.loaded_version import LoadedVersion
from service.repository.registry import Registry
from service.runtime.vocabulary import SampleSpec, Shape
from service.settings import Settings
from tests.server import running_server, server_process

# Resident sets of one server, measured request by request (tests/conftest.py: measure group).
pytestmark = pytest.mark.xdist_group("measure")

D_MODEL = 16
#: Interpreter and allocator churn of one request beside what it declares (small requests).
SLACK = 24 * 2**20
HEADS = {"short": 4096, "long": 65536}  # vocabulary sizes; "long" has long, escaped labels
BIG = {"big": 128256}  # Llama 3's vocabulary: draft_probs of 64 x 4 drafts are 131 MB


def _labels(vocab: int, long: bool) -> str:
    """Token strings; the long head's longest escapes to ~180 bytes of JSON."""
    if not long:
        return "".join(f"t{i}\n" for i in range(vocab))
    return "".join(f"{i}{chr(1) * 28}{'é' * 20}\n" for i in range(vocab))


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("costs")
    rng = np.random.default_rng(7)
    for name, vocab in (HEADS | BIG).items():
        table = rng.standard_normal((vocab, D_MODEL), dtype=np.float32)
        norm = FinalNorm("rms", np.ones(D_MODEL, np.float32), 1e-5)
        for model in (name, f"{name}-twin") if name in HEADS else (name,):
            version = save_head(HeadWeights.from_arrays(table, norm=norm), root / model / "1")
            (version.parent / LABELS_FILE).write_text(_labels(vocab, name == "long"))
    return root


#: Bodies up to 256 MiB: 64 x 4 draft_probs of a 128256-token head are 131 MB (the default
#: LMHEAD_MAX_BODY_BYTES, 64 MiB, refuses them before anything is declared).
SETTINGS = {"max_k": "1000", "max_rows": "4096", "max_body_bytes": str(256 * 2**20)}


@pytest.fixture(scope="module")
def heads(repository: Path) -> Iterator[dict[str, LoadedVersion]]:
    """The heads as the server loads them, loaded in this process: the declared costs'
    facts (run size, score copies, longest label) are the server's."""
    settings = Settings(repository=repository, **SETTINGS)  # type: ignore[arg-type]
    loop = asyncio.new_event_loop()
    with ThreadPoolExecutor(1) as executor:
        registry = Registry(settings, executor, Metrics())
        loop.run_until_complete(registry.load_all())
        try:
            yield {name: registry.get(name) for name in HEADS | BIG}
        finally:
            loop.run_until_complete(registry.close())
            loop.close()


@pytest.fixture(scope="module")
def url(repository: Path) -> Iterator[str]:
    with running_server(repository, **SETTINGS) as served:
        yield served


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: bytes
    content_type: str
    declared: Callable[[LoadedVersion], costs.Cost]
    accept: str = "application/json"


def _states(*shape: int) -> np.ndarray:
    return np.random.default_rng(math.prod(shape)).standard_normal(shape, dtype=np.float32)


def _json(payload: dict[str, Any]) -> bytes:
    return orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)


def _npy(array: np.ndarray) -> bytes:
    stream = io.BytesIO()
    np.save(stream, array)
    return stream.getvalue()


def _topk(rows: int, k: int, residual: bool) -> Case:
    """A JSON answer: token strings in it."""
    hidden = _states(rows, D_MODEL)
    payload = {"hidden_states": hidden, "k": k, "logprobs": True}
    payload["states"] = "residual" if residual else "final"
    return Case(
        f"topk-{rows}x{k}{'-residual' if residual else ''}",
        "topk",
        _json(payload),
        "application/json",
        lambda m: costs.topk(
            m, CheckedTopK(hidden, k, 1.0), logprobs=True, tokens=True, residual=residual
        ),
    )


def _logits(rows: int, text: bool) -> Case:
    hidden = _states(rows, D_MODEL)
    return Case(
        f"logits-{rows}-{'json' if text else 'npy'}",
        "logits",
        _npy(hidden),
        "application/x-npy",
        lambda m: costs.logits(m, rows, m.vocab_size, False, text),
        "application/json" if text else "application/x-npy",
    )


def _score(rows: int, k: int) -> Case:
    hidden = _states(rows, D_MODEL)
    body = _json({"hidden_states": hidden, "target_ids": list(range(rows)), "k": k})
    return Case(
        f"score-{rows}x{k}",
        "score",
        body,
        "application/json",
        lambda m: costs.score(m, rows, k, 0, False),
    )


def _lens(layers: int, tokens: int, k: int) -> Case:
    states = _states(layers, tokens, D_MODEL)
    return Case(
        f"lens-{layers}x{tokens}x{k}",
        f"lens?k={k}",
        _npy(states),
        "application/x-npy",
        lambda m: costs.lens(m, layers, tokens, k, False, True),
    )


def _embed(ids: int) -> Case:
    return Case(
        f"embed-{ids}",
        "embed",
        _json({"input_ids": [i % 4096 for i in range(ids)]}),
        "application/json",
        lambda m: costs.embed(m, ids),
    )


def _compare(rows: int) -> Case:
    """The case's head against its twin (the path names both; see ``_peak``)."""
    hidden = _states(rows, D_MODEL)
    return Case(
        f"compare-{rows}",
        "/v1/compare",
        _json({"models": ["{model}", "{model}-twin"], "hidden_states": hidden, "k": 10}),
        "application/json",
        lambda m: costs.compare((m, m), rows, False),
    )


def _v2(rows: int, k: int, logits: bool) -> Case:
    """V2 infer in JSON: top-k outputs (token strings as classification), full logits."""
    hidden = _states(rows, D_MODEL)
    outputs: list[dict[str, Any]] = [{"name": "topk_token_ids"}, {"name": "topk_logprobs"}]
    if logits:
        outputs.append({"name": "logits"})
    else:
        outputs.append({"name": "logits", "parameters": {"classification": k}})
    tensor: dict[str, Any] = {"name": "hidden_states", "shape": [rows, D_MODEL], "datatype": "FP32"}
    payload: dict[str, Any] = {"inputs": [{**tensor, "data": hidden}], "outputs": outputs}
    payload["parameters"] = {"k": k}
    checked = CheckedInfer(None, CheckedTopK(hidden, k, 1.0), logits)
    return Case(
        f"v2-{rows}x{k}{'-logits' if logits else '-classification'}",
        "/v2/models/{model}/infer",
        _json(payload),
        "application/json",
        lambda m: costs.infer(m, checked, True, False),
    )


def _verify(
    sequences: int,
    k: int,
    top_p: float | None,
    *,
    probs: bool = False,
    parents: list[int] | None = None,
    vocab: int = 4096,
) -> Case:
    """An ``.npz`` body as the client sends it: drafts taken as certain or with draft_probs
    (sequences, k, vocab), a chain or a tree (``parents``), the target shaped by top_p or
    not. The declared cost is the path's the request takes (``CheckedVerify.dense``)."""
    rng = np.random.default_rng(k)
    hidden = _states(sequences, k + 1, D_MODEL)
    ids = rng.integers(0, 4096, (sequences, k))
    arrays: dict[str, Any] = {"hidden_states": hidden, "draft_token_ids": ids}
    draft = None
    if probs:
        draft = rng.random((sequences, k, vocab), dtype=np.float32) + np.float32(0.5)
        draft /= draft.sum(axis=2, keepdims=True)
        arrays["draft_probs"] = draft
    tree = None if parents is None else np.asarray(parents, np.int64)
    arrays["draft_parents"] = tree
    options: dict[str, Any] = {}
    shape = None
    if top_p is not None:
        options["sample"] = {"top_p": top_p, "seed": 1}
        shape = Shape(sample=SampleSpec(top_p=top_p, seed=1))
    call = verify_call("{model}", arrays, None, **options)
    checked = CheckedVerify(hidden, ids, draft, tree, shape, 1.0, False, ids[:, 0])
    what = f"{'-probs' if probs else ''}{'-tree' if parents else ''}{'-top_p' if top_p else ''}"
    return Case(
        f"verify-{sequences}x{k}{what}",
        f"verify?{urlencode(call.params or {})}",
        call.content or b"",
        NPZ,
        lambda m: costs.verify_call(m, [], checked, residual=False),
    )


CASES = [
    _topk(1, 5, False),
    _topk(64, 1000, False),
    _topk(1024, 1000, True),
    _topk(4096, 100, False),
    _logits(64, True),
    _logits(256, True),
    _logits(512, False),
    _score(1024, 0),
    _score(4096, 100),
    _lens(8, 64, 5),
    _lens(32, 128, 100),
    _embed(4096),
    _compare(512),
    _v2(256, 1000, False),
    _v2(64, 5, True),
    _verify(64, 4, None),
    _verify(32, 4, 0.9),
    _verify(32, 4, 0.9, parents=[-1, -1, -1, 1]),  # drafts taken as certain: read so too
]


def _body_cost(case: Case) -> int:
    """What the body costs as it is read and decoded (charged by the front ends)."""
    cost = BODY_EXPANSION * len(case.body)
    if case.content_type == "application/json":
        cost += JSON_NUMBER_BYTES * case.body.count(b",") + JSON_ARRAY_BYTES * case.body.count(b"[")
    return cost


def _peak(url: str, model: str, case: Case) -> int:
    """The server's resident peak beyond its resident set before the request, in bytes."""
    server = server_process(url)
    Path(f"/proc/{server.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = server.memory_info().rss
    path = case.path if case.path.startswith("/") else f"/v1/models/{{model}}/{case.path}"
    answer = httpx.post(
        url + path.format(model=model),
        content=case.body.replace(b"{model}", model.encode()),
        headers={"content-type": case.content_type, "accept": case.accept},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text[:300]
    for line in Path(f"/proc/{server.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 - before
    raise AssertionError("no VmHWM")


@pytest.mark.parametrize("model", list(HEADS))
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_a_served_request_stays_within_its_declared_cost(
    url: str, heads: dict[str, LoadedVersion], model: str, case: Case
) -> None:
    _within(url, heads[model], case)


#: draft_probs are as wide as the head: a case per head. The 64 x 4 chain on the 128256-token
#: head is what the dense path's declaration refused with the default settings (~1.45 GB).
PROBS = [
    ("short", 64, None, None),  # a chain: read where the rule reads
    ("long", 16, 0.9, None),  # the filters past the prefix: a byte a token
    ("short", 16, 0.9, [-1, -1, -1, 1]),  # a tree with draft_probs: every whole row
    ("big", 64, None, None),
]


@pytest.mark.parametrize(("model", "sequences", "top_p", "parents"), PROBS)
def test_a_verification_with_draft_probs_stays_within_its_declared_cost(
    url: str,
    heads: dict[str, LoadedVersion],
    model: str,
    sequences: int,
    top_p: float | None,
    parents: list[int] | None,
) -> None:
    head = heads[model]
    case = _verify(sequences, 4, top_p, probs=True, parents=parents, vocab=head.vocab_size)
    _within(url, head, case)


def _within(url: str, head: LoadedVersion, case: Case) -> None:
    """The request served twice (the first sets up what later ones reuse); the second's
    measured peak within its declared cost, its body's and the slack; the declaration
    within what the settings allow."""
    declared = case.declared(head)
    _peak(url, head.name, case)
    measured = _peak(url, head.name, case)
    bound = declared.held + declared.run + _body_cost(case) + SLACK
    assert measured <= bound, f"{case.name}: measured {measured} > declared {bound}"
    settings = Settings(**SETTINGS)  # type: ignore[arg-type]
    assert declared.held <= settings.max_inflight_bytes
    assert declared.held + _body_cost(case) <= settings.max_inflight_bytes
    assert declared.run <= settings.max_logits_bytes
    assert bound <= worst_case(settings)
