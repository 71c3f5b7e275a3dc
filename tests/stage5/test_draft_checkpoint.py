"""A layer-prefix draft checkpoint is the target's first layers with its norm and head, as an
ordinary checkpoint directory: it loads anywhere and computes what the truncated target does."""

from __future__ import annotations

import json

import pytest
import torch

from stage5_server.spec_decode.draft_checkpoint import write_layer_prefix_checkpoint
from tests.shared.test_model_and_weights import our_logits

TOKENS = [3, 14, 15, 92, 65, 35, 89]


def truncated_hf_logits(path, num_layers):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_one_layer_draft_computes_the_targets_first_layer_then_its_head(checkpoints, family, tmp_path):
    draft = write_layer_prefix_checkpoint(checkpoints[family], tmp_path / "draft", 1)
    assert json.loads((draft / "config.json").read_text())["num_hidden_layers"] == 1
    assert (draft / "tokenizer.json").is_file()
    torch.testing.assert_close(our_logits(draft, TOKENS), truncated_hf_logits(checkpoints[family], 1),
                               rtol=1e-4, atol=1e-4)


def test_a_draft_of_every_layer_is_the_target(tiny_llama, tmp_path):
    layers = json.loads((tiny_llama / "config.json").read_text())["num_hidden_layers"]
    draft = write_layer_prefix_checkpoint(tiny_llama, tmp_path / "draft", layers)
    torch.testing.assert_close(our_logits(draft, TOKENS), our_logits(tiny_llama, TOKENS))


@pytest.mark.parametrize("num_layers", [0, 99, 1.5])
def test_a_layer_count_outside_the_model_is_a_value_error(tiny_llama, tmp_path, num_layers):
    with pytest.raises(ValueError, match="num_layers"):
        write_layer_prefix_checkpoint(tiny_llama, tmp_path / "draft", num_layers)
