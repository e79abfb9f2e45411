"""The demo checkpoints hold what real ones of their families hold, named as theirs are: GPT-2's
and Llama's config keys, tensor names and dtypes, and tokenizer.json files whose BPE merges
join tokens of their own vocabularies (what the tokenizers library checks when it loads one)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from service.tools.checkpoints import Checkpoint
from service.tools.demo_checkpoints import (
    GPT2_NAME,
    LLAMA_NAME,
    MIN_VOCAB,
    CheckpointSpec,
    gpt2_tokenizer,
    llama_tokenizer,
    write_demo_checkpoints,
)

SMALL = CheckpointSpec(vocab_size=400, d_model=12, seed=3)


def _json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def test_gpt2_tiny_is_tied_float32_with_gpt2_names(tmp_path: Path) -> None:
    write_demo_checkpoints(tmp_path, SMALL)
    config = _json(tmp_path / GPT2_NAME / "config.json")
    assert config["model_type"] == "gpt2"
    assert config["architectures"] == ["GPT2LMHeadModel"]
    assert (config["vocab_size"], config["n_embd"]) == (400, 12)
    assert config["n_embd"] % config["n_head"] == 0
    assert config["layer_norm_epsilon"] == 1e-5
    assert config["tie_word_embeddings"] is True
    assert {"n_layer", "n_positions"} <= set(config)
    tensors = load_file(str(tmp_path / GPT2_NAME / "model.safetensors"))
    assert {name: (t.shape, t.dtype.name) for name, t in tensors.items()} == {
        "transformer.wte.weight": ((400, 12), "float32"),
        "transformer.wpe.weight": ((config["n_positions"], 12), "float32"),
        "transformer.ln_f.weight": ((12,), "float32"),
        "transformer.ln_f.bias": ((12,), "float32"),
    }


def test_llama_tiny_is_untied_float16_with_llama_names(tmp_path: Path) -> None:
    write_demo_checkpoints(tmp_path, SMALL)
    config = _json(tmp_path / LLAMA_NAME / "config.json")
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["vocab_size"], config["hidden_size"]) == (400, 12)
    assert (config["rms_norm_eps"], config["torch_dtype"]) == (1e-5, "float16")
    assert config["tie_word_embeddings"] is False
    tensors = load_file(str(tmp_path / LLAMA_NAME / "model.safetensors"))
    assert {name: (t.shape, t.dtype.name) for name, t in tensors.items()} == {
        "model.embed_tokens.weight": ((400, 12), "float16"),
        "lm_head.weight": ((400, 12), "float16"),
        "model.norm.weight": ((12,), "float16"),
    }
    table, head = tensors["model.embed_tokens.weight"], tensors["lm_head.weight"]
    correlation = np.corrcoef(table.ravel(), head.ravel())[0, 1]
    assert 0.6 < correlation < 0.95  # related, as a fine-tuned head is, and not a copy


def test_the_importer_reads_them_as_their_families(tmp_path: Path) -> None:
    write_demo_checkpoints(tmp_path, SMALL)
    gpt2 = Checkpoint(tmp_path / GPT2_NAME)
    assert (gpt2.plan().embedding, gpt2.plan().head, gpt2.plan().tied) == (
        "transformer.wte.weight",
        None,
        True,
    )
    llama = Checkpoint(tmp_path / LLAMA_NAME)
    plan = llama.plan()
    assert (plan.embedding, plan.head, plan.tied) == (
        "model.embed_tokens.weight",
        "lm_head.weight",
        False,
    )
    assert gpt2.stored_dtype("transformer.wte.weight") == "float32"
    assert llama.stored_dtype("lm_head.weight") == "float16"


@pytest.mark.parametrize("make", [gpt2_tokenizer, llama_tokenizer])
@pytest.mark.parametrize("size", [MIN_VOCAB, 1024, 5000])
def test_tokenizers_are_bpe_files_whose_merges_join_their_own_tokens(make: Any, size: int) -> None:
    document = make(size)
    model = document["model"]
    assert model["type"] == "BPE"
    vocab: dict[str, int] = model["vocab"]
    assert sorted(vocab.values()) == list(range(size))
    tokens = set(vocab)
    for merge in model["merges"]:
        left, right = merge.split(" ")
        assert {left, right, left + right} <= tokens, merge
    for added in document["added_tokens"]:
        assert vocab[added["content"]] == added["id"]
        assert added["special"] is True
    assert json.loads(json.dumps(document)) == document


def test_the_special_tokens_sit_where_their_models_put_them() -> None:
    gpt2 = gpt2_tokenizer(1024)
    assert [(t["id"], t["content"]) for t in gpt2["added_tokens"]] == [(1023, "<|endoftext|>")]
    assert gpt2["model"]["vocab"]["\u0120"] == 220  # GPT-2's space byte, as in GPT-2
    llama = llama_tokenizer(1024)
    assert [(t["id"], t["content"]) for t in llama["added_tokens"]] == [
        (0, "<unk>"),
        (1, "<s>"),
        (2, "</s>"),
    ]
    assert llama["model"]["vocab"]["<0x0A>"] == 13  # newline's byte token, as in Llama 2
    assert llama["model"]["byte_fallback"] is True


def test_one_seed_writes_the_same_bytes_and_the_files_are_small(tmp_path: Path) -> None:
    first = write_demo_checkpoints(tmp_path / "a")
    write_demo_checkpoints(tmp_path / "b")
    write_demo_checkpoints(tmp_path / "c", CheckpointSpec(seed=1))
    for name in (GPT2_NAME, LLAMA_NAME):
        for file in ("config.json", "model.safetensors", "tokenizer.json"):
            a, b = (tmp_path / run / name / file for run in ("a", "b"))
            assert a.read_bytes() == b.read_bytes(), file
        weights = (tmp_path / "c" / name / "model.safetensors").read_bytes()
        assert weights != (tmp_path / "a" / name / "model.safetensors").read_bytes()
    assert all(100_000 < written.bytes < 1_000_000 for written in first)


def test_existing_checkpoints_are_kept_unless_replaced(tmp_path: Path) -> None:
    write_demo_checkpoints(tmp_path, SMALL)
    weights = tmp_path / GPT2_NAME / "model.safetensors"
    before = weights.read_bytes()
    with pytest.raises(FileExistsError):
        write_demo_checkpoints(tmp_path, CheckpointSpec(seed=9))
    assert weights.read_bytes() == before
    write_demo_checkpoints(tmp_path, CheckpointSpec(seed=9), replace=True)
    assert weights.read_bytes() != before
    assert sorted(path.name for path in tmp_path.iterdir()) == [GPT2_NAME, LLAMA_NAME]


def test_a_vocabulary_too_small_for_llamas_bytes_is_refused() -> None:
    with pytest.raises(ValueError, match=f"at least {MIN_VOCAB} tokens"):
        CheckpointSpec(vocab_size=MIN_VOCAB - 1)
