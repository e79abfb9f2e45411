"""Small checkpoints of real model families, and what each family computes from a residual state.

``write_checkpoint(family, directory)`` writes ``config.json`` and ``model.safetensors`` in that
family's Hugging Face convention: its ``model_type`` and ``architectures``, its epsilon key, its
tying, its tensor names and dtype, and a final norm with non-trivial random weights (a bias
where the family has one). Distractors sit beside it where real checkpoints have them: T5's
encoder has a final norm of its own, OPT's blocks each have a ``final_layer_norm``.

``reference_logits(family, residual_states)`` is what transformers computes from the last
layer's residual states, in float64 and in each family's own formula, written here apart from
``service.heads.norm``: Llama's RMS norm, Gemma's ``1 + weight``, T5's RMS norm then the tied
head's ``d_model ** -0.5``, GPT-2's LayerNorm, Phi's LayerNorm then the head's bias, Gemma-2's
soft-cap. Everything is seeded by the family's name: the reference rebuilds the very tensors
``write_checkpoint`` wrote.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt
from safetensors.numpy import save_file

VOCAB = 384
D_MODEL = 64
GEMMA2_SOFTCAP = 30.0

Arrays = dict[str, npt.NDArray[Any]]


@dataclass(frozen=True)
class Family:
    """One family's convention: where its tensors are, which norm, which epsilon."""

    model_type: str
    architecture: str
    embedding: str
    head: str | None
    """The untied head's tensor; None: tied (the family writes no head)."""
    norm: str
    """The final norm's module: its ``.weight`` (and ``.bias``) are the tensors."""
    kind: str
    """``rms``, ``gemma`` (RMS with ``1 + weight``), ``t5`` (RMS, tied head rescaled) or
    ``layer`` (LayerNorm with a bias)."""
    epsilon_key: str | None
    epsilon: float
    dtype: Any
    config: dict[str, Any] = field(default_factory=dict)
    """The family's other config keys (sizes by their own names, tying, soft-cap)."""


def _llama_like(model_type: str, architecture: str, epsilon: float, **config: Any) -> Family:
    """Llama's layout, shared by Mistral, Qwen2 and Gemma: ``model.`` names, bfloat16,
    ``rms_norm_eps``; untied unless ``tie_word_embeddings`` says so."""
    tied = config.get("tie_word_embeddings", False)
    kind = "gemma" if model_type.startswith("gemma") else "rms"
    sizes = {"hidden_size": D_MODEL, "num_hidden_layers": 0, "num_attention_heads": 4}
    return Family(
        model_type,
        architecture,
        "model.embed_tokens.weight",
        None if tied else "lm_head.weight",
        "model.norm",
        kind,
        "rms_norm_eps",
        epsilon,
        ml_dtypes.bfloat16,
        sizes | {"tie_word_embeddings": tied} | config,
    )


FAMILY: dict[str, Family] = {
    "llama": _llama_like("llama", "LlamaForCausalLM", 1e-5),
    "mistral": _llama_like("mistral", "MistralForCausalLM", 1e-5),
    "qwen2": _llama_like("qwen2", "Qwen2ForCausalLM", 1e-6, tie_word_embeddings=True),
    "gemma": _llama_like("gemma", "GemmaForCausalLM", 1e-6, tie_word_embeddings=True),
    "gemma2": _llama_like(
        "gemma2",
        "Gemma2ForCausalLM",
        1e-6,
        tie_word_embeddings=True,
        final_logit_softcapping=GEMMA2_SOFTCAP,
    ),
    # t5-small's config.json says nothing of tying: transformers' default ties (and rescales).
    "t5": Family(
        "t5",
        "T5ForConditionalGeneration",
        "shared.weight",
        None,
        "decoder.final_layer_norm",
        "t5",
        "layer_norm_epsilon",
        1e-6,
        np.float32,
        {"d_model": D_MODEL, "num_layers": 0, "num_decoder_layers": 0},
    ),
    "gpt2": Family(
        "gpt2",
        "GPT2LMHeadModel",
        "transformer.wte.weight",
        None,
        "transformer.ln_f",
        "layer",
        "layer_norm_epsilon",
        1e-5,
        np.float32,
        {"n_embd": D_MODEL, "n_layer": 0, "n_head": 4, "tie_word_embeddings": True},
    ),
    "gpt_neox": Family(
        "gpt_neox",
        "GPTNeoXForCausalLM",
        "gpt_neox.embed_in.weight",
        "embed_out.weight",
        "gpt_neox.final_layer_norm",
        "layer",
        "layer_norm_eps",
        1e-5,
        np.float16,
        {"hidden_size": D_MODEL, "num_hidden_layers": 0, "tie_word_embeddings": False},
    ),
    # OPT-125m: tied, and its checkpoint ships lm_head.weight as a copy of the table anyway.
    "opt": Family(
        "opt",
        "OPTForCausalLM",
        "model.decoder.embed_tokens.weight",
        None,
        "model.decoder.final_layer_norm",
        "layer",
        None,  # OPTDecoder's nn.LayerNorm takes no eps: torch's 1e-5
        1e-5,
        np.float16,
        {
            "hidden_size": D_MODEL,
            "word_embed_proj_dim": D_MODEL,
            "num_hidden_layers": 1,
            "do_layer_norm_before": True,
            "tie_word_embeddings": True,
        },
    ),
    "phi": Family(
        "phi",
        "PhiForCausalLM",
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.final_layernorm",
        "layer",
        "layer_norm_eps",
        1e-5,
        np.float16,
        {"hidden_size": D_MODEL, "num_hidden_layers": 0, "tie_word_embeddings": False},
    ),
}
FAMILIES = tuple(FAMILY)


def write_checkpoint(family: str, directory: Path) -> Path:
    """``directory`` holding ``config.json`` and ``model.safetensors`` of ``family``."""
    spec = FAMILY[family]
    directory.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {"architectures": [spec.architecture], "model_type": spec.model_type}
    config |= {"vocab_size": VOCAB, "torch_dtype": np.dtype(spec.dtype).name} | spec.config
    if spec.epsilon_key is not None:
        config[spec.epsilon_key] = spec.epsilon
    (directory / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    save_file(tensors(family), str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def tensors(family: str) -> Arrays:
    """Every tensor ``write_checkpoint`` writes, in the family's dtype (the same on each call)."""
    spec = FAMILY[family]
    rng = np.random.default_rng(zlib.crc32(family.encode()))
    table = rng.standard_normal((VOCAB, D_MODEL)) * D_MODEL**-0.5
    # Gemma stores the scale's distance from 1; the others the scale itself.
    scale = (0.0 if spec.kind == "gemma" else 1.0) + 0.3 * rng.standard_normal(D_MODEL)
    found: dict[str, npt.NDArray[np.float64]] = {
        spec.embedding: table,
        f"{spec.norm}.weight": scale,
    }
    if spec.kind == "layer":
        found[f"{spec.norm}.bias"] = 0.2 * rng.standard_normal(D_MODEL)
    if spec.head is not None:
        found[spec.head] = 0.8 * table + 0.6 * rng.standard_normal(table.shape) * D_MODEL**-0.5
    found |= _beside(family, rng, table)
    return {name: array.astype(spec.dtype) for name, array in found.items()}


def _beside(family: str, rng: np.random.Generator, table: Any) -> dict[str, Any]:
    """What real checkpoints hold beside the head's tensors and must not be taken for them."""
    if family == "t5":  # the encoder's own final norm: not the decoder's
        return {"encoder.final_layer_norm.weight": 1 + rng.standard_normal(D_MODEL)}
    if family == "opt":  # a block's norm of the same name, and the redundant head copy
        block = "model.decoder.layers.0.final_layer_norm"
        noise = rng.standard_normal((2, D_MODEL))
        return {f"{block}.weight": 1 + noise[0], f"{block}.bias": noise[1], "lm_head.weight": table}
    if family == "phi":
        return {"lm_head.bias": 0.5 * rng.standard_normal(VOCAB)}
    if family == "gpt2":
        return {"transformer.wpe.weight": 0.01 * rng.standard_normal((16, D_MODEL))}
    return {}


def embedding_table(family: str) -> npt.NDArray[np.float32]:
    """The input embedding as the checkpoint stores it, widened to float32 (exactly)."""
    return tensors(family)[FAMILY[family].embedding].astype(np.float32)


def residual_states(rows: int, seed: int = 0) -> npt.NDArray[np.float32]:
    """Residual states as a last layer leaves them: large, and off-centre (so a LayerNorm's
    mean and every norm's scale matter)."""
    rng = np.random.default_rng(seed)
    return (4.0 * rng.standard_normal((rows, D_MODEL)) + 1.5).astype(np.float32)


def reference_logits(family: str, residual_states: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """(rows, vocab) float64: ``family``'s final norm on ``residual_states``, then its head."""
    spec = FAMILY[family]
    found = {name: array.astype(np.float64) for name, array in tensors(family).items()}
    x = np.asarray(residual_states, np.float64)
    weight, epsilon = found[f"{spec.norm}.weight"], spec.epsilon
    if spec.kind == "layer":  # torch.nn.LayerNorm: biased variance
        centred = x - x.mean(-1, keepdims=True)
        variance = (centred**2).mean(-1, keepdims=True)
        normed = centred / np.sqrt(variance + epsilon) * weight + found[f"{spec.norm}.bias"]
    elif spec.kind == "gemma":  # GemmaRMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + weight)
        normed = x * (1 / np.sqrt((x**2).mean(-1, keepdims=True) + epsilon)) * (1.0 + weight)
    else:  # LlamaRMSNorm and T5LayerNorm: no mean subtracted, no bias
        normed = weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + epsilon))
    if spec.kind == "t5":  # T5ForConditionalGeneration, tied: sequence_output * d_model**-0.5
        normed = normed * D_MODEL**-0.5
    head = found[spec.head] if spec.head is not None else found[spec.embedding]
    logits = normed @ head.T
    if family == "phi":
        logits = logits + found["lm_head.bias"]
    if "final_logit_softcapping" in spec.config:  # Gemma2ForCausalLM
        cap = spec.config["final_logit_softcapping"]
        logits = np.tanh(logits / cap) * cap
    return np.asarray(logits, np.float64)
