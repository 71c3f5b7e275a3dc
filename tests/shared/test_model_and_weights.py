"""The shared model loads Hugging Face checkpoints and computes what transformers computes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from shared.attention import causal_attention
from shared.config import ModelConfig
from shared.weights import load_model


class DenseAttention:
    """No cache: one sequence attends to itself (enough to compare whole-prompt logits)."""

    def forward(self, layer_idx, query, key, value, attn_metadata, scale):
        return causal_attention(query, key, value, scale)


def our_logits(path, token_ids):
    model, _ = load_model(path)
    model.set_attention_backend(DenseAttention())
    ids = torch.tensor(token_ids)
    return model.compute_logits(model(ids, torch.arange(len(ids)), None))


def hf_logits(path, token_ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_logits_match_transformers(checkpoints, family):
    tokens = list(range(5, 60, 3))
    torch.testing.assert_close(our_logits(checkpoints[family], tokens), hf_logits(checkpoints[family], tokens),
                               rtol=1e-4, atol=1e-4)


def test_sharded_checkpoint_loads_like_the_single_file(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_llama).save_pretrained(sharded, max_shard_size="200KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    tokens = [3, 14, 15, 92, 65]
    torch.testing.assert_close(our_logits(sharded, tokens), our_logits(tiny_llama, tokens))


def test_llama3_rope_scaling_matches_transformers(tiny_llama, tmp_path):
    scaled = tmp_path / "llama3"
    shutil.copytree(tiny_llama, scaled)
    config = json.loads((scaled / "config.json").read_text())
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    config["rope_scaling"] = rope
    config["rope_parameters"] = rope
    (scaled / "config.json").write_text(json.dumps(config))
    assert ModelConfig.from_pretrained(scaled).rope_scaling["rope_type"] == "llama3"
    tokens = list(range(1, 200, 2))  # long enough for the scaled low frequencies to matter
    torch.testing.assert_close(our_logits(scaled, tokens), hf_logits(scaled, tokens), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(our_logits(scaled, tokens), our_logits(tiny_llama, tokens))


def test_unsupported_architecture_is_named(tiny_llama, tmp_path):
    other = tmp_path / "gpt2ish"
    shutil.copytree(tiny_llama, other)
    config = json.loads((other / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model(other)


def test_missing_files_are_named(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path)
    no_weights = tmp_path / "no-weights"
    shutil.copytree(tiny_llama, no_weights)
    for f in no_weights.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ValueError, match="safetensors"):
        load_model(no_weights)


def test_make_tiny_model_writes_a_checkpoint_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from course import make_tiny_model

    path = make_tiny_model(tmp_path / "m", arch="qwen2", seed=3)
    config = ModelConfig.from_pretrained(path)
    assert config.family == "qwen2" and config.attention_bias and config.head_dim >= 32
    assert AutoModelForCausalLM.from_pretrained(path).config.model_type == "qwen2"
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.chat_template and tok.decode(tok.encode("Café 東京 🙂")) == "Café 東京 🙂"
    with pytest.raises(ValueError, match="arch"):
        make_tiny_model(tmp_path / "x", arch="mamba")


def test_size_presets_carry_head_dim_padded_vocab_and_dtype(tmp_path):
    """The knobs of the Qwen3-0.6B preset (used by the GPU check), on a small model."""
    from course import make_tiny_model

    size = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=128, vocab_size=1000, initializer_range=0.02, dtype="bfloat16")
    path = make_tiny_model(tmp_path / "m", arch="qwen3", size=size)
    config = ModelConfig.from_pretrained(path)
    assert (config.head_dim, config.vocab_size, config.num_key_value_heads) == (128, 1000, 1)
    tokens = [5, 6, 7, 8]
    torch.testing.assert_close(our_logits(path, tokens), hf_logits(path, tokens), rtol=1e-3, atol=1e-3)
