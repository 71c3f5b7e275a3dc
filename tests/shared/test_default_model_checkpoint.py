"""The committed default checkpoint is an ordinary Hugging Face directory that transformers loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared import chat_tasks, default_model, resolve_model

CHECKPOINT = Path(default_model())


def test_default_model_is_the_committed_directory_with_a_model_card():
    assert CHECKPOINT.parent.name == "assets" and CHECKPOINT.parent.parent.name == "shared"
    names = {p.name for p in CHECKPOINT.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
            "README.md"} <= names
    assert sum(p.stat().st_size for p in CHECKPOINT.iterdir()) < 8 * 1024 * 1024
    card = (CHECKPOINT / "README.md").read_text()
    assert "scripts/train_default_model.py" in card and "Held-out accuracy" in card


def test_transformers_loads_model_tokenizer_and_chat_template():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(CHECKPOINT)
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM"
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in model.config.eos_token_id
    assert im_end in GenerationConfig.from_pretrained(CHECKPOINT).eos_token_id
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Add 4 and 5."}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<|im_start|>user\nAdd 4 and 5.<|im_end|>\n<|im_start|>assistant\n"
    # One token per digit, so sums are learnable digit by digit.
    assert tokenizer.tokenize("1234") == ["1", "2", "3", "4"]
    # The task words are single tokens.
    assert all(len(tokenizer.tokenize(" " + word)) == 1 for word in chat_tasks.WORDS)


def test_training_report_matches_the_checkpoint():
    report = json.loads((CHECKPOINT / "training_report.json").read_text())
    config = json.loads((CHECKPOINT / "config.json").read_text())
    assert report["parameters"] < 2_000_000 and config["model_type"] == "llama"
    assert set(report["held_out_accuracy"]) == set(chat_tasks.TASKS)


def test_named_models_resolve():
    assert resolve_model("default") == default_model()
    assert resolve_model("some/dir") == "some/dir"
    with pytest.raises(ValueError, match="model"):
        resolve_model("")
