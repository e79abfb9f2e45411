"""The wire format of ``/v1/models/{name}/lens`` (the logit lens): one decode, one encode.

The body is JSON (``hidden_states`` (layers, tokens, d_model) beside the options) or ``.npy``
(the options as query parameters, ``target_ids`` as JSON text). The answer is JSON, nested
[layer][token][k] as the lens is read, or ``application/x-npz`` with one array per field.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from service.api.codec.answer_bodies import identity
from service.api.codec.native import hidden_and_options, reply
from service.api.codec.pieces import json_pieces
from service.api.codec.wire import JSON, NPZ, npz_bytes, off_loop, response_type, target
from service.api.schemas import LensOptions
from service.messages import LensRequest, LensResult

#: Bytes of JSON per value of the answer (for ``off_loop``'s choice of a worker thread).
JSON_VALUE_BYTES = 24


async def decode_lens(request: Request, body_limit: int) -> tuple[LensRequest, str]:
    """A lens request and the media type its answer should have."""
    answer = response_type(request, (JSON, NPZ), JSON)
    hidden, opts, arrays = await hidden_and_options(
        request, body_limit, LensOptions, ("target_ids",)
    )
    decoded = LensRequest(
        target(request),
        hidden,
        opts.k,
        arrays.get("target_ids"),
        opts.states,
        opts.last_layer,
        tokens=answer == JSON,
    )
    return decoded, answer


async def encode_lens(result: LensResult, answer: str) -> Response:
    size = result.token_ids.size * 2 * JSON_VALUE_BYTES + result.entropy.size * 4 * JSON_VALUE_BYTES
    return await off_loop(size, _lens_response, result, answer)


def _lens_response(result: LensResult, answer: str) -> Response:
    arrays: dict[str, Any] = {
        "token_ids": result.token_ids,
        "logprobs": result.logprobs,
        "entropy": result.entropy,
        "kl_to_last": result.kl_to_last,
    }
    if result.target_ids is not None:
        arrays["target_ids"] = result.target_ids
        arrays["target_logprobs"] = result.target_logprobs
        arrays["target_ranks"] = result.target_ranks
    if answer == NPZ:
        return reply(result.head, npz_bytes(arrays), NPZ)
    layers, tokens, k = result.token_ids.shape
    payload = {**identity(result.head), "k": k, "layers": layers, "tokens": tokens, **arrays}
    if result.tokens is not None:
        rows = [list(row) for row in result.tokens]
        payload["token_strings"] = [
            rows[layer * tokens : (layer + 1) * tokens] for layer in range(layers)
        ]
    return reply(result.head, json_pieces(payload), JSON)  # a few rows per encoder call
