"""Each family's synthetic checkpoint, imported and served: top-k and log-probs equal a numpy
reference of the transformed head (scale, bias, soft-cap, temperature)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import ml_dtypes
import numpy as np
import numpy.typing as npt
import pytest
from safetensors.numpy import save_file

from service.heads.reference import log_softmax, top_k
from service.tools.importer import import_checkpoint
from tests.server import running_server

VOCAB, D = 400, 32
T5_FAMILY = ("t5", "mt5", "umt5", "longt5", "switch_transformers")
HIDDEN = np.random.default_rng(3).standard_normal((5, D)).astype(np.float32)


@dataclass(frozen=True)
class Family:
    name: str
    tensors: dict[str, npt.NDArray[Any]]
    config: dict[str, Any]
    tied: bool

    def logits(self, temperature: float) -> npt.NDArray[np.float64]:
        """The transformed head in float64 numpy, from the stored (possibly bf16) tensors."""
        weights = {k: v.astype(np.float64) for k, v in self.tensors.items()}
        table = next(weights[k] for k in weights if "embed" in k or "wte" in k or "shared" in k)
        head = weights.get("lm_head.weight", weights.get("embed_out.weight", table))
        hidden = HIDDEN.astype(np.float64)
        if self.config.get("model_type") in T5_FAMILY and self.tied:  # (transformers'
            hidden = hidden * D**-0.5  # ...ForConditionalGeneration: tied ones only)
        logits = hidden @ head.T + weights.get("lm_head.bias", 0.0)
        logits = logits * self.config.get("logit_scale", 1.0)
        cap = self.config.get("final_logit_softcapping")
        if cap:
            logits = np.tanh(logits / cap) * cap
        result: npt.NDArray[np.float64] = logits / temperature
        return result


def _w(seed: int, dtype: Any = np.float32) -> npt.NDArray[Any]:
    matrix = np.random.default_rng(seed).standard_normal((VOCAB, D)).astype(np.float32)
    return matrix.astype(dtype)


TABLE = _w(0)
FAMILIES = [
    Family("gpt2", {"transformer.wte.weight": _w(0, ml_dtypes.bfloat16)}, {}, tied=True),
    Family("llama32", {"model.embed_tokens.weight": _w(1, np.float16)}, {}, tied=True),
    Family(
        "llama31",
        {"model.embed_tokens.weight": _w(2), "lm_head.weight": _w(3, ml_dtypes.bfloat16)},
        {"tie_word_embeddings": False},
        tied=False,
    ),
    Family(
        "opt",
        {"model.decoder.embed_tokens.weight": TABLE, "lm_head.weight": TABLE.copy()},
        {},
        tied=True,
    ),
    Family(
        "pythia",
        {"gpt_neox.embed_in.weight": _w(4), "embed_out.weight": _w(5)},
        {"tie_word_embeddings": False},
        tied=False,
    ),
    Family("gemma2", {"model.embed_tokens.weight": _w(6)}, {"final_logit_softcapping": 3.0}, True),
    Family(
        "phi2",
        {
            "model.embed_tokens.weight": _w(7),
            "lm_head.weight": _w(8),
            "lm_head.bias": np.random.default_rng(9).standard_normal(VOCAB).astype(np.float32),
        },
        {"tie_word_embeddings": False},
        tied=False,
    ),
    Family("t5", {"shared.weight": _w(10)}, {"model_type": "t5"}, tied=True),
    Family("mt5", {"shared.weight": _w(12)}, {"model_type": "mt5"}, tied=True),
    Family(  # said tied, but the head differs: untied as the weights are, so no rescale
        "t5-own-head",
        {"shared.weight": _w(13), "lm_head.weight": _w(14)},
        {"model_type": "t5", "tie_word_embeddings": True},
        tied=False,
    ),
    Family("cohere", {"model.embed_tokens.weight": _w(11)}, {"logit_scale": 0.0625}, tied=True),
]


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("import")
    for family in FAMILIES:
        source = root / "checkpoints" / family.name
        source.mkdir(parents=True)
        save_file(family.tensors, str(source / "model.safetensors"))
        (source / "config.json").write_text(json.dumps(family.config))
        result = import_checkpoint(source, root / "models", family.name)
        assert result.tied == family.tied, family.name
    with running_server(root / "models") as base_url:
        yield base_url


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_served_head_equals_the_transformed_reference(
    url: str, family: Family, temperature: float
) -> None:
    body = {"hidden_states": HIDDEN.tolist(), "k": 6, "logprobs": True, "temperature": temperature}
    response = httpx.post(f"{url}/v1/models/{family.name}/topk", json=body, timeout=30)
    assert response.status_code == 200, response.text
    payload = response.json()
    assert payload["tied"] is family.tied
    logits = family.logits(temperature)
    values, ids = top_k(logits, 6)
    got_ids = np.array([r["token_ids"] for r in payload["results"]])
    np.testing.assert_array_equal(got_ids, ids)
    got_values = np.array([r["logits"] for r in payload["results"]])
    np.testing.assert_allclose(got_values, values, rtol=1e-4, atol=1e-4)
    expected_lp = np.take_along_axis(log_softmax(logits), ids, axis=-1)
    got_lp = np.array([r["logprobs"] for r in payload["results"]])
    np.testing.assert_allclose(got_lp, expected_lp, rtol=1e-4, atol=1e-4)


def test_metadata_lists_the_transforms(url: str) -> None:
    gemma = httpx.get(f"{url}/v1/models/gemma2").json()
    assert gemma["transforms"] == {"softcap": 3.0}
    phi = httpx.get(f"{url}/v1/models/phi2").json()
    assert phi["transforms"] == {"bias": True}
    t5 = httpx.get(f"{url}/v1/models/t5").json()
    assert t5["transforms"] == {"input_scale": pytest.approx(D**-0.5)}
