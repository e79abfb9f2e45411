"""A Python client for lmhead: numpy in, typed answers of numpy arrays out, sync and async.

It imports httpx and numpy only (and ``service.errors``, the standard library), so a trunk's
process can use it without onnxruntime or the server's packages. Hidden states go as ``.npy``
and top-k and lens answers come back as ``.npz`` (``binary=False``, or ``tokens=True``, speaks
JSON); anything with ``__array__`` is accepted, so CPU torch tensors work without importing
torch. Inference calls are pure functions of their input, so they are retried, with backoff,
on 503 (after the service's ``Retry-After``, at most 10 x the backoff) and on connection
errors; control calls on 503 only. A service error is raised as its class from
``service.errors`` (``QueueFull``, ``InvalidInput``, ...) with the service's message; a success
whose body cannot be read as the call's answer is an ``UnreadableAnswer`` (a ``ServiceError``
too). Every answer says which model, version and tie answered.

    with Client("http://127.0.0.1:8000") as client:
        top = client.topk("demo-tied", hidden, k=5, logprobs=True)
        print(top.token_ids, top.version, top.tied)

Layer: the client stands beside the service's layers, not on them. It may import only the
shared basics at the package root (``service.errors``, ``service.npyio``), never a layer of the
service (``make layers`` checks it), so it installs and imports without onnxruntime.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from service.client.answers import (
    Arrays,
    Lens,
    TopK,
    UnreadableAnswer,
    read_array,
    read_json,
    read_lens,
    read_topk,
)
from service.client.async_client import AsyncClient
from service.client.calls import (
    RETRY_STATUS,
    Call,
    Calls,
    Retry,
    checked,
    lens_options,
    model_path,
    retry_after,
    with_states,
)
from service.client.verify_call import verify_arrays_call

__all__ = ["Arrays", "AsyncClient", "Client", "Lens", "TopK", "UnreadableAnswer"]


class Client:
    """Synchronous client (one pooled ``httpx.Client``; use it as a context manager)."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.1,
        binary: bool = True,
        token: str | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._http = httpx.Client(base_url=url, timeout=timeout, transport=transport)
        self._calls = Calls(binary, token)
        self._retry = Retry(retries, backoff_s)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def topk(
        self,
        model: str,
        hidden: Any,
        k: int | None = None,
        *,
        logprobs: bool = False,
        temperature: float = 1.0,
        tokens: bool = False,
        version: int | None = None,
        states: str | None = None,
        **options: Any,
    ) -> TopK:
        """``options``: allowed_token_ids, logit_bias, banned_token_ids, logprobs_over, sample
        (with ``n``: n draws per row), and the decoding step's: prompt_token_ids,
        output_token_ids (one list per row), repetition_penalty, presence_penalty,
        frequency_penalty, min_tokens, stop_token_ids, bad_words_ids, token_bitmask (a
        grammar library's int32 array), logprobs_mode, processor_order; array options travel
        in an ``.npz`` body (in JSON mode, in the JSON body). ``states``: ``"residual"`` sends
        pre-norm states, through the head's final norm first (heads that hold one); None: not
        sent (the service's ``"final"``)."""
        options = with_states(options, states)
        call = self._calls.topk(model, hidden, k, logprobs, temperature, tokens, version, options)
        return read_topk(self._send(call))

    def logits(
        self,
        model: str,
        hidden: Any,
        *,
        temperature: float = 1.0,
        version: int | None = None,
        allowed_token_ids: Any = None,
        states: str | None = None,
        **decoding: Any,
    ) -> Arrays:
        """(rows, vocab) logits, or (rows, len(allowed_token_ids)) for those ids alone;
        ``decoding``: the decoding step's options (token_bitmask, output_token_ids,
        repetition_penalty, ...): the logits after its processors, masked ones -inf."""
        call = self._calls.logits(
            model, hidden, temperature, version, allowed_token_ids, states, decoding
        )
        return read_array(self._send(call))

    def embed(self, model: str, ids: Any, *, version: int | None = None) -> Arrays:
        return read_array(self._send(self._calls.embed(model, ids, version)))

    def score(
        self,
        model: str,
        hidden: Any,
        target_ids: Any,
        *,
        version: int | None = None,
        states: str | None = None,
        **options: Any,
    ) -> dict[str, Any]:
        """``options``: candidate_ids, k, logprobs_over. The answer as the service sends it."""
        options = with_states(options, states)
        answer: dict[str, Any] = read_json(
            self._send(self._calls.score(model, hidden, target_ids, version, **options)),
            has="results",
        )
        return answer

    def compare(
        self, model_a: str, model_b: str, hidden: Any, *, states: str | None = None, **options: Any
    ) -> dict[str, Any]:
        """``options``: target_ids, k, measure_speed."""
        options = with_states(options, states)
        answer: dict[str, Any] = read_json(
            self._send(self._calls.compare((model_a, model_b), hidden, **options)), has="rows"
        )
        return answer

    def lens(
        self,
        model: str,
        hidden: Any,
        *,
        k: int | None = None,
        target_ids: Any = None,
        states: str = "residual",
        last_layer: str = "final",
        tokens: bool = False,
        version: int | None = None,
    ) -> Lens:
        """The logit lens: ``hidden`` is every layer's states, (layers, tokens, d_model), as
        ``output_hidden_states`` gives them: residual (read through the head's final norm),
        the last layer post-norm already (``last_layer="final"``). ``target_ids`` (tokens,):
        the real next tokens, for their log-prob and rank per layer. ``tokens=True`` asks
        for the top tokens' strings (a JSON answer)."""
        options = lens_options(k, target_ids, states, last_layer)
        return read_lens(self._send(self._calls.lens(model, hidden, options, tokens, version)))

    def verify(
        self,
        model: str,
        hidden: Any,
        draft_token_ids: Any,
        *,
        draft_probs: Any = None,
        draft_parents: Any = None,
        seeds: Any = None,
        version: int | None = None,
        **options: Any,
    ) -> dict[str, Any]:
        """Speculative verification (docs/verify.md): ``hidden`` (sequences, K + 1, d_model),
        ``draft_token_ids`` (sequences, K), the draft's ``draft_probs`` (sequences, K, vocab)
        or none (drafts taken as certain); ``options``: temperature (0: greedy), states,
        sample, logit_bias, banned_token_ids, draft_model with draft_hidden_states. The
        answer's ``results``: per sequence accepted, token_ids, logprobs, nodes, seed."""
        call = verify_arrays_call(
            model, hidden, draft_token_ids, draft_probs, draft_parents, seeds, version, options
        )
        answer: dict[str, Any] = read_json(self._send(call), has="results")
        return answer

    def models(self) -> list[dict[str, Any]]:
        answer: list[dict[str, Any]] = read_json(self._send(Call("GET", "/v1/models")), "models")
        return answer

    def model(self, name: str) -> dict[str, Any]:
        answer: dict[str, Any] = read_json(self._send(Call("GET", model_path(name))), has="name")
        return answer

    def ready(self) -> bool:
        """Whether the service is ready (every model found at start loaded or failed); False
        while it cannot be reached."""
        try:
            return self._http.get("/health/ready").status_code == 200
        except httpx.TransportError:
            return False

    def load(self, name: str, version: int | None = None) -> dict[str, Any]:
        call = self._calls.control("load", name, version)
        answer: dict[str, Any] = read_json(self._send(call), has="state")
        return answer

    def unload(self, name: str) -> dict[str, Any]:
        answer: dict[str, Any] = read_json(self._send(self._calls.control("unload", name, None)))
        return answer

    def _send(self, call: Call) -> httpx.Response:
        for wait in self._retry.waits():
            try:
                answer = self._http.request(
                    call.method,
                    call.path,
                    content=call.content,
                    headers=call.headers,
                    params=call.params,
                )
            except httpx.TransportError:
                if not call.idempotent or wait is None:
                    raise
                time.sleep(wait)
                continue
            if answer.status_code != RETRY_STATUS or wait is None:
                return checked(answer)
            time.sleep(retry_after(answer, wait))
        raise AssertionError("unreachable: the last wait is None")
