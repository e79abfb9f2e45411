"""Wire models of the native API: the option fields, and the shapes the OpenAPI document shows.

The big arrays (hidden states, ids) are not validated as pydantic fields: the codec decodes
them straight to numpy (orjson + one ``np.array`` call, or a zero-copy ``.npy`` read), several
times faster than validating millions of floats as Python objects. The ``*Body`` and
``*Answer`` models describe the same JSON for the document and its "try it out"; the
``*Options`` models validate the small fields beside the arrays (strictly, in JSON bodies).
Ranges (k, temperature, rows) are the data plane's rules, not the wire's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from service.api.decoding_fields import ArrayFields, DrawFields, PenaltyFields, StepFields

_EXAMPLE_ROW = [0.5, -1.25, 0.75, 2.0]


States = Literal["final", "residual"]
#: Token ids: one list (for every row, or one id per row), or one list per row.
IdLists = list[int] | list[list[int]]


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class _Temperature(_Options):
    """What ``/logits`` and ``/topk`` share, listed first where the options are named."""

    temperature: float = 1.0
    """Divides the logits (and so the log-probs); never changes the order."""
    states: States = "final"
    """``final``: post-norm hidden states (after the model's last norm); ``residual``: states
    before it, which the head's final norm (kept by ``lmhead import``) normalizes first."""


class LogitsOptions(PenaltyFields, _Temperature):
    """Options of ``/logits``: in the JSON body beside ``hidden_states``, or as query
    parameters with a ``.npy`` or ``.npz`` body; the decoding step's penalties
    (``service.api.decoding_fields``)."""


class SampleBody(DrawFields, _Options):
    """Draw one token per row, or ``n`` (filters in Hugging Face's order: top_k, top_p,
    min_p; ``processor_order`` ``vllm``: min_p first)."""

    temperature: float | None = Field(default=None, examples=[0.8])
    """Sampling temperature; 0 is greedy; the request's ``temperature`` when absent."""
    top_k: int | None = Field(default=None, examples=[50])
    top_p: float | None = Field(default=None, examples=[0.9])
    """Keep the smallest set of most likely tokens whose mass reaches top_p (exact: never cut
    to the returned k)."""
    min_p: float | None = Field(default=None, examples=[0.01])
    """Keep tokens at least min_p times as likely as the most likely one."""
    seed: int | None = Field(default=None, examples=[1])
    """Same seed, same row position: same token. A random seed (returned) when absent."""


class TopKOptions(StepFields, LogitsOptions):
    """Options of ``/topk``: the temperature, plus k and whether to return log-probs."""

    k: int | None = Field(default=None, examples=[3])
    """How many tokens per row, at most LMHEAD_MAX_K; the model's default when absent. Rows
    hold fewer tokens than k (a head's vocabulary, allowed ids less banned ones): the answer
    has all of them, and its ``k`` says how many."""
    logprobs: bool = False
    """Also return log-softmax values (over ``logprobs_over``)."""
    logit_bias: dict[str, float] | None = Field(default=None, examples=[{"3": 2.5}])
    """Token id -> added to its logit before top-k, log-probs and sampling (in [-100, 100])."""
    logprobs_over: Literal["candidates", "vocabulary"] | None = Field(
        default=None, examples=["candidates"]
    )
    """With allowed_token_ids: log-probs over them (default) or over the whole vocabulary."""
    sample: SampleBody | None = None
    """Also draw one token per row from the (biased, restricted) distribution."""


class EmbedOptions(_Options):
    """``/embed`` has no options yet; unknown fields are refused all the same."""


class ScoreOptions(_Options):
    """Options of ``/score`` beside its arrays; unknown fields are refused."""

    k: int | None = Field(default=None, ge=0, examples=[2])
    """Also return the top-k alternatives at each position (none when absent or 0)."""
    logprobs_over: Literal["candidates", "vocabulary"] | None = Field(
        default=None, examples=["vocabulary"]
    )
    """``candidates``: score each target among its row's candidate_ids only (no full run, no
    ``k``)."""
    states: States = "final"
    """``residual``: the head's final norm first (see ``LogitsOptions.states``)."""


class CompareOptions(_Options):
    models: list[str] = Field(min_length=2, max_length=2)
    """The two served models to compare (same d_model and vocabulary)."""
    k: int = 10
    """k of the top-k overlap."""
    measure_speed: bool = False
    """Also measure each head's bare rows/s on a 64-row batch."""
    states: States = "final"
    """``residual``: each head's final norm first (see ``LogitsOptions.states``)."""


class LensOptions(_Options):
    """Options of ``/lens``: in the JSON body beside ``hidden_states``, or as query parameters
    with a ``.npy`` body."""

    k: int | None = Field(default=None, examples=[3])
    """Top tokens per layer and position, at most LMHEAD_MAX_K; the model's default when
    absent (the answer's ``k`` says how many, never more than the vocabulary)."""
    states: States = "residual"
    """``residual``: the layers' states before the final norm, which the head applies (as the
    model does); ``final``: states already normalized (no norm is applied)."""
    last_layer: States = "final"
    """``final``: the last layer is post-norm already, as transformers' ``output_hidden_states``
    gives it; ``residual``: normalize it like the others."""


class _Document(BaseModel):
    """A model only the OpenAPI document uses (answers are built by the codecs)."""

    model_config = ConfigDict(use_attribute_docstrings=True, protected_namespaces=())


def _example(**values: Any) -> ConfigDict:
    return ConfigDict(json_schema_extra={"examples": [values]})


class TopKBody(ArrayFields, TopKOptions):
    model_config = _example(hidden_states=[_EXAMPLE_ROW], k=3, logprobs=True)

    hidden_states: list[Any]
    """(rows, d_model) or (batch, tokens, d_model) floats: final, post-norm hidden states."""
    allowed_token_ids: IdLists | None = Field(default=None, examples=[[3, 7, 11]])
    """Restrict to these ids (one list, or one per row): costs their rows of W only."""
    banned_token_ids: list[int] | None = Field(default=None, examples=[[7]])
    """Never return or draw these ids: one flat list, for every row."""


class LogitsBody(ArrayFields, LogitsOptions):
    model_config = _example(hidden_states=[_EXAMPLE_ROW])

    hidden_states: list[Any]
    """(rows, d_model) or (batch, tokens, d_model) floats."""
    allowed_token_ids: IdLists | None = Field(default=None, examples=[[3, 7, 11]])
    """Only these columns (one list, or one per row); the answer names them."""


class EmbedBody(EmbedOptions):
    model_config = _example(input_ids=[[1, 2, 3]])

    input_ids: list[Any]
    """Token ids, any shape; the answer is ids.shape + (d_model,)."""


class ScoreBody(ScoreOptions):
    model_config = _example(hidden_states=[_EXAMPLE_ROW], target_ids=[7], candidate_ids=[3, 7])

    hidden_states: list[Any]
    """(rows, d_model) or (batch, tokens, d_model) floats."""
    target_ids: IdLists
    """The real next token of each row (shape of the leading dims)."""
    candidate_ids: IdLists | None = Field(default=None, examples=[[3, 7]])
    """Token ids to score on every row (one list) or per row (one list per row)."""


class CompareBody(CompareOptions):
    model_config = _example(models=["demo-tied", "demo-untied"], hidden_states=[_EXAMPLE_ROW], k=10)

    hidden_states: list[Any]
    """(rows, d_model) floats, run through both heads."""
    target_ids: IdLists | None = Field(default=None, examples=[[7]])
    """Optional real next tokens, one per row: adds NLL, perplexity and wins per head, and
    ties."""


class TopKRow(_Document):
    token_ids: list[int]
    logits: list[float | None]
    """null: -inf (a token the processed distribution's filters dropped)."""
    logprobs: list[float | None] | None = None
    tokens: list[str | None] | None = None
    sampled_token_id: int | None = None
    sampled_logprob: float | None = None
    sampled_token: str | None = None
    sampled_token_ids: list[int] | None = None
    """With ``sample.n``: the row's n draws (and their log-probs and strings below)."""
    sampled_logprobs: list[float | None] | None = None
    sampled_tokens: list[str | None] | None = None


class Identity(_Document):
    model: str
    version: int
    tied: bool


class TopKAnswer(Identity):
    k: int
    shape: list[int]
    """The leading dims of hidden_states; results are one per row, in order."""
    results: list[TopKRow]
    logprobs_over: Literal["candidates", "vocabulary"] | None = None
    """Present when the request shaped the distribution."""
    seed: int | None = None
    """The seed that reproduces the draws, when sampling."""
    logprobs_mode: Literal["raw", "processed"] | None = None
    """Present when the request asked for the decoding step."""


class LogitsAnswer(Identity):
    logits: list[Any]


class EmbedAnswer(Identity):
    embeddings: list[Any]


class RowScore(_Document):
    logit: float
    logprob: float
    rank: int


class CandidateRow(_Document):
    ids: list[int]
    logits: list[float]
    logprobs: list[float]


class ScoreAnswer(Identity):
    results: list[RowScore]
    nll: float
    perplexity: float
    candidates: list[CandidateRow] | None = None
    alternatives: list[CandidateRow] | None = None
    """The top-k tokens at each position, when k was given."""
    logprobs_over: Literal["candidates", "vocabulary"] = "vocabulary"


class KLSummary(_Document):
    mean: float
    p50: float
    p90: float
    max: float


class CompareAnswer(_Document):
    rows: int
    k: int
    top1_agreement: float
    topk_overlap: float
    kl_ab: KLSummary
    kl_ba: KLSummary
    models: list[dict[str, Any]]
    ties: float | None = None


class LensBody(LensOptions):
    model_config = _example(hidden_states=[[_EXAMPLE_ROW], [_EXAMPLE_ROW]], k=3, target_ids=[7])

    hidden_states: list[Any]
    """(layers, tokens, d_model) floats: every layer's hidden states (``output_hidden_states``:
    the embeddings' output first, the post-norm last)."""
    target_ids: list[int] | None = Field(default=None, examples=[[7]])
    """The real next token at each position: adds its log-prob and rank per layer."""


class LensAnswer(Identity):
    k: int
    layers: int
    tokens: int
    token_ids: list[list[list[int]]]
    """[layer][token][k] top token ids."""
    logprobs: list[list[list[float]]]
    token_strings: list[list[list[str | None]]] | None = None
    """The top tokens' strings, when the model has labels."""
    entropy: list[list[float]]
    """[layer][token] entropy of the layer's next-token distribution, in nats."""
    kl_to_last: list[list[float]]
    """[layer][token] KL(last layer's distribution || this layer's), in nats."""
    target_ids: list[int] | None = None
    target_logprobs: list[list[float]] | None = None
    target_ranks: list[list[int]] | None = None
    """[layer][token] tokens ranked above the target (0: it is the top token)."""


class ModelDescription(_Document):
    name: str
    state: str
    reason: str
    versions: list[int]
    served_version: int | None
    model_config = ConfigDict(extra="allow")


class ModelList(_Document):
    models: list[ModelDescription]


class ErrorDetail(_Document):
    code: str
    """Stable machine-readable code, e.g. invalid_input, model_not_found, payload_too_large."""
    message: str
    """Names the field, what was expected and what came; never echoes the request."""


class ErrorAnswer(_Document):
    """Every native error: ``{"error": {"code", "message"}}``."""

    error: ErrorDetail


class RepositoryIndexRow(_Document):
    name: str
    version: str
    state: str
    reason: str
