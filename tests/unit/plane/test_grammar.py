"""A real grammar library over lmhead's sampling: llguidance compiles a JSON schema against the
demo checkpoint's ``tokenizer.json`` (``lmhead demo --checkpoint``), fills each step's token
bitmask, lmhead draws from the head imported from that checkpoint with the mask (and the
output so far as a history, penalized), and the library accepts every drawn token; the text
parses as JSON and fits the schema, and every token was allowed by its step's mask."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.heads.reference import bitmask_allows
from service.messages import (
    DecodingOptions,
    SampleOptions,
    Target,
    TokenLists,
    TopKRequest,
    VocabularyOptions,
)
from service.metrics import Metrics
from service.plane.dataplane import DataPlane
from service.repository.registry import Registry
from service.settings import Settings
from service.tools.demo_checkpoints import GPT2_NAME, write_demo_checkpoints
from service.tools.importer import import_checkpoint

llguidance = pytest.importorskip("llguidance")
guided = pytest.importorskip("llguidance.numpy")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "ok", "n"],
    "additionalProperties": False,
}
STEPS = 200


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("grammar")
    write_demo_checkpoints(root / "checkpoints")
    import_checkpoint(root / "checkpoints" / GPT2_NAME, root / "models", GPT2_NAME)
    return root


def _generate(root: Path, seed: int) -> tuple[str, list[int], list[np.ndarray[Any, Any]]]:
    """Tokens drawn one step at a time until the grammar is done; each step's mask kept."""
    tokenizer = llguidance.LLTokenizer(str(root / "checkpoints" / GPT2_NAME / "tokenizer.json"))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    assert not matcher.get_error()
    mask = guided.allocate_token_bitmask(1, tokenizer.vocab_size)
    rng = np.random.default_rng(seed)

    async def main() -> tuple[list[int], list[np.ndarray[Any, Any]]]:
        settings = Settings(repository=root / "models")
        metrics = Metrics()
        with ThreadPoolExecutor(1) as executor:
            registry = Registry(settings, executor, metrics)
            plane = DataPlane(registry, settings, metrics)
            await registry.load_all()
            tokens: list[int] = []
            masks = []
            try:
                for step in range(STEPS):
                    if matcher.is_stopped():
                        break
                    guided.fill_next_token_bitmask(matcher, mask, 0)
                    masks.append(mask.copy())
                    decoding = DecodingOptions(
                        output_token_ids=TokenLists.of([tokens]),
                        repetition_penalty=1.1,
                        token_bitmask=mask,
                    )
                    sample = SampleOptions(seed=seed * 1000 + step)
                    hidden = rng.standard_normal((1, 64), dtype=np.float32)
                    vocabulary = VocabularyOptions(sample=sample, decoding=decoding)
                    answer = await plane.topk(
                        TopKRequest(Target(GPT2_NAME), hidden, k=1, vocabulary=vocabulary)
                    )
                    assert answer.sampled is not None
                    token = int(answer.sampled.token_ids[0])
                    assert matcher.consume_token(token), matcher.get_error()
                    tokens.append(token)
            finally:
                await plane.close()
                await registry.close()
            return tokens, masks

    tokens, masks = asyncio.run(main())
    assert matcher.is_accepting(), "the grammar was not done within the steps"
    return tokenizer.decode_str(tokens), tokens, masks


@pytest.mark.parametrize("seed", [1, 2])
def test_a_json_schema_grammar_drives_the_draws_to_valid_json(checkpoint: Path, seed: int) -> None:
    text, tokens, masks = _generate(checkpoint, seed)
    value = json.loads(text)
    assert set(value) == {"name", "ok", "n"}
    assert isinstance(value["name"], str)
    assert len(value["name"]) <= 8
    assert isinstance(value["ok"], bool)
    assert isinstance(value["n"], int)
    assert 0 <= value["n"] <= 99
    for token, mask in zip(tokens, masks, strict=True):
        assert bitmask_allows(mask, 1024)[0, token]
