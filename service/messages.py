"""What the data plane takes and returns: numpy arrays and small frozen dataclasses.

A front end decodes the wire into one of the requests below (one call), hands it to the data
plane and encodes the result (one call). Nothing here knows HTTP, gRPC or onnxruntime, and
nothing calls back into a front end, so a request and its result could cross a process
boundary as they are. Arrays arrive as decoded, unchecked: the data plane judges them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

Tokens = Sequence[list[str | None]]
"""Token strings of returned ids, one list per (flattened) row; None past the labels file
(a ``service.repository.labels.TokenStrings``, looked up when first read, or a plain list)."""


@dataclass(frozen=True)
class Target:
    """Which model, and which version (None: the one the registry serves)."""

    model: str
    version: int | None = None


@dataclass(frozen=True)
class HeadInfo:
    """The version that answered: for headers, metadata and A/B bookkeeping."""

    name: str
    version: int
    tied: bool
    vocab_size: int
    d_model: int
    dtype: str
    block_size: int | None = None
    """Values per scale of a block-quantized head (``dtype`` int8 or int4)."""
    table_quantized: bool = False
    """The embedding table is block-quantized too (a tied quantized head's one tensor)."""


@dataclass(frozen=True)
class SampleOptions:
    """Draw one token per row: ``temperature`` (0: greedy; the request's when absent),
    ``top_k``, ``top_p``, ``min_p`` filters, and a ``seed`` (a random one when absent);
    ``n`` draws per row (each from its own stream of the seed) when given."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    n: int | None = None


@dataclass(frozen=True)
class TokenLists:
    """Lists of token ids of any lengths, as decoded: every list's ids in one array and each
    list's length (one list per row for histories, one per word for ``bad_words_ids``)."""

    values: npt.NDArray[Any]
    lengths: npt.NDArray[Any]

    @classmethod
    def of(cls, lists: Sequence[Sequence[int]]) -> TokenLists:
        """From lists (JSON's lists of lists, tests)."""
        lengths = np.array([len(tokens) for tokens in lists], np.int64)
        values = np.fromiter((t for tokens in lists for t in tokens), np.int64, int(lengths.sum()))
        return cls(values, lengths)


@dataclass(frozen=True)
class DecodingOptions:
    """The decoding step's options, named as vLLM's ``SamplingParams`` and transformers name
    them (``service.plane.decoding_options`` checks them): token histories, penalties, stop
    rules, a grammar's token bitmask (int32, (rows or 1, ceil(vocab / 32))), which
    distribution log-probs are of (``raw`` or ``processed``) and the filters' order
    (``transformers`` or ``vllm``)."""

    prompt_token_ids: TokenLists | None = None
    output_token_ids: TokenLists | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: npt.NDArray[Any] | None = None
    bad_words_ids: TokenLists | None = None
    token_bitmask: npt.NDArray[Any] | None = None
    logprobs_mode: str | None = None
    processor_order: str | None = None


@dataclass(frozen=True)
class VocabularyOptions:
    """The distribution as the request wants it, as decoded (the data plane checks it)."""

    allowed_token_ids: npt.NDArray[Any] | None = None
    logit_bias: dict[Any, Any] | None = None
    banned_token_ids: npt.NDArray[Any] | None = None
    logprobs_over: str | None = None
    sample: SampleOptions | None = None
    decoding: DecodingOptions | None = None


@dataclass(frozen=True)
class TopKRequest:
    target: Target
    hidden_states: npt.NDArray[Any]
    k: int | None = None
    temperature: float = 1.0
    logprobs: bool = False
    tokens: bool = False
    vocabulary: VocabularyOptions | None = None
    states: str = "final"
    """``final`` (post-norm) hidden states, or ``residual``: the head's final norm first."""


@dataclass(frozen=True)
class TopKResult:
    """Top-k per row, leading dims as sent: ``token_ids``/``logits`` are (..., k)."""

    head: HeadInfo
    token_ids: npt.NDArray[np.int64]
    logits: npt.NDArray[np.float32]
    logsumexp: npt.NDArray[np.float32]
    logprobs: npt.NDArray[np.float32] | None = None
    tokens: Tokens | None = None
    logprobs_over: str = "vocabulary"
    """Which distribution log-probs (and ``logsumexp``) are over: the whole vocabulary, or
    only the allowed tokens."""
    sampled: Sampled | None = None
    logprobs_mode: str | None = None
    """With decoding options: ``raw`` (every processor and the temperature) or ``processed``
    (the filters too: filtered tokens' logits and log-probs are -inf)."""


@dataclass(frozen=True)
class Sampled:
    """One drawn token per row (leading dims as sent), its log-prob (over ``logprobs_over``
    at the sampling temperature, before filters; after them in ``processed`` mode), and the
    seed that reproduces it. With ``n`` (``sample.n``) the arrays have a last axis of n
    draws, and ``tokens`` a list per row."""

    token_ids: npt.NDArray[np.int64]
    logprobs: npt.NDArray[np.float32]
    seed: int
    tokens: list[Any] | None = None
    n: int | None = None


@dataclass(frozen=True)
class LogitsRequest:
    target: Target
    hidden_states: npt.NDArray[Any]
    temperature: float = 1.0
    allowed_token_ids: npt.NDArray[Any] | None = None
    states: str = "final"
    #: The answer is JSON text (up to 16 bytes a value), not binary (4): its declared cost.
    text: bool = False
    decoding: DecodingOptions | None = None
    """The logits after the decoding step's processors (masked tokens at -inf)."""


@dataclass(frozen=True)
class LogitsResult:
    head: HeadInfo
    logits: npt.NDArray[np.float32]
    token_ids: npt.NDArray[np.int64] | None = None
    """The tokens of the columns when restricted to allowed ids (else column = token id)."""


@dataclass(frozen=True)
class EmbedRequest:
    target: Target
    input_ids: npt.NDArray[Any]


@dataclass(frozen=True)
class EmbedResult:
    head: HeadInfo
    embeddings: npt.NDArray[np.float32]


@dataclass(frozen=True)
class InferRequest:
    """Several outputs of one version in one call (the V2 protocol's shape).

    The projection runs when ``hidden_states`` is given, the embedding lookup when
    ``input_ids`` is; both are answered by the same version.
    """

    target: Target
    hidden_states: npt.NDArray[Any] | None = None
    input_ids: npt.NDArray[Any] | None = None
    k: int | None = None
    temperature: float = 1.0
    full_logits: bool = False
    tokens: bool = False
    vocabulary: VocabularyOptions | None = None
    at_least_default_k: bool = False
    """An output takes the model's default k while another asks for its own: the run is as
    wide as the widest of them (a 2-way classification does not narrow the top-k outputs)."""
    states: str = "final"


@dataclass(frozen=True)
class InferResult:
    head: HeadInfo
    topk: TopKResult | None = None
    logits: npt.NDArray[np.float32] | None = None
    embeddings: npt.NDArray[np.float32] | None = None


@dataclass(frozen=True)
class ScoreRequest:
    """Score the real next tokens (one per row), optionally a candidate set too."""

    target: Target
    hidden_states: npt.NDArray[Any]
    target_ids: npt.NDArray[Any]
    candidate_ids: npt.NDArray[Any] | None = None
    k: int = 0
    """Top-k alternatives per position (0: none)."""
    logprobs_over: str | None = None
    """``candidates``: score within ``candidate_ids`` only (no full run); else the vocabulary."""
    states: str = "final"


@dataclass(frozen=True)
class CandidateScores:
    ids: npt.NDArray[np.int64]
    logits: npt.NDArray[np.float32]
    logprobs: npt.NDArray[np.float32]


@dataclass(frozen=True)
class ScoreResult:
    head: HeadInfo
    logit: npt.NDArray[np.float32]
    logprob: npt.NDArray[np.float32]
    rank: npt.NDArray[np.int64]
    nll: float
    perplexity: float
    candidates: CandidateScores | None = None
    alternatives: CandidateScores | None = None
    """Top-k tokens per position (ids, logits, log-probs), when asked."""
    logprobs_over: str = "vocabulary"


@dataclass(frozen=True)
class CompareRequest:
    models: tuple[str, str]
    hidden_states: npt.NDArray[Any]
    target_ids: npt.NDArray[Any] | None = None
    k: int = 10
    measure_speed: bool = False
    states: str = "final"


@dataclass(frozen=True)
class CompareResult:
    """Agreement of two heads over the same rows, and a block per head.

    ``agreement`` holds rows, k, top1_agreement, topk_overlap, kl_ab and kl_ba; each block
    the head's description plus, with targets, nll and perplexity (and rows_per_s if asked);
    ``wins`` (in each block), the share of rows where that head gives the target the higher
    log-prob, and ``ties`` the share of the rest (equal within float32): a share per block, as
    the two may have one name (two versions of a model, or a model against itself).
    """

    agreement: dict[str, Any]
    models: tuple[dict[str, Any], dict[str, Any]]
    ties: float | None = None


@dataclass(frozen=True)
class LensRequest:
    """Every layer's hidden states read through the head (the logit lens): (layers, tokens,
    d_model), residual as ``output_hidden_states`` gives them (``last_layer='final'``: the
    last entry is post-norm already)."""

    target: Target
    hidden_states: npt.NDArray[Any]
    k: int | None = None
    target_ids: npt.NDArray[Any] | None = None
    states: str = "residual"
    last_layer: str = "final"
    tokens: bool = False


@dataclass(frozen=True)
class LensResult:
    """Per layer and token: top-k ids and log-probs, entropy, KL(last || layer) in nats; with
    targets, each target's log-prob and rank (0: the top token) per layer."""

    head: HeadInfo
    token_ids: npt.NDArray[np.int64]
    logprobs: npt.NDArray[np.float32]
    entropy: npt.NDArray[np.float32]
    kl_to_last: npt.NDArray[np.float32]
    target_ids: npt.NDArray[np.int64] | None = None
    target_logprobs: npt.NDArray[np.float32] | None = None
    target_ranks: npt.NDArray[np.int64] | None = None
    tokens: Tokens | None = None
    """Token strings of ``token_ids``, one list per (layer, token) row, layer-major."""


# -- what the control calls return ---------------------------------------------------------


@dataclass(frozen=True)
class VersionDetails:
    """One loaded version as a client sees it: its wiring, sizes and how it runs."""

    version: int
    tied: bool
    vocab_size: int
    d_model: int
    dtype: str
    parameters: int
    weight_bytes: int
    file_bytes: int
    embedding_initializer: str
    projection_initializer: str
    duplicate: str | None
    """``identical`` or ``transposed``: an untied head whose two matrices are one (a broken
    tie the inspector found)."""
    transforms: dict[str, Any]
    quantization: dict[str, Any] | None
    memory_mode: str
    layout: str
    """``one session`` or ``split`` (rows of W read apart from the projection's session)."""
    compute_dtype: str
    providers: tuple[str, ...]
    labels: bool
    """Whether token strings come with answers (a ``vocab.txt`` beside the head)."""
    default_k: int
    trimmed_from: int | None
    """The vocabulary a trimmed head was cut from (ids in and out are that one's)."""
    final_norm: dict[str, Any] | None = None
    """The model's final norm (kind, epsilon, ...), which ``states: residual`` and ``/lens``
    read states through; None: the head has none, and they are refused."""


@dataclass(frozen=True)
class ModelStatus:
    """One model as the registry publishes it: state, versions and the served one's details."""

    name: str
    state: str
    """LOADING, READY, FAILED or UNAVAILABLE."""
    reason: str = ""
    versions: tuple[int, ...] = ()
    served_version: int | None = None
    pinned_version: int | None = None
    failed_versions: dict[int, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    served: VersionDetails | None = None

    def to_json(self) -> dict[str, Any]:
        """The wire's model description: these fields, then the served version's details."""
        details = {} if self.served is None else asdict(self.served)
        details.pop("version", None)
        if "providers" in details:
            details["providers"] = list(details["providers"])
        return {
            "name": self.name,
            "state": self.state,
            "reason": self.reason,
            "versions": list(self.versions),
            "served_version": self.served_version,
            "pinned_version": self.pinned_version,
            "failed_versions": {str(v): why for v, why in sorted(self.failed_versions.items())},
            "notes": list(self.notes),
            **details,
        }


@dataclass(frozen=True)
class IndexEntry:
    """One row of the repository index (Triton's): a version, or a model with none."""

    name: str
    version: str
    """The version number as text, empty for a model without a loaded or failed version."""
    state: str
    reason: str = ""

    def to_json(self) -> dict[str, str]:
        return asdict(self)
