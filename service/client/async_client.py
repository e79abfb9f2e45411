"""The asynchronous client: ``Client``'s calls as coroutines, on an ``httpx.AsyncClient``
(``service.client`` says what both do; the calls are built once, in ``calls``)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from service.client.answers import (
    Arrays,
    Lens,
    TopK,
    read_array,
    read_json,
    read_lens,
    read_topk,
)
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


class AsyncClient:
    """The same calls as ``Client``, awaited (one pooled ``httpx.AsyncClient``)."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.1,
        binary: bool = True,
        token: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._http = httpx.AsyncClient(base_url=url, timeout=timeout, transport=transport)
        self._calls = Calls(binary, token)
        self._retry = Retry(retries, backoff_s)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def topk(
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
        options = with_states(options, states)
        call = self._calls.topk(model, hidden, k, logprobs, temperature, tokens, version, options)
        return read_topk(await self._send(call))

    async def logits(
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
        call = self._calls.logits(
            model, hidden, temperature, version, allowed_token_ids, states, decoding
        )
        return read_array(await self._send(call))

    async def embed(self, model: str, ids: Any, *, version: int | None = None) -> Arrays:
        return read_array(await self._send(self._calls.embed(model, ids, version)))

    async def score(
        self,
        model: str,
        hidden: Any,
        target_ids: Any,
        *,
        version: int | None = None,
        states: str | None = None,
        **options: Any,
    ) -> dict[str, Any]:
        call = self._calls.score(model, hidden, target_ids, version, **with_states(options, states))
        answer: dict[str, Any] = read_json(await self._send(call), has="results")
        return answer

    async def compare(
        self, model_a: str, model_b: str, hidden: Any, *, states: str | None = None, **options: Any
    ) -> dict[str, Any]:
        call = self._calls.compare((model_a, model_b), hidden, **with_states(options, states))
        answer: dict[str, Any] = read_json(await self._send(call), has="rows")
        return answer

    async def lens(
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
        options = lens_options(k, target_ids, states, last_layer)
        return read_lens(
            await self._send(self._calls.lens(model, hidden, options, tokens, version))
        )

    async def verify(
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
        call = verify_arrays_call(
            model, hidden, draft_token_ids, draft_probs, draft_parents, seeds, version, options
        )
        answer: dict[str, Any] = read_json(await self._send(call), has="results")
        return answer

    async def model(self, name: str) -> dict[str, Any]:
        answer: dict[str, Any] = read_json(
            await self._send(Call("GET", model_path(name))), has="name"
        )
        return answer

    async def load(self, name: str, version: int | None = None) -> dict[str, Any]:
        answer: dict[str, Any] = read_json(
            await self._send(self._calls.control("load", name, version)), has="state"
        )
        return answer

    async def unload(self, name: str) -> dict[str, Any]:
        answer: dict[str, Any] = read_json(
            await self._send(self._calls.control("unload", name, None))
        )
        return answer

    async def models(self) -> list[dict[str, Any]]:
        models = await self._send(Call("GET", "/v1/models"))
        answer: list[dict[str, Any]] = read_json(models, "models")
        return answer

    async def ready(self) -> bool:
        """Whether the service is ready; False while it cannot be reached."""
        try:
            return (await self._http.get("/health/ready")).status_code == 200
        except httpx.TransportError:
            return False

    async def _send(self, call: Call) -> httpx.Response:
        for wait in self._retry.waits():
            try:
                answer = await self._http.request(
                    call.method,
                    call.path,
                    content=call.content,
                    headers=call.headers,
                    params=call.params,
                )
            except httpx.TransportError:
                if not call.idempotent or wait is None:
                    raise
                await asyncio.sleep(wait)
                continue
            if answer.status_code != RETRY_STATUS or wait is None:
                return checked(answer)
            await asyncio.sleep(retry_after(answer, wait))
        raise AssertionError("unreachable: the last wait is None")
