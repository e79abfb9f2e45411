"""A checkpoint's final norm, found by its model's family: which tensors, which epsilon, which
formula.

``lmhead import`` keeps the norm a model applies between its last layer and its head, so the
head can read residual states (the logit lens, ``service.heads.norm``). The family, not the
tensors, says what that norm computes: Llama's and Cohere's ``model.norm.weight`` share a name
and differ in formula (Cohere subtracts the mean). So the family comes from ``config.json``'s
``model_type``, and a checkpoint of any family not below is imported without a norm, with a
note, rather than with a guessed one. Checked against transformers' modeling and configuration
files (v5.25; the names and keys are those of v4 too):

* RMS, ``model.norm.weight``, ``rms_norm_eps`` (default 1e-6): llama, mistral, mixtral, qwen2,
  qwen3, phi3; gemma and gemma2 with the scale ``1 + weight``;
* RMS, ``decoder.final_layer_norm.weight``, ``layer_norm_epsilon`` (1e-6): t5, mt5, umt5 (the
  decoder's: the encoder has one of its own);
* LayerNorm with a bias: ``transformer.ln_f`` and ``layer_norm_epsilon`` (1e-5): gpt2;
  ``gpt_neox.final_layer_norm`` and ``layer_norm_eps`` (1e-5): gpt_neox;
  ``model.final_layernorm`` and ``layer_norm_eps`` (1e-5): phi; ``model.decoder.final_layer_norm``
  and no key (``nn.LayerNorm``'s 1e-5): opt.

Each name is tried with its base model's prefix, then without it (a bare ``LlamaModel`` saves
``norm.weight``): the first present is kept, and named in what ``import`` prints. Gemma's
``1 + weight`` is folded into the stored scale in float32, as transformers computes it
(``1.0 + self.weight.float()``). OPT has a final norm only when ``do_layer_norm_before`` (OPT-350m
normalizes after each block and has none) and without affine weights when
``layer_norm_elementwise_affine`` is false. A norm over another width than the head's (OPT's
``project_out`` between them) cannot be read through the head alone, and is left out, said.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from service.heads.norm import FinalNorm, NormKind
from service.heads.norm_side import norm_summary
from service.tools.checkpoints import Checkpoint, CheckpointError, config_flag

NO_NORM = "no final norm: residual states (the logit lens) will be refused"
#: transformers adds 1.0 to Gemma's weight in float32 (``GemmaRMSNorm.forward``).
ONE = np.float32(1.0)


@dataclass(frozen=True)
class NormFamily:
    """How one family stores and computes its final norm."""

    kind: NormKind
    names: tuple[str, ...]
    """The weight's names, the base model's prefix first; a bias is ``.bias`` beside it."""
    epsilon_key: str | None
    """The config key of epsilon (None: the module's fixed default, OPT's)."""
    default_epsilon: float
    """transformers' default when the config leaves the key out."""
    one_plus: bool = False
    """Gemma: the scale is ``1 + weight``."""
    bias: bool = False


_LLAMA = NormFamily("rms", ("model.norm.weight", "norm.weight"), "rms_norm_eps", 1e-6)
_T5 = NormFamily("rms", ("decoder.final_layer_norm.weight",), "layer_norm_epsilon", 1e-6)
FAMILIES: dict[str, NormFamily] = {
    **dict.fromkeys(("llama", "mistral", "mixtral", "qwen2", "qwen3", "phi3"), _LLAMA),
    **dict.fromkeys(("gemma", "gemma2"), replace(_LLAMA, one_plus=True)),
    **dict.fromkeys(("t5", "mt5", "umt5"), _T5),
    "gpt2": NormFamily(
        "layer", ("transformer.ln_f.weight", "ln_f.weight"), "layer_norm_epsilon", 1e-5, bias=True
    ),
    "gpt_neox": NormFamily(
        "layer",
        ("gpt_neox.final_layer_norm.weight", "final_layer_norm.weight"),
        "layer_norm_eps",
        1e-5,
        bias=True,
    ),
    "opt": NormFamily(
        "layer",
        ("model.decoder.final_layer_norm.weight", "decoder.final_layer_norm.weight"),
        None,
        1e-5,
        bias=True,
    ),
    "phi": NormFamily(
        "layer",
        ("model.final_layernorm.weight", "final_layernorm.weight"),
        "layer_norm_eps",
        1e-5,
        bias=True,
    ),
}


@dataclass(frozen=True)
class FoundNorm:
    """The norm to keep (None: none), what ``import`` prints of it, and notes."""

    norm: FinalNorm | None
    notes: list[str]

    @property
    def summary(self) -> str | None:
        return None if self.norm is None else norm_summary(self.norm.describe())


def final_norm(checkpoint: Checkpoint, d_model: int) -> FoundNorm:
    """The checkpoint's final norm over ``d_model``, or None with a note saying why not."""
    model_type = checkpoint.config.get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        known = ", ".join(sorted(FAMILIES))
        said = f"config.json says model_type {model_type!r:.40}"
        if model_type is None:
            there = (checkpoint.directory / "config.json").is_file()
            said = "config.json names no model_type" if there else "no config.json"
        return _none(f"{said}; lmhead knows the final norms of {known}")
    if model_type == "opt" and not _opt_has_final_norm(checkpoint):
        return _none("config.json: an OPT that normalizes after each block (OPT-350m)")
    if model_type == "opt" and not config_flag(
        checkpoint.config, "layer_norm_elementwise_affine", True
    ):
        ones = np.ones(d_model, np.float32)
        norm = _norm(family, ones, np.zeros_like(ones), checkpoint, "OPT's, without affine weights")
        return FoundNorm(norm, [])
    name = next((name for name in family.names if name in checkpoint.names), None)
    if name is None:
        return _none(f"no {' or '.join(family.names)} in the checkpoint")
    weight = checkpoint.tensor(name)
    bias_name = name.removesuffix("weight") + "bias"
    if family.bias and bias_name not in checkpoint.names:
        return _none(f"{name} has no {bias_name} beside it, and {model_type}'s norm has a bias")
    bias = checkpoint.tensor(bias_name) if family.bias else None
    if weight.shape != (d_model,) or (bias is not None and bias.shape != weight.shape):
        shapes = f"{weight.shape}" + ("" if bias is None else f" and {bias.shape}")
        return _none(f"{name} has shape {shapes}, the head's states are {d_model} wide")
    source = ", ".join([name] + ([bias_name] if bias is not None else []))
    if family.one_plus:
        weight = ONE + weight
        source += " (1 + weight, Gemma)"
    return FoundNorm(_norm(family, weight, bias, checkpoint, source), [])


def _norm(
    family: NormFamily,
    weight: npt.NDArray[np.float32],
    bias: npt.NDArray[np.float32] | None,
    checkpoint: Checkpoint,
    source: str,
) -> FinalNorm:
    epsilon = _epsilon(checkpoint, family)
    try:
        return FinalNorm(family.kind, weight, epsilon, bias, source)
    except ValueError as error:  # NaN or Inf: the checkpoint's fault, as in its matrices
        raise CheckpointError(f"{source}: {error} (--no-norm leaves it out)") from None


def _epsilon(checkpoint: Checkpoint, family: NormFamily) -> float:
    key = family.epsilon_key
    value = family.default_epsilon if key is None else checkpoint.config.get(key)
    if value is None:
        return family.default_epsilon
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and 0 < value < 1):
        raise CheckpointError(f"config.json: {key} must be a number in (0, 1), got {value!r:.40}")
    return float(value)


def _opt_has_final_norm(checkpoint: Checkpoint) -> bool:
    """``OPTDecoder``: a final norm exactly when ``do_layer_norm_before`` and not
    ``_remove_final_layer_norm`` (kept for checkpoints fine-tuned before transformers 4.20)."""
    config = checkpoint.config
    return config_flag(config, "do_layer_norm_before", True) and not config_flag(
        config, "_remove_final_layer_norm", False
    )


def _none(why: str) -> FoundNorm:
    return FoundNorm(None, [f"{NO_NORM} ({why})"])
