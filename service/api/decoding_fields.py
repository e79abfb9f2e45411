"""The decoding step's wire fields (pydantic), named as vLLM's ``SamplingParams`` and
transformers name them: the scalar options beside the arrays, and the arrays as a JSON body
writes them (the OpenAPI document shows both; ``service.api.schemas`` mixes them in).

In a binary body (``.npz``) the arrays are the archive's entries instead, a list of lists as
two: its values (flat) and ``<name>_lengths`` (one length per list); V2 takes the same names
as input tensors. Ranges are the data plane's rules (``service.plane.decoding_options``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

#: Ragged lists of ids: a binary body sends each as its values and these lengths.
LISTS = ("prompt_token_ids", "output_token_ids", "bad_words_ids")
LENGTHS = "_lengths"
#: Flat arrays of the step (besides ``allowed_token_ids`` and ``banned_token_ids``).
ARRAYS = ("stop_token_ids", "token_bitmask")
#: Arrays only a body carries (JSON fields, ``.npz`` entries): never a query string's text.
#: ``stop_token_ids``, a handful of ids, may also come in the query as banned ids do.
BODY_ONLY = (*LISTS, "token_bitmask")


class _Fields(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class PenaltyFields(_Fields):
    """The processors' scalars, on ``/topk`` and ``/logits``."""

    repetition_penalty: float | None = Field(default=None, examples=[1.1])
    """> 0 (1: none): a token of the row's prompt or output has a positive logit divided by
    it, a negative one multiplied (once per token, as vLLM)."""
    presence_penalty: float | None = Field(default=None, examples=[0.5])
    """In [-2, 2]: subtracted from each token the row's output holds (OpenAI's, vLLM's)."""
    frequency_penalty: float | None = Field(default=None, examples=[0.5])
    """In [-2, 2]: subtracted per occurrence in the row's output."""
    min_tokens: int | None = Field(default=None, examples=[4])
    """stop_token_ids are banned while a row's output is shorter than this."""


class StepFields(_Fields):
    """How ``/topk`` reads the distribution the step makes."""

    logprobs_mode: Literal["raw", "processed"] | None = Field(default=None, examples=["raw"])
    """``raw``: log-probs after every processor and the temperature (the default);
    ``processed``: after the sampling filters too, the distribution draws come from (a
    filtered token's logit and log-prob are -inf, null in JSON), as vLLM's --logprobs-mode."""
    processor_order: Literal["transformers", "vllm"] | None = Field(
        default=None, examples=["transformers"]
    )
    """The sampling filters' order: ``transformers`` top_k, top_p, min_p (the default);
    ``vllm`` min_p, top_k, top_p."""


class ArrayFields(_Fields):
    """The step's arrays as a JSON body writes them (in an ``.npz`` body: its entries)."""

    prompt_token_ids: list[list[int]] | None = Field(default=None, examples=[[[1, 5, 9]]])
    """One list per row: its prompt (for repetition_penalty)."""
    output_token_ids: list[list[int]] | None = Field(default=None, examples=[[[9, 9]]])
    """One list per row: what it generated so far (penalties, min_tokens, bad_words_ids)."""
    stop_token_ids: list[int] | None = Field(default=None, examples=[[2]])
    """Banned while a row's output is shorter than min_tokens (the EOS id among them)."""
    bad_words_ids: list[list[int]] | None = Field(default=None, examples=[[[5, 6]]])
    """Token sequences: the last is banned where a row's output ends with the others."""
    token_bitmask: list[int] | list[list[int]] | None = Field(default=None, examples=[[-1]])
    """A grammar's int32 words, one row for all or one per row, ceil(vocab / 32) each: token
    j is bit j % 32 of word j // 32, least significant first, 1 allowed (xgrammar,
    llguidance, outlines-core)."""


class DrawFields(_Fields):
    """``sample.n``: several draws per row."""

    n: int | None = Field(default=None, examples=[2])
    """Draws per row (at most 64), each from its own stream of the seed: the answer's
    sampled fields become lists."""
